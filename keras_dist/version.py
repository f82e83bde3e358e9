"""The keras-dist version string (PEP 440), and the Python, Keras and TensorFlow versions it supports.

`SUPPORTED` is the one statement of the supported range. `pyproject.toml` (`declared_requirements()`:
`requires-python`, the `keras` and `[tensorflow]` minimums), the "Supported and tested" paragraph of
`docs/compat.md` (`supported_statement()`, word for word) and `keras-dist env` state it;
tests/unit/test_supported_range.py fails when one of them says something else. Imports only the
standard library at module level (the launcher imports it).
"""

import sys

__version__ = "0.1.0.dev0"

# Oldest and newest minor release supported, both included: the range CI tests (see TESTED_STACKS).
# No upper bound goes into pyproject.toml: the next release installs, `keras-dist env` says it is untested,
# and the compatibility fixes are off there (docs/compat.md).
SUPPORTED = {
    "python": ("3.10", "3.13"),
    "keras": ("3.10", "3.15"),
    "tensorflow": ("2.18", "2.21"),
}

# The stacks CI builds and tests (ci/stacks/): the two ends of the range and Colab's runtime.
TESTED_STACKS = {
    "oldest": {"python": "3.10", "keras": "3.10.0", "tensorflow": "2.18.1"},
    "Colab": {"python": "3.13", "keras": "3.13.2", "tensorflow": "2.20.0", "tensorflow-datasets": "4.9.10"},
    "newest": {"python": "3.11", "keras": "3.15.1", "tensorflow": "2.21.0"},
}

# Run by CI without deciding it: a break found there becomes a compatibility fix.
WATCHED = ("keras-nightly", "tf-nightly")

_NAMES = {"python": "Python", "keras": "Keras", "tensorflow": "TensorFlow", "tensorflow-datasets": "TFDS"}


def in_supported_range(package: str, version: str) -> bool:
    """Returns whether `version` of `package` is a release inside `SUPPORTED[package]`.

    Pre-releases and nightly builds (`3.16.0.dev2026...`, `2.21.0rc1`) are outside: they were not tested.

    Args:
        package: One of `"python"`, `"keras"`, `"tensorflow"`.
        version: String, the installed version (`"3.13.2"`).

    Example:
    >>> in_supported_range("keras", "3.13.2"), in_supported_range("keras", "3.16.0.dev2026080103")
    (True, False)
    """
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    oldest, newest = (Version(bound).release for bound in SUPPORTED[package])
    return not parsed.is_prerelease and oldest <= parsed.release[:2] <= newest


def supported_range(package: str) -> str:
    """Returns `SUPPORTED[package]` as text: `"3.10-3.15"`."""
    oldest, newest = SUPPORTED[package]
    return f"{oldest}-{newest}"


def supported_summary() -> str:
    """Returns the supported range in one line: `"Python 3.10-3.13, Keras 3.10-3.15, TensorFlow 2.18-2.21"`."""
    return ", ".join(f"{_NAMES[package]} {supported_range(package)}" for package in SUPPORTED)


def describe_tested_stacks() -> str:
    """Returns `TESTED_STACKS` in one line: `"oldest: Python 3.10, Keras 3.10.0, TensorFlow 2.18.1; ..."`."""
    return "; ".join(
        f"{label}: " + ", ".join(f"{_NAMES[name]} {version}" for name, version in stack.items())
        for label, stack in TESTED_STACKS.items()
    )


def supported_statement() -> str:
    """Returns the paragraph that states the supported and tested range (docs/compat.md has it verbatim).

    Example:
    >>> supported_statement().startswith("Supported and tested: Python 3.10-3.13, Keras 3.10-3.15,")
    True
    """
    return (
        f"Supported and tested: {supported_summary()}, whichever distribution installed them "
        "(tensorflow, tensorflow-cpu, tensorflow-tpu). "
        f"CI tests three stacks ({describe_tested_stacks()}) and, with `KERAS_DIST_CI_NIGHTLY=1`, "
        f"{' and '.join(WATCHED)} without failing on them."
    )


def declared_requirements() -> dict[str, str]:
    """Returns what pyproject.toml must declare for `SUPPORTED`: `requires-python` and the minimums, no maximum.

    Example:
    >>> declared_requirements()
    {'requires-python': '>=3.10,<3.14', 'keras': 'keras>=3.10', 'tensorflow': 'tensorflow>=2.18'}
    """
    oldest, newest = SUPPORTED["python"]
    major, minor = newest.split(".")
    return {
        "requires-python": f">={oldest},<{major}.{int(minor) + 1}",
        "keras": f"keras>={SUPPORTED['keras'][0]}",
        "tensorflow": f"tensorflow>={SUPPORTED['tensorflow'][0]}",
    }


def missing_tensorflow_message() -> str:
    """Returns what `import keras_dist` (and `keras-dist env`) say where no `tensorflow` module can be imported."""
    return (
        "keras-dist trains through tf.distribute and needs TensorFlow "
        f"(supported: {supported_range('tensorflow')}). Received: no module named 'tensorflow' in "
        f"this Python ({sys.executable}). keras-dist does not install TensorFlow itself, so that pip never "
        "replaces the TensorFlow distribution you have. Fix: "
        '`pip install "keras-dist[tensorflow]"` (installs the `tensorflow` distribution), or install the one '
        "you use: `tensorflow-cpu`, `tensorflow-tpu` (with a `libtpu` that imports: see "
        "docs/getting_started.md#tpu) or `tf-nightly`."
    )
