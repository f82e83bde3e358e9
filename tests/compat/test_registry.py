"""Every fix is documented, gated, and still needed for the versions pyproject.toml claims."""

import pathlib
import re

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from keras_dist import _compat

pytestmark = pytest.mark.compat


ROOT = pathlib.Path(__file__).resolve().parents[2]


def _minimum_supported(package):
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(rf'"{package}>=([0-9.]+)', text)
    assert match, f"pyproject.toml states no minimum for {package}"
    return Version(match.group(1))


@pytest.mark.parametrize("name", sorted(_compat.FIXES))
def test_fix_is_documented_and_has_its_test(name):
    fix = _compat.FIXES[name]
    assert fix.upstream.startswith("https://")
    assert fix.symptom and fix.remedy and fix.remove_when
    SpecifierSet(fix.affected)  # parses
    assert (ROOT / "tests" / "compat" / f"test_{name}.py").exists()


@pytest.mark.parametrize("name", sorted(_compat.FIXES))
def test_fix_still_applies_to_minimum_supported_version(name):
    """Fails once the minimum supported version is outside `affected`: delete the fix then."""
    fix = _compat.FIXES[name]
    assert _minimum_supported(fix.package) in SpecifierSet(fix.affected), (
        f"{name} no longer applies to the minimum supported {fix.package}; remove it ({fix.remove_when})."
    )


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
