"""Installed Keras and TensorFlow versions, parsed once with `packaging.version`, and how to compare them.

The versions come from the modules (`keras.__version__`, `tf.__version__`), not from distribution
names, so `keras-nightly`, `tf-nightly`, `tensorflow-cpu` and `tensorflow-tpu` count as Keras and
TensorFlow. A nightly build is a pre-release (`3.16.0.dev2026...`): the comparisons below count it as
the release it leads to, in a range that reaches that release, and below it otherwise.
"""

import keras
import tensorflow as tf
from packaging.specifiers import SpecifierSet
from packaging.version import Version

KERAS_VERSION = Version(keras.__version__)
TF_VERSION = Version(tf.__version__)

INSTALLED = {"keras": KERAS_VERSION, "tensorflow": TF_VERSION}


def in_range(package, specifiers):
    """Returns whether the installed `package` ("keras" or "tensorflow") is in `specifiers` (a `SpecifierSet` string).

    Pre-releases count (`SpecifierSet` leaves them out by default): keras-nightly 3.16.0.dev is in
    `">=3.10,<3.17"` and not in `">=3.10,<3.16"` (PEP 440: `<3.16` excludes 3.16's pre-releases).
    """
    return SpecifierSet(specifiers).contains(INSTALLED[package], prereleases=True)


def release_at_least(package, minimum):
    """Returns whether the installed `package` is release `minimum` (e.g. "3.16") or later, its nightly builds included.

    Compares the release numbers only: 3.16.0.dev2026 is at least "3.16" (it already has what 3.16 changes).
    """
    return INSTALLED[package].release >= Version(minimum).release
