"""Each replica reads its own `add_loss` values: Keras keeps one list per layer, which the replicas' threads share."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_dist import _compat
from keras_dist.testing import assert_matches_single_device, max_weight_difference

pytestmark = pytest.mark.compat

RS = np.random.RandomState(6)
X = RS.randn(37, 4).astype("float32")
Y = (X @ RS.randn(4, 1)).astype("float32")


def _regularized_before_a_collective(model_class, **kwargs):
    """An activity regularizer, then synchronized BatchNormalization: each replica waits in its all-reduce."""
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(6, activity_regularizer=keras.regularizers.L2(0.1))(inputs)
    hidden = keras.layers.BatchNormalization(synchronized=True)(hidden)
    model = model_class(inputs, keras.layers.Dense(1)(hidden), **kwargs)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def _train(model):
    history = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return {"history": history.history, "evaluate": model.evaluate(X, Y, batch_size=8, verbose=0)}


def test_without_fix_a_replica_reads_another_replicas_losses(mirrored_1x2_cpu):
    with _compat.disabled("replica_layer_losses"):
        with pytest.raises(AssertionError):
            assert_matches_single_device(
                _regularized_before_a_collective, strategy=mirrored_1x2_cpu, train=_train, atol=1e-5, rtol=0.0
            )


def test_with_fix_each_replica_reads_its_own(mirrored_1x2_cpu):
    assert_matches_single_device(
        _regularized_before_a_collective, strategy=mirrored_1x2_cpu, train=_train, atol=1e-5, rtol=0.0
    )


class _Commitment(keras.layers.Layer):
    """keras.io's VQ-VAE way: a layer adding a loss of its own in `call`."""

    def call(self, x):
        self.add_loss(0.25 * tf.reduce_mean(x**2))
        return x


class _LossesTracker:
    """A step of one's own logging `sum(self.losses)` after the optimizer's update (keras.io's VQ-VAE)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tracker = keras.metrics.Mean(name="added")

    @property
    def metrics(self):
        return [self.tracker]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((self(x, training=True) - y) ** 2) + sum(self.losses)
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
        self.tracker.update_state(sum(self.losses))
        return {"added": self.tracker.result()}


def test_with_fix_a_step_of_ones_own_reads_its_own_after_apply(mirrored_1x2_cpu):
    def build(model_class, **kwargs):
        inputs = keras.Input((4,))
        hidden = _Commitment()(keras.layers.Dense(3)(inputs))
        model = type("M", (_LossesTracker, model_class), {})(inputs, keras.layers.Dense(1)(hidden), **kwargs)
        model.compile(optimizer=keras.optimizers.SGD(0.05))
        return model

    def train(model):
        return model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0).history

    comparison = assert_matches_single_device(build, strategy=mirrored_1x2_cpu, train=train, atol=1e-5, rtol=0.0)
    assert max_weight_difference(comparison.reference, comparison.model) < 1e-5
