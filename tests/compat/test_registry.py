"""Every fix is documented, gated on the versions it was verified on, and still needed for those pyproject.toml claims."""

import os
import pathlib
import re
import subprocess
import sys
import types
import warnings

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from keras_dist import _compat, errors
from keras_dist._compat import keras_fixes, versions

pytestmark = pytest.mark.compat


ROOT = pathlib.Path(__file__).resolve().parents[2]


def _minimum_supported(package):
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(rf'"{package}>=([0-9.]+)', text)
    assert match, f"pyproject.toml states no minimum for {package}"
    return Version(match.group(1))


def _staleness(fix, minimum):
    """Returns why `fix` is stale for the `minimum` supported version of its package, or `None`."""
    if minimum in SpecifierSet(fix.verified):
        return None
    return (
        f"{fix.name} is not verified on the minimum supported {fix.package} {minimum} "
        f"(verified: {fix.verified}); verify it there and widen the range, or remove it ({fix.remove_when})."
    )


@pytest.mark.parametrize("name", sorted(_compat.FIXES))
def test_fix_is_documented_and_has_its_test(name):
    fix = _compat.FIXES[name]
    assert fix.upstream.startswith("https://")
    assert fix.symptom and fix.remedy and fix.remove_when
    assert fix.package in versions.INSTALLED
    SpecifierSet(fix.verified)  # parses
    assert (ROOT / "tests" / "compat" / f"test_{name}.py").exists()


@pytest.mark.parametrize("name", sorted(_compat.FIXES))
def test_fix_range_is_closed(name):
    """A range states the versions verified: it has an upper bound (`>=3.0` would claim every future release)."""
    specifiers = SpecifierSet(_compat.FIXES[name].verified)
    assert any(s.operator in ("<", "<=", "==", "~=", "===") for s in specifiers), (
        f"{name}: verified={_compat.FIXES[name].verified!r} is open-ended; give the verified upper bound."
    )


@pytest.mark.parametrize("name", sorted(_compat.FIXES))
def test_fix_still_applies_to_minimum_supported_version(name):
    """Fails once the minimum supported version is outside `verified`: widen the range or delete the fix then."""
    fix = _compat.FIXES[name]
    problem = _staleness(fix, _minimum_supported(fix.package))
    assert problem is None, problem


def test_staleness_check_can_fail():
    """A fake entry verified only below the minimum supported Keras is reported stale."""
    fake = _compat.Fix(
        name="fake_fix",
        package="keras",
        verified=">=3.10,<3.15",
        upstream="https://example.invalid",
        symptom="s",
        remedy="r",
        remove_when="now",
    )
    assert _staleness(fake, _minimum_supported("keras")) is not None
    assert "fake_fix" in _staleness(fake, Version("3.15.0"))
    assert _staleness(fake, Version("3.14.1")) is None


# ---- The gate switches fixes off outside their verified range (the running version faked).


@pytest.fixture
def fake_versions(monkeypatch):
    """Returns `set(package, version)`, which makes the registry see `version` as installed."""
    monkeypatch.delenv(keras_fixes.FORCE_ENV, raising=False)
    monkeypatch.delenv(keras_fixes.DISABLE_ENV, raising=False)
    monkeypatch.setattr(keras_fixes, "_warned", False)

    def set_version(package, version):
        monkeypatch.setitem(versions.INSTALLED, package, Version(version))

    return set_version


def _fixes_of(package):
    return sorted(name for name, fix in _compat.FIXES.items() if fix.package == package)


@pytest.mark.parametrize("version", ["3.14.2", "3.16.0", "4.0.0"])
def test_keras_fixes_are_off_outside_their_verified_range(fake_versions, version):
    fake_versions("keras", version)
    assert not any(_compat.is_active(name) for name in _fixes_of("keras"))
    assert all(_compat.is_active(name) for name in _fixes_of("tensorflow"))  # Gated on TensorFlow's version.


@pytest.mark.parametrize("version", ["3.15.0", "3.15.1", "3.15.9"])
def test_keras_fixes_are_on_inside_their_verified_range(fake_versions, version):
    fake_versions("keras", version)
    assert all(_compat.is_active(name) for name in _fixes_of("keras"))


@pytest.mark.parametrize(("version", "active"), [("2.20.0", False), ("2.21.0", True), ("2.22.0", False)])
def test_tensorflow_fixes_follow_the_tensorflow_version(fake_versions, version, active):
    fake_versions("tensorflow", version)
    assert [_compat.is_active(name) for name in _fixes_of("tensorflow")] == [active] * len(_fixes_of("tensorflow"))
    assert all(_compat.is_active(name) for name in _fixes_of("keras"))


def test_a_fix_off_by_version_is_off_where_it_is_used(fake_versions):
    """The gate reaches a real call site: outside the range a generator's batches are no longer copied."""
    from keras_dist.data import _inputs

    def generator():
        yield [1.0]

    strategy = types.SimpleNamespace(num_replicas_in_sync=2)
    on = generator()
    assert _inputs.prepare(on, strategy=strategy, model=None, batch_size=None) is not on  # copy_batches
    fake_versions("keras", "3.16.0")
    off = generator()
    assert _inputs.prepare(off, strategy=strategy, model=None, batch_size=None) is off


def test_force_turns_fixes_on_outside_their_range(fake_versions, monkeypatch):
    fake_versions("keras", "3.16.0")
    monkeypatch.setenv(keras_fixes.FORCE_ENV, "cross_replica_metrics, predict_on_batch_split")
    assert _compat.is_active("cross_replica_metrics") and _compat.is_active("predict_on_batch_split")
    assert not _compat.is_active("example_weighted_loss")
    monkeypatch.setenv(keras_fixes.FORCE_ENV, "all")
    assert all(_compat.is_active(name) for name in _compat.FIXES)
    assert not _compat.unverified_fixes()
    with _compat.disabled("cross_replica_metrics"):  # Disabling still wins (the compat tests rely on it).
        assert not _compat.is_active("cross_replica_metrics")


def test_unverified_version_warns_once_naming_the_fixes_and_the_override(fake_versions):
    fake_versions("tensorflow", "2.22.0")
    with pytest.warns(errors.KerasDistWarning, match=keras_fixes.FORCE_ENV) as record:
        _compat.warn_if_unverified()
    message = str(record[0].message)
    assert "tensorflow 2.22.0" in message and all(name in message for name in _fixes_of("tensorflow"))
    assert "example_weighted_loss" not in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat.warn_if_unverified()  # Once per process.


def test_verified_versions_do_not_warn(fake_versions):
    assert not _compat.unverified_fixes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat.warn_if_unverified()


def test_forced_fixes_do_not_warn(fake_versions, monkeypatch):
    fake_versions("keras", "3.16.0")
    monkeypatch.setenv(keras_fixes.FORCE_ENV, "all")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat.warn_if_unverified()


def test_all_fixes_active_on_installed_versions():
    assert {f.name for f in _compat.active_fixes()} == set(_compat.FIXES)


def test_disabled_rejects_unknown_names():
    with pytest.raises(KeyError, match="Unknown fix name"):
        with _compat.disabled("no_such_fix"):
            pass


def test_compat_page_lists_every_fix():
    page = (ROOT / "docs" / "compat.md").read_text()
    missing = [name for name in _compat.FIXES if f"`{name}`" not in page]
    assert not missing, f"docs/compat.md does not list {missing}"


@pytest.mark.parametrize("name", sorted(_compat.FIXES))
def test_compat_page_states_each_verified_range(name):
    page = (ROOT / "docs" / "compat.md").read_text()
    fix = _compat.FIXES[name]
    section = page.split(f"## `{name}`", 1)[1].split("\n## ", 1)[0]
    assert f"- Verified: {fix.package} `{fix.verified}`" in section, f"docs/compat.md: update {name}'s range"


def test_import_warns_once_on_an_unverified_keras():
    """End to end: `import keras_dist` under a Keras that reports 3.16.0 warns once and leaves the Keras fixes off."""
    script = (
        "import keras; keras.__version__ = '3.16.0'\n"
        "import keras_dist\n"
        "from keras_dist import _compat\n"
        "_compat.warn_if_unverified()\n"
        "print('ACTIVE', sorted(f.name for f in _compat.active_fixes()))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_DIST_QUIET": "1"}
    for name in ("TF_CONFIG", keras_fixes.FORCE_ENV, keras_fixes.DISABLE_ENV):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count(keras_fixes.FORCE_ENV) == 1, done.stderr
    assert f"ACTIVE {_fixes_of('tensorflow')}" in done.stdout
