"""use_ema=True with ema_overwrite_frequency under a strategy trains like one device (shared r10)."""

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist import _compat
from keras_dist.testing import max_weight_difference

pytestmark = pytest.mark.compat


def _train(model_class, num_examples=37, **kwargs):
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(seed=1))(
        inputs
    )
    model = model_class(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(hidden), **kwargs)
    model.compile(optimizer=keras.optimizers.Adam(0.05, use_ema=True, ema_overwrite_frequency=2), loss="mse")
    x = np.random.RandomState(0).rand(num_examples, 3).astype("float32")
    model.fit(x, x.sum(1, keepdims=True), batch_size=8, epochs=2, shuffle=False, verbose=0)
    return model


def test_fix_is_gated_on_the_verified_keras_versions():
    fix = _compat.FIXES["ema_overwrite_under_strategy"]
    assert fix.package == "keras"
    assert _compat.is_active("ema_overwrite_under_strategy") == (
        fix.applies_to_installed() or _compat.is_forced("ema_overwrite_under_strategy")
    )


def test_without_fix_the_first_step_fails(mirrored_1x2_cpu):
    if not _compat.FIXES["ema_overwrite_under_strategy"].applies_to_installed():
        # Forced (KERAS_DIST_FORCE_FIXES, as CI's nightly stack runs) or off: keras-nightly 3.16 has no bug to reproduce.
        pytest.skip("The installed Keras is outside the fix's verified range: the bug is reproduced only there.")
    with _compat.disabled("ema_overwrite_under_strategy"):
        with pytest.raises(RuntimeError, match="merge_call"):
            _train(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu)


def test_with_fix_weights_averages_and_iterations_match_single_device(multi_replica_strategy):
    reference = _train(keras.Model)
    model = _train(keras_dist.DistributedModel, strategy=multi_replica_strategy)
    assert max_weight_difference(reference, model) < 1e-5
    averages = [np.asarray(v) for v in model.optimizer._model_variables_moving_average]
    expected = [np.asarray(v) for v in reference.optimizer._model_variables_moving_average]
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(averages, expected)) < 1e-5
    assert int(np.asarray(model.optimizer.iterations)) == int(np.asarray(reference.optimizer.iterations))
