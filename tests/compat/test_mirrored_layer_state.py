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


class RunningMean(keras.layers.Layer):
    """A layer that keeps a running mean of its inputs, updated in `call` while training, and centres with it."""

    def build(self, input_shape):
        self.mean = self.add_weight(shape=(input_shape[-1],), initializer="zeros", trainable=False, name="mean")

    def call(self, x, training=False):
        centred = x - self.mean  # Read before the update (XLA refuses a read after it).
        if training:
            self.mean.assign(0.5 * self.mean + 0.5 * keras.ops.mean(x, axis=0))
        return centred


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_with_fix_layer_state_counts_each_replica_by_its_examples(mirrored_1x2_cpu, jit_compile):
    """A new-user probe: a running mean ended 8.5e-2 off one device where the last batch split 3/2.

    The replicas' new values were averaged, each counting once; one device's is their average
    weighted by examples (exact for an update linear in a batch mean, on any split).
    """
    from keras_dist.testing import assert_matches_single_device

    rs = np.random.RandomState(5)
    x = (rs.randn(21, 4) * [1, 2, 3, 4] + [1, 2, 3, 0]).astype("float32")
    y = rs.randn(21, 1).astype("float32")

    def build(cls, **kwargs):
        inputs = keras.Input((4,))
        model = cls(inputs, keras.layers.Dense(1)(RunningMean()(inputs)), **kwargs)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=jit_compile)
        return model

    def train(model):
        return model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)  # The last batch: 5, split 3/2.

    assert_matches_single_device(
        build, strategy=mirrored_1x2_cpu, train=train, atol=1e-5, rtol=0.0, logs_atol=1e-6, logs_rtol=1e-5
    )
