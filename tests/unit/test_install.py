"""keras-dist installed beside whichever TensorFlow the user has, or none: what it says, and what still runs.

Without TensorFlow: each test runs a subprocess whose `sitecustomize` makes `tensorflow` unimportable
(`sys.modules["tensorflow"] = None`, as `importlib` reads a missing module), so nothing here imports
TensorFlow and each subprocess takes about a second.
"""

import os
import pathlib
import subprocess
import sys

import pytest

import keras_dist
from keras_dist.cli import env
from keras_dist.testing import clean_env, run_launcher

ROOT = pathlib.Path(__file__).resolve().parents[2]

BLOCKER = """
import sys
sys.modules["tensorflow"] = None  # `import tensorflow` raises ModuleNotFoundError(name="tensorflow").
"""


@pytest.fixture
def no_tensorflow_env(tmp_path):
    """The environment of a subprocess (and its children) in which `tensorflow` cannot be imported."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    return clean_env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]), KERAS_DIST_QUIET="1")


def _python(code, env, cwd):
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(150)
def test_import_without_tensorflow_says_what_is_needed_and_how_to_install_it(no_tensorflow_env, tmp_path):
    code = (
        "import sys\n"
        "try:\n"
        "    import keras_dist\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e.name, 'keras' in sys.modules)\n"
        "    raise\n"
    )
    result = _python(code, no_tensorflow_env, tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.strip() == "tensorflow False"  # Caught before Keras' own import error.
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("ModuleNotFoundError: keras-dist trains through tf.distribute and needs TensorFlow")
    for text in ("Received: no module named 'tensorflow'", 'pip install "keras-dist[tensorflow]"'):
        assert text in last_line
    for distribution in ("`tensorflow-cpu`", "`tensorflow-tpu`", "`tf-nightly`"):
        assert distribution in last_line


def test_the_message_states_the_supported_tensorflow_range():
    assert "(supported: 2.18-2.21)" in keras_dist.version.missing_tensorflow_message()


@pytest.mark.multi_worker  # Starts 2 worker processes (that import nothing).
@pytest.mark.timeout(150)
def test_the_launcher_runs_without_tensorflow(no_tensorflow_env, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text("import json, os, sys\nprint('task', json.loads(os.environ['TF_CONFIG'])['task']['index'])\n")
    result = run_launcher(["--num-workers", "2", str(script)], env=no_tensorflow_env, cwd=tmp_path, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[worker:0] task 0" in result.stdout and "[worker:1] task 1" in result.stdout
    version = subprocess.run(
        [sys.executable, "-m", "keras_dist.cli", "--version"],
        env=no_tensorflow_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert version.stdout.strip() == f"keras-dist {keras_dist.__version__}"


@pytest.mark.timeout(150)
def test_env_without_tensorflow_reports_it_missing_and_the_fix(no_tensorflow_env, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "keras_dist.cli", "env"],
        env=no_tensorflow_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "- tensorflow: not installed\n" in result.stdout
    assert "### TensorFlow\n- error: keras-dist trains through tf.distribute" in result.stdout
    assert "### Supported and tested\n- range: Python 3.10-3.13, Keras 3.10-3.15, TensorFlow 2.18-2.21" in result.stdout


# ---- `keras-dist env` names the distribution that installed each module.


@pytest.fixture
def installed(monkeypatch):
    """Returns `set(versions)`: `importlib.metadata.version` then answers from `versions` (dist -> version)."""
    versions = {}

    def version(name):
        if name in versions:
            return versions[name]
        raise env.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(env.metadata, "version", version)
    return versions.update


@pytest.mark.parametrize(
    ("distributions", "expected"),
    [
        (
            {"tensorflow": ["tf-nightly"], "keras": ["keras-nightly"]},
            {
                "tensorflow": "2.23.0.dev20260801 (distribution tf-nightly; outside the supported range 2.18-2.21: "
                "not tested (see docs/compat.md))",
                "keras": "3.16.0.dev2026080103 (distribution keras-nightly; outside the supported range 3.10-3.15: "
                "not tested (see docs/compat.md))",
            },
        ),
        (
            {"tensorflow": ["tensorflow_tpu"], "keras": ["keras"]},
            {
                "tensorflow": "2.20.0 (distribution tensorflow-tpu; inside the supported range 2.18-2.21)",
                "keras": "3.13.2 (distribution keras; inside the supported range 3.10-3.15)",
            },
        ),
        (
            {"tensorflow": ["tensorflow-cpu", "tensorflow"], "keras": []},
            {
                "tensorflow": "unknown version (distributions tensorflow-cpu 2.20.0, tensorflow 2.21.0 each install "
                "the `tensorflow` module, over one another's files: uninstall them all, then install one)",
                "keras": "unknown version (no installed distribution: imported from ",
            },
        ),
    ],
    ids=["nightlies", "tensorflow-tpu", "two-distributions"],
)
def test_env_names_the_distribution_that_installed_each_module(installed, monkeypatch, distributions, expected):
    installed(
        {
            "tf-nightly": "2.23.0.dev20260801",
            "keras-nightly": "3.16.0.dev2026080103",
            "tensorflow_tpu": "2.20.0",
            "keras": "3.13.2",
            "tensorflow-cpu": "2.20.0",
            "tensorflow": "2.21.0",
        }
    )
    for module in ("keras", "tensorflow"):  # Not imported: the version comes from the distribution.
        monkeypatch.delitem(sys.modules, module, raising=False)
    versions = env.collect_versions(distributions)
    for name, description in expected.items():
        assert versions[name].startswith(description), versions[name]
    assert versions["protobuf"] == "not installed" and versions["libtpu"] == "not installed"


def test_env_uses_the_running_modules_version_where_it_is_imported(installed):
    installed({"tensorflow": "0.0.1"})  # Stale metadata: the imported module's __version__ wins.
    import tensorflow as tf

    # Inside or outside the supported range depends on the stack (tf-nightly is outside): not asserted here.
    assert env.collect_versions({"tensorflow": ["tensorflow"]})["tensorflow"].startswith(
        f"{tf.__version__} (distribution tensorflow; "
    )
