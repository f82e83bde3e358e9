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
        verified=">=3.0,<3.1",
        upstream="https://example.invalid",
        symptom="s",
        remedy="r",
        remove_when="now",
    )
    assert _staleness(fake, _minimum_supported("keras")) is not None
    assert "fake_fix" in _staleness(fake, Version("3.1.0"))
    assert _staleness(fake, Version("3.0.5")) is None


def _bounds(fix):
    """Returns `(lowest, highest)` of the closed range `fix.verified` (`>=lowest,<highest`), as `Version`s."""
    specifiers = {s.operator: Version(s.version) for s in SpecifierSet(fix.verified)}
    return specifiers[">="], specifiers["<"]


def _minor(version):
    return Version(version).release[:2]


@pytest.mark.parametrize("name", sorted(_compat.FIXES))
def test_each_fix_lists_the_versions_it_was_checked_on_and_its_range_spans_them(name):
    """Issue 20: a range is the closed span of the minors its tests ran on (`checked_on`), nothing wider."""
    fix = _compat.FIXES[name]
    lowest, highest = _bounds(fix)
    released = [v for v in fix.checked_on if not Version(v).is_prerelease]
    assert released, f"{name}: checked_on lists no released {fix.package} version"
    assert min(_minor(v) for v in released) == lowest.release[:2], (
        f"{name}: verified={fix.verified!r} starts below or above the oldest version checked {fix.checked_on}"
    )
    assert max(_minor(v) for v in released) == (highest.release[0], highest.release[1] - 1), (
        f"{name}: verified={fix.verified!r} ends below or above the newest version checked {fix.checked_on}"
    )
    inside = [v for v in released if SpecifierSet(fix.verified).contains(v)]
    assert inside == released


# ---- The gate switches fixes off outside their verified range (the running version faked).


# Versions every fix of a package was checked on (the installed stack may be any supported one, or a nightly).
KERAS_CHECKED = "3.13.2"
TF_CHECKED = "2.20.0"


@pytest.fixture
def fake_versions(monkeypatch):
    """Returns `set(package, version)`, which makes the registry see `version` as installed.

    Starts from Keras and TensorFlow versions that every fix was checked on, whatever is installed.
    """
    monkeypatch.delenv(keras_fixes.FORCE_ENV, raising=False)
    monkeypatch.delenv(keras_fixes.DISABLE_ENV, raising=False)
    monkeypatch.setattr(keras_fixes, "_warned", False)

    def set_version(package, version):
        monkeypatch.setitem(versions.INSTALLED, package, Version(version))

    set_version("keras", KERAS_CHECKED)
    set_version("tensorflow", TF_CHECKED)
    return set_version


def _fixes_of(package):
    return sorted(name for name, fix in _compat.FIXES.items() if fix.package == package)


def test_the_versions_the_gate_tests_start_from_were_checked_for_every_fix():
    for name, fix in _compat.FIXES.items():
        assert {"keras": KERAS_CHECKED, "tensorflow": TF_CHECKED}[fix.package] in fix.checked_on, name


@pytest.mark.parametrize("name", sorted(_compat.FIXES))
def test_each_fix_is_off_just_outside_its_verified_range(fake_versions, name):
    fix = _compat.FIXES[name]
    lowest, highest = _bounds(fix)
    below = f"{lowest.release[0]}.{lowest.release[1] - 1}.9" if lowest.release[1] else f"{lowest.release[0] - 1}.99.0"
    for version in (below, str(highest), f"{highest}.dev20260101", "4.0.0" if fix.package == "keras" else "3.0.0"):
        fake_versions(fix.package, version)
        assert not _compat.is_active(name), f"{name} is on with {fix.package} {version} (verified: {fix.verified})"


@pytest.mark.parametrize("name", sorted(_compat.FIXES))
def test_each_fix_is_on_for_every_version_it_was_checked_on(fake_versions, name):
    fix = _compat.FIXES[name]
    for version in fix.checked_on:
        if Version(version).is_prerelease:
            continue  # A nightly build it works on; the range grows only with releases.
        fake_versions(fix.package, version)
        assert _compat.is_active(name), f"{name} is off with {fix.package} {version} (verified: {fix.verified})"


@pytest.mark.parametrize("version", ["3.16.0", "3.16.0.dev2026102704", "4.0.0"])
def test_keras_fixes_are_off_on_an_unverified_keras_and_tensorflow_fixes_stay_on(fake_versions, version):
    fake_versions("keras", version)
    assert not any(_compat.is_active(name) for name in _fixes_of("keras"))
    assert all(_compat.is_active(name) for name in _fixes_of("tensorflow"))  # Gated on TensorFlow's version.


@pytest.mark.parametrize(("version", "active"), [("2.17.1", False), ("2.20.0", True), ("2.23.0.dev20261026", False)])
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
    fake_versions("tensorflow", "2.23.0.dev20261026")
    with pytest.warns(errors.KerasDistWarning, match=keras_fixes.FORCE_ENV) as record:
        _compat.warn_if_unverified()
    message = str(record[0].message)
    assert "tensorflow 2.23.0.dev20261026" in message and all(name in message for name in _fixes_of("tensorflow"))
    assert "example_weighted_loss" not in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat.warn_if_unverified()  # Once per process.


def test_verified_versions_do_not_warn(fake_versions):
    fake_versions("keras", "3.10.0")  # summed_activity_regularization stops at 3.14: all are on here.
    assert not _compat.unverified_fixes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat.warn_if_unverified()


def test_a_fix_whose_bug_is_fixed_upstream_is_off_without_a_warning(fake_versions):
    # Keras 3.15 has no summed_activity_regularization bug (fixed in 3.14): off, and nothing to warn about.
    fake_versions("keras", "3.15.1")
    assert not _compat.is_active("summed_activity_regularization")
    assert "summed_activity_regularization" not in {fix.name for fix in _compat.unverified_fixes()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat.warn_if_unverified()
    fake_versions("keras", "3.13.2")  # Before the upstream fix: in its verified range, on.
    assert _compat.is_active("summed_activity_regularization")


def test_fixed_in_is_outside_the_verified_range():
    for fix in _compat.FIXES.values():
        if fix.fixed_in:
            assert not SpecifierSet(fix.verified).contains(fix.fixed_in, prereleases=True), fix.name


def test_forced_fixes_do_not_warn(fake_versions, monkeypatch):
    fake_versions("keras", "3.16.0")
    monkeypatch.setenv(keras_fixes.FORCE_ENV, "all")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat.warn_if_unverified()


def test_active_fixes_are_those_verified_or_forced_for_the_installed_versions(monkeypatch):
    """On any stack: a fix is on exactly when the installed version is in its range (or it is forced)."""
    monkeypatch.delenv(keras_fixes.DISABLE_ENV, raising=False)
    expected = {name for name, fix in _compat.FIXES.items() if fix.applies_to_installed() or _compat.is_forced(name)}
    assert {f.name for f in _compat.active_fixes()} == expected


def test_clean_env_passes_forced_fixes_through_to_workers():
    """A stack outside the verified ranges is tested with KERAS_DIST_FORCE_FIXES: its workers must run the same fixes."""
    from keras_dist.testing import clean_env

    env = clean_env({"KERAS_DIST_FORCE_FIXES": "all", "KERAS_DIST_CPU_REPLICAS": "2", "TF_CONFIG": "{}"})
    assert env["KERAS_DIST_FORCE_FIXES"] == "all"
    assert "KERAS_DIST_CPU_REPLICAS" not in env and "TF_CONFIG" not in env


def test_disabled_rejects_unknown_names():
    with pytest.raises(KeyError, match="Unknown fix name"):
        with _compat.disabled("no_such_fix"):
            pass


def test_compat_page_lists_every_fix():
    page = (ROOT / "docs" / "compat.md").read_text()
    missing = [name for name in _compat.FIXES if f"`{name}`" not in page]
    assert not missing, f"docs/compat.md does not list {missing}"


def _checked_on_text(fix):
    """How docs/compat.md states `fix.checked_on`: the releases, then the nightly builds the fix works on."""
    released = [v for v in fix.checked_on if not Version(v).is_prerelease]
    nightly = [v for v in fix.checked_on if Version(v).is_prerelease]
    return f"{fix.package} {', '.join(released)}" + (f"; nightly {', '.join(nightly)}" if nightly else "")


@pytest.mark.parametrize("name", sorted(_compat.FIXES))
def test_compat_page_states_each_range_and_the_versions_checked(name):
    page = (ROOT / "docs" / "compat.md").read_text()
    fix = _compat.FIXES[name]
    row = f"| [`{name}`](#{name}) | {fix.package} `{fix.verified}` | {_checked_on_text(fix)} |"
    assert row in page, f"docs/compat.md: update {name}'s row in the table to\n{row}"
    section = page.split(f"## `{name}`", 1)[1].split("\n## ", 1)[0]
    for line in (f"- Active on: {fix.package} `{fix.verified}`", f"- Checked on: {_checked_on_text(fix)}"):
        assert line in section, f"docs/compat.md: {name}'s section lacks the line {line!r}"
    if fix.notes:
        assert f"- Notes: {fix.notes}" in section, f"docs/compat.md: {name}'s section lacks its notes"


def test_import_warns_once_on_an_unverified_keras():
    """End to end: `import keras_dist` under a Keras that reports an unverified version warns once, Keras fixes off.

    The reported version stays on the installed Keras' side of `_compat.locations`' 3.16 gate (which
    looks names up by version): 3.9.2, below the fixes' range, under an installed 3.15 or older; 3.99.0,
    above it, under 3.16 and its nightlies (where a reported 3.9.2 looked for the renamed
    `TensorFlowTrainer` and failed the import).
    """
    reported = "3.99.0" if versions.release_at_least("keras", "3.16") else "3.9.2"
    script = (
        f"import keras; keras.__version__ = '{reported}'\n"
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
    tensorflow_fixes_on = [name for name in _fixes_of("tensorflow") if _compat.FIXES[name].applies_to_installed()]
    assert f"ACTIVE {tensorflow_fixes_on}" in done.stdout
