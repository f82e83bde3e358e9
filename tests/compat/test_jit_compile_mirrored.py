"""shared/cases/06: jit_compile=True under MirroredStrategy crashes in Keras; we refuse it at compile."""

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist import _compat


pytestmark = pytest.mark.compat


def _model(strategy):
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    return keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(hidden), strategy=strategy)


def test_without_fix_the_first_step_crashes(mirrored_1x2_cpu):
    x = np.random.RandomState(0).rand(32, 8).astype("float32")
    with _compat.disabled("jit_compile_mirrored"):
        model = _model(mirrored_1x2_cpu)
        model.compile(optimizer="adam", loss="mse", jit_compile=True)
        with pytest.raises(Exception):
            model.fit(x, x.sum(1, keepdims=True), batch_size=16, verbose=0)


def test_with_fix_refused_at_compile(mirrored_1x2_cpu):
    model = _model(mirrored_1x2_cpu)
    with pytest.raises(ValueError, match="keras-team/keras#19005.*Fix: pass `jit_compile=False`"):
        model.compile(optimizer="adam", loss="mse", jit_compile=True)
