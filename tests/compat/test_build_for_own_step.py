"""A `train_step` of one's own that makes the model's inputs itself trains under a strategy as on one device.

keras.io's MixUp, or features of a dict combined, then `super().train_step((inputs, y))`: the batches
are not what the model takes. Under a strategy Keras pre-builds the model by calling it on the
batch's inputs (`_symbolic_build`) and fails before the first step ('Missing data for input'); on
one device Keras builds in the first step. With the fix the model builds as on one device, and the
compiled loss and metrics build in the first step, once for every replica.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from keras_dist import _compat

pytestmark = pytest.mark.compat


def _combining_model(base, kwargs):
    class Combining(base):
        """The model takes one tensor; the batches hold a dict of two, which the step adds."""

        def train_step(self, data):
            x, y = data
            return super().train_step((x["a"] + x["b"], y))

    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, activation="relu", kernel_initializer="glorot_uniform")(inputs)
    model = Combining(inputs, keras.layers.Dense(1)(hidden), **kwargs)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse", metrics=["mae"])
    return model


def _data():
    rs = np.random.RandomState(7)
    x = {"a": rs.rand(40, 4).astype("float32"), "b": rs.rand(40, 4).astype("float32")}
    y = (x["a"] - x["b"]).sum(axis=1, keepdims=True)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16)  # 16, 16, 8: the last split 4 + 4.


def test_without_fix_fit_fails_in_keras_pre_build(mirrored_1x2_cpu):
    if not _compat.FIXES["build_for_own_step"].applies_to_installed():
        pytest.skip("The installed Keras is outside the fix's verified range: the bug is reproduced only there.")
    with _compat.disabled("build_for_own_step"):
        model = _combining_model(keras_dist.DistributedModel, {"strategy": mirrored_1x2_cpu})
        with pytest.raises((ValueError, RuntimeError), match="Missing data for input"):  # Keras 3.10 wraps it.
            model.fit(_data(), verbose=0)


def test_with_fix_matches_one_device(mirrored_1x2_cpu):
    keras.utils.set_random_seed(3)
    reference = _combining_model(keras.Model, {})
    model = _combining_model(keras_dist.DistributedModel, {"strategy": mirrored_1x2_cpu})
    model.set_weights(reference.get_weights())
    expected = reference.fit(_data(), epochs=2, verbose=0).history
    got = model.fit(_data(), epochs=2, verbose=0).history
    assert set(got) == set(expected) == {"loss", "mae"}, got
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_step_that_calls_the_model_wrongly_still_fails(mirrored_1x2_cpu):
    """The fix only moves the build into the first step: a step that calls the model on data it cannot take fails there."""

    class Wrong(keras_dist.DistributedModel):
        def train_step(self, data):
            x, y = data
            return super().train_step((x["a"], y))  # Two features where the model takes four.

    inputs = keras.Input((2,))
    model = Wrong(inputs, keras.layers.Dense(1)(inputs), strategy=mirrored_1x2_cpu)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)):
        model.fit(_data(), verbose=0)
