"""An optimizer constructed outside any scope must train under the model's strategy (plain Keras: "Mixing different tf.distribute.Strategy objects", keras-team/keras#17187)."""

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist import _compat

pytestmark = pytest.mark.compat


def _fit_with_outside_optimizer(strategy):
    optimizer = keras.optimizers.Adam()  # outside any scope
    inputs = keras.Input((4,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy=strategy)
    model.compile(optimizer=optimizer, loss="mse")
    x = np.random.RandomState(0).rand(16, 4).astype("float32")
    model.fit(x, x[:, :1], batch_size=8, verbose=0)
    return model


def test_without_fix_strategies_mix(mirrored_1x2_cpu):
    with _compat.disabled("optimizer_strategy"):
        with pytest.raises(Exception, match="Mixing different tf.distribute.Strategy objects|scope"):
            _fit_with_outside_optimizer(mirrored_1x2_cpu)


def test_with_fix_optimizer_follows_the_model(mirrored_1x2_cpu):
    model = _fit_with_outside_optimizer(mirrored_1x2_cpu)
    assert {type(v.value).__name__ for v in model.optimizer.variables} == {"MirroredVariable"}
