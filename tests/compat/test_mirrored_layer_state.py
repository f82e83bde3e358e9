"""BatchNormalization moving statistics must be identical on every replica (plain Keras: each replica writes its own copy, so `predict` on identical rows depended on the replica)."""

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist import _compat

pytestmark = pytest.mark.compat


def _replica_copies(strategy):
    rs = np.random.RandomState(0)
    x = np.concatenate([rs.randn(4, 3), rs.randn(4, 3) + 10]).astype("float32")
    inputs = keras.Input((3,))
    bn = keras.layers.BatchNormalization(momentum=0.0)
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(bn(inputs)), strategy=strategy)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, rs.randn(8, 1).astype("float32"), batch_size=8, verbose=0, shuffle=False)
    return [v.numpy() for v in strategy.experimental_local_results(bn.moving_mean.value)]


def test_without_fix_copies_diverge(mirrored_1x2_cpu):
    with _compat.disabled("mirrored_layer_state"):
        first, second = _replica_copies(mirrored_1x2_cpu)
    assert np.abs(first - second).max() > 1


def test_with_fix_copies_identical(mirrored_1x2_cpu):
    first, second = _replica_copies(mirrored_1x2_cpu)
    np.testing.assert_array_equal(first, second)
