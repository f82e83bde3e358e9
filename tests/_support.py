"""Builders the test files share (test-only; users' helpers live in `keras_dist.testing`).

Importable from any test file as `from _support import ...` (tests/ is on the path:
tests/conftest.py sits there).
"""

import contextlib
import tempfile

import keras
import numpy as np
from keras import ops

from keras_dist import _zygote


def sum_regression(num_examples, features, seed=0):
    """Returns `(x, y)`: `x` uniform in [0, 1), `y` the sum of each row's features.

    Args:
        num_examples: Integer, the number of rows.
        features: Integer, the number of columns of `x`.
        seed: Integer for `np.random.RandomState`. Defaults to 0.

    Returns:
        `x` float32 of shape `(num_examples, features)`, `y` float32 of shape `(num_examples, 1)`.

    Example:
    >>> x, y = sum_regression(4, 3)
    >>> x.shape, y.shape, x.dtype.name, y.dtype.name
    ((4, 3), (4, 1), 'float32', 'float32')
    """
    x = np.random.RandomState(seed).rand(num_examples, features).astype("float32")
    return x, x.sum(1, keepdims=True)


class SummedActivity(keras.layers.Layer):
    """keras.io's guide's `ActivityRegularizationLayer`: `add_loss(ops.sum(inputs) * 0.1)`, one number summed over the batch."""

    def call(self, inputs):
        self.add_loss(ops.sum(inputs) * 0.1)
        return inputs


@contextlib.contextmanager
def zygote_servers():
    """A new directory for zygote servers (`keras_dist._zygote`): yields its path, then stops its servers.

    The servers also exit if this process dies first (`_zygote.set_owner`).
    """
    directory = tempfile.mkdtemp(prefix="kd-zygote-")
    _zygote.set_owner(directory)
    try:
        yield directory
    finally:
        _zygote.stop_servers(directory)
