"""A model without `call()` (keras.io's GAN) trains under a strategy, as it does on one device."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _support import sum_regression

import keras_dist
from keras_dist import _compat

pytestmark = pytest.mark.compat


def _no_call_model(strategy):
    class TwoParts(keras_dist.DistributedModel):
        def __init__(self, **kwargs):
            super().__init__(strategy=strategy, **kwargs)
            self.first = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
            self.second = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = keras.losses.MeanSquaredError()(y, self.second(self.first(x)))
            self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
            return {"loss": loss}

    model = TwoParts()
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model


def test_without_fix_fit_cannot_build_the_model(mirrored_1x2_cpu_collective):
    with _compat.disabled("build_without_call", "build_for_own_step"):  # The latter alone would also build it.
        model = _no_call_model(mirrored_1x2_cpu_collective)
        with pytest.raises(RuntimeError, match="Unable to automatically build the model"):
            model.fit(*sum_regression(8, 3), batch_size=4, verbose=0)


def test_with_fix_matches_one_device(mirrored_1x2_cpu_collective):
    model = _no_call_model(mirrored_1x2_cpu_collective)
    weights = model.get_weights()
    model.fit(*sum_regression(8, 3), batch_size=4, epochs=2, shuffle=False, verbose=0)
    x, y = sum_regression(8, 3)
    for _ in range(2):  # One device: SGD on the mean squared error of each batch of 4.
        for start in (0, 4):
            xb, yb = x[start : start + 4], y[start : start + 4]
            w1, b1, w2, b2 = weights
            hidden = xb @ w1 + b1
            error = 2 * (hidden @ w2 + b2 - yb) / len(xb)
            grads = [xb.T @ (error @ w2.T), (error @ w2.T).sum(0), hidden.T @ error, error.sum(0)]
            weights = [w - 0.1 * g for w, g in zip(weights, grads)]
    for got, expected in zip(model.get_weights(), weights, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert model.optimizer.iterations.numpy() == 4
