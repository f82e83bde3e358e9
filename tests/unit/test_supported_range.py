"""One supported range (`keras_dist.version.SUPPORTED`), stated alike by pyproject.toml, docs/compat.md and `keras-dist env`."""

import pathlib

import pytest
from packaging.requirements import Requirement

from keras_dist import version
from keras_dist.cli import env

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = pathlib.Path(__file__).resolve().parents[2]


def disagreements(pyproject_text, compat_text):
    """Returns each place where pyproject.toml or docs/compat.md states another range than `version.SUPPORTED`."""
    project = tomllib.loads(pyproject_text)["project"]
    expected = version.declared_requirements()
    found = []
    if project["requires-python"] != expected["requires-python"]:
        found.append(
            f"pyproject.toml: requires-python = {project['requires-python']!r}, not {expected['requires-python']!r}"
        )
    dependencies = [Requirement(line) for line in project["dependencies"]]
    keras = [str(r) for r in dependencies if r.name == "keras"]
    if keras != [expected["keras"]]:
        found.append(f"pyproject.toml: dependencies say {keras}, not [{expected['keras']!r}]")
    tensorflow = [r.name for r in dependencies if r.name in ("tensorflow", "tensorflow-cpu", "tf-nightly")]
    if tensorflow:
        found.append(f"pyproject.toml: {tensorflow} in dependencies (pip would replace the user's TensorFlow)")
    extra = project["optional-dependencies"].get("tensorflow")
    if extra != [expected["tensorflow"]]:
        found.append(f"pyproject.toml: the [tensorflow] extra is {extra}, not [{expected['tensorflow']!r}]")
    if version.supported_statement() not in compat_text.splitlines():
        found.append(f"docs/compat.md: no line reads {version.supported_statement()!r}")
    if f'`requires-python = "{expected["requires-python"]}"`, `{expected["keras"]}`' not in compat_text:
        found.append("docs/compat.md: the declared requirements differ from pyproject.toml's")
    return found


def test_pyproject_and_compat_md_state_the_supported_range():
    pyproject = (ROOT / "pyproject.toml").read_text()
    compat = (ROOT / "docs" / "compat.md").read_text()
    assert disagreements(pyproject, compat) == []


def test_a_different_range_anywhere_is_found():
    """The check can fail: each planted change is named."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    compat = (ROOT / "docs" / "compat.md").read_text()
    planted = (
        pyproject.replace('">=3.10,<3.14"', '">=3.11,<3.14"')
        .replace('"keras>=3.10"', '"keras>=3.10,<3.16"')
        .replace('tensorflow = ["tensorflow>=2.18"]', 'tensorflow = ["tensorflow>=2.20"]')
        .replace('"packaging>=23",', '"packaging>=23", "tensorflow>=2.18",')
    )
    found = disagreements(planted, compat.replace("Keras 3.10-3.15", "Keras 3.13-3.15"))
    expected = [
        "pyproject.toml: requires-python = '>=3.11,<3.14'",
        "pyproject.toml: dependencies say ['keras<3.16,>=3.10']",
        "pyproject.toml: ['tensorflow'] in dependencies",
        "pyproject.toml: the [tensorflow] extra is ['tensorflow>=2.20']",
        "docs/compat.md: no line reads 'Supported and tested: Python 3.10-3.13, Keras 3.10-3.15,",
    ]
    assert len(found) == len(expected), found
    assert all(line.startswith(start) for line, start in zip(found, expected)), found


def test_env_states_the_same_range_and_places_the_running_versions():
    sections = env.collect_environment({})
    assert sections["Supported and tested"]["range"] == "Python 3.10-3.13, Keras 3.10-3.15, TensorFlow 2.18-2.21"
    assert sections["Supported and tested"]["tested stacks"] in version.supported_statement()
    for name in ("python", "keras", "tensorflow"):
        assert f"the supported range {version.supported_range(name)}" in sections["Versions"][name]


@pytest.mark.parametrize("label", sorted(version.TESTED_STACKS))
def test_each_tested_stack_is_inside_the_supported_range(label):
    stack = version.TESTED_STACKS[label]
    assert all(version.in_supported_range(name, stack[name]) for name in version.SUPPORTED)


@pytest.mark.parametrize(
    ("package", "installed", "inside"),
    [
        ("keras", "3.10.0", True),
        ("keras", "3.15.9", True),
        ("keras", "3.9.3", False),
        ("keras", "3.16.0", False),
        ("keras", "3.16.0.dev2026080103", False),  # keras-nightly
        ("keras", "3.15.0rc1", False),
        ("tensorflow", "2.18.1", True),
        ("tensorflow", "2.23.0.dev20260801", False),  # tf-nightly
        ("tensorflow", "2.17.1", False),
        ("python", "3.13.0", True),
        ("python", "3.14.0", False),
        ("tensorflow", "not-a-version", False),
    ],
)
def test_in_supported_range(package, installed, inside):
    assert version.in_supported_range(package, installed) is inside
