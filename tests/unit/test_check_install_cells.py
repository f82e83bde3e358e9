"""ci/stacks/check_install_cells.py: what each notebook's install cell would install, and what counts as a change.

Cheap parts only (no pip run): CI runs the whole check against Colab's stack.
"""

import importlib.util
import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "examples" / "notebooks"
WEB = "git+https://github.com/keras-dist/keras-dist"

_spec = importlib.util.spec_from_file_location("check_install_cells", ROOT / "ci" / "stacks" / "check_install_cells.py")
check_install_cells = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_install_cells)


@pytest.fixture
def python_without_tensorflow(tmp_path):
    """A `python` command in which `tensorflow` cannot be imported (as on Colab's TPU runtime)."""
    (tmp_path / "sitecustomize.py").write_text('import sys\nsys.modules["tensorflow"] = None\n')
    command = tmp_path / "python"
    command.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path} exec {sys.executable} "$@"\n')
    command.chmod(0o755)
    return str(command)


@pytest.mark.parametrize("name", sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")))
def test_each_install_cell_installs_keras_dist_alone_where_tensorflow_is_installed(name):
    source = check_install_cells.install_cell(NOTEBOOKS / f"{name}.ipynb")
    assert check_install_cells.recorded_installs(sys.executable, source) == [["-q", WEB]]


def test_the_tpu_cell_adds_tensorflow_tpu_and_a_libtpu_that_imports_where_tensorflow_is_missing(
    python_without_tensorflow,
):
    source = check_install_cells.install_cell(NOTEBOOKS / "tpu.ipynb")
    installs = check_install_cells.recorded_installs(python_without_tensorflow, source)
    assert installs == [["-q", WEB, "tensorflow-tpu==2.20.0", "libtpu==0.0.14"]]


def test_a_cell_that_runs_something_else_fails(tmp_path):
    source = "import subprocess\nsubprocess.run(['rm', '-rf', 'x'])\n"
    with pytest.raises(RuntimeError, match="runs something other than pip install"):
        check_install_cells.recorded_installs(sys.executable, source)
    magic = "!pip install -q keras-dist[tensorflow]\n"
    assert check_install_cells.recorded_installs(sys.executable, magic) == [["-q", "keras-dist[tensorflow]"]]


def test_keras_dist_points_at_the_checkout_with_its_extras():
    args, found = check_install_cells.local_arguments(["-q", WEB, "libtpu==0.0.14"], "/src")
    assert (args, found) == (["/src", "libtpu==0.0.14"], True)
    assert check_install_cells.local_arguments(["keras_dist[tensorflow]"], "/src") == (["/src[tensorflow]"], True)
    assert check_install_cells.local_arguments(["keras"], "/src") == (["keras"], False)


def test_changes_name_each_protected_distribution_pip_would_touch():
    installed = {"keras": "3.13.2", "tensorflow": "2.20.0", "h5py": "3.16.0", "numpy": "2.0.2"}
    planned = [
        ("keras-dist", "0.1.0"),
        ("keras", "3.15.1"),
        ("tensorflow", "2.21.0"),
        ("h5py", "3.14.0"),
        ("tensorflow-datasets", "4.9.10"),
        ("tf-keras", "2.20.0"),
        ("rich", "15.0.0"),
        ("packaging", "26.0"),
    ]
    assert check_install_cells.changes(planned, installed) == [
        "change keras 3.13.2 -> 3.15.1",
        "change tensorflow 2.20.0 -> 2.21.0",
        "change h5py 3.16.0 -> 3.14.0",
        "install tensorflow-datasets 4.9.10",
        "install tf-keras 2.20.0",
    ]
    assert check_install_cells.normalize("Tensorflow_CPU") == "tensorflow-cpu"


def test_the_check_fails_naming_the_notebook(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(check_install_cells, "installed_versions", lambda python: {"keras": "3.13.2"})
    monkeypatch.setattr(check_install_cells, "dry_run", lambda python, args: [("keras-dist", "0"), ("keras", "3.15.1")])
    status = check_install_cells.check(sys.executable, str(NOTEBOOKS), str(ROOT))
    out = capsys.readouterr().out
    assert status == 1
    assert "FAIL  mnist_tfds.ipynb: pip would change keras 3.13.2 -> 3.15.1" in out
    (tmp_path / "bare.ipynb").write_text('{"cells": [{"cell_type": "code", "source": "print(1)"}]}')
    assert check_install_cells.check(sys.executable, str(tmp_path), str(ROOT)) == 2
    assert "ERROR bare.ipynb: no install cell" in capsys.readouterr().out
    assert os.path.exists(ROOT / "ci" / "stacks" / "check_install_cells.py")
