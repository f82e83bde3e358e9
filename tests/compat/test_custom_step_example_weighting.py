"""A train_step written for one device (its own `ops.mean` loss, `tape.gradient`, `apply_gradients`, as keras.io's VAE and GAN examples) took num_replicas times the one-device step."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import keras_dist
from keras_dist import _compat
from keras_dist.testing import max_weight_difference

pytestmark = pytest.mark.compat


def _own_mean_step(base):
    class OwnMean(base):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = ops.mean(ops.square(self(x, training=True) - y))
            self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_weights), self.trainable_weights))
            return {"loss": loss}

    return OwnMean


def _train(strategy):
    rs = np.random.RandomState(0)
    x, y = rs.rand(8, 3).astype("float32"), rs.rand(8, 1).astype("float32")
    models = []
    for base, kwargs in ((keras.Model, {}), (keras_dist.DistributedModel, {"strategy": strategy})):
        inputs = keras.Input((3,))
        model = _own_mean_step(base)(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(inputs), **kwargs)
        model.compile(optimizer=keras.optimizers.SGD(0.1))
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        models.append(model)
    return max_weight_difference(*models)


def test_without_fix_each_update_is_num_replicas_times_larger(mirrored_1x2_cpu):
    with _compat.disabled("custom_step_example_weighting"):
        assert _train(mirrored_1x2_cpu) > 1e-2


def test_with_fix_the_update_is_one_devices(mirrored_1x2_cpu):
    assert _train(mirrored_1x2_cpu) == pytest.approx(0, abs=1e-6)
