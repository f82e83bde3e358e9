"""float() and int() of a Keras variable on a strategy: the optimizer's learning rate and step count, metric state.

A callback logging `float(self.model.optimizer.learning_rate)` is a common way to write one (a
new-user probe's); under a strategy Keras converted the backing `MirroredVariable` and raised.
"""

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist import _compat

pytestmark = pytest.mark.compat


class LogOptimizerState(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        logs["lr"] = float(self.model.optimizer.learning_rate)
        logs["steps"] = int(self.model.optimizer.iterations)
        logs["mae_count"] = float(self.model.metrics[1].variables[1])


def _fit(cls, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    model = cls(inputs, keras.layers.Dense(1)(inputs), **kwargs)
    model.compile(
        optimizer=keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5)),
        loss="mse",
        metrics=["mae"],
    )
    rs = np.random.RandomState(0)
    x, y = rs.rand(10, 3).astype("float32"), rs.rand(10, 1).astype("float32")
    return model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[LogOptimizerState()]).history


def test_without_fix_float_of_the_learning_rate_raises(mirrored_1x2_cpu):
    with _compat.disabled("variable_scalar_conversion"), pytest.raises(TypeError, match="MirroredVariable"):
        _fit(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu)


def test_with_fix_the_logged_values_match_one_device(mirrored_1x2_cpu):
    expected = _fit(keras.Model)
    history = _fit(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu)
    assert history["steps"] == expected["steps"] == [3, 6]
    assert history["mae_count"] == expected["mae_count"] == [10.0, 10.0]
    np.testing.assert_allclose(history["lr"], expected["lr"], rtol=1e-6)
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-5)


def test_with_fix_a_vector_variable_still_raises_keras_error(mirrored_1x2_cpu):
    inputs = keras.Input((2,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(2)(inputs), strategy=mirrored_1x2_cpu)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((4, 2)), np.ones((4, 2)), verbose=0)
    with pytest.raises(TypeError, match="Only scalar arrays"):
        float(model.layers[-1].bias)
