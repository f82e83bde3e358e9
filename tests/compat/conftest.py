"""Compat tests: each fix's bug reproduced with the fix disabled, then fixed."""

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/compat/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.compat)
