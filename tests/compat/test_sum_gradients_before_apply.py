"""Gradient clipping must act on the gradient summed over replicas, as on one device."""

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist import _compat
from keras_dist.testing import max_weight_difference

pytestmark = pytest.mark.compat

CLIPPING = [{"clipnorm": 0.05}, {"global_clipnorm": 0.05}, {"clipvalue": 0.01}]


def _train(model_class, clipping, **kwargs):
    inputs = keras.Input((3,))
    model = model_class(inputs, keras.layers.Dense(1, kernel_initializer="ones")(inputs), **kwargs)
    model.compile(optimizer=keras.optimizers.SGD(0.1, **clipping), loss="mse")
    rs = np.random.RandomState(0)
    x = rs.rand(16, 3).astype("float32")
    model.fit(x, 5 * x.sum(1, keepdims=True) + 3, batch_size=8, epochs=3, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("clipping", CLIPPING, ids=lambda c: next(iter(c)))
def test_without_fix_replicas_clip_their_own_share(mirrored_1x2_cpu, clipping):
    reference = _train(keras.Model, clipping)
    with _compat.disabled("sum_gradients_before_apply"):
        model = _train(keras_dist.DistributedModel, clipping, strategy=mirrored_1x2_cpu)
    assert max_weight_difference(reference, model) > 1e-3


@pytest.mark.parametrize("clipping", CLIPPING, ids=lambda c: next(iter(c)))
def test_with_fix_clipping_matches_single_device(multi_replica_strategy, clipping):
    reference = _train(keras.Model, clipping)
    model = _train(keras_dist.DistributedModel, clipping, strategy=multi_replica_strategy)
    assert max_weight_difference(reference, model) < 1e-5


def _mixed_precision_model(model_class, **kwargs):
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, kernel_initializer="ones", dtype="mixed_float16")(inputs)
    model = model_class(inputs, keras.layers.Dense(1, kernel_initializer="ones")(hidden), **kwargs)
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**6), loss="mse"
    )
    return model


def _overflow_on_second_replica(model):
    """Replica 1's half of the batch overflows float16 gradients at loss scale 64; replica 0's does not."""
    x = np.ones((8, 3), "float32")
    x[4:] = 300.0
    model.fit(x, np.zeros((8, 1), "float32"), batch_size=8, epochs=1, shuffle=False, verbose=0)
    return [bool(np.isfinite(w.numpy()).all()) for w in model.trainable_weights], float(
        np.asarray(model.optimizer.dynamic_scale)
    )


def test_without_fix_an_overflow_on_one_replica_reaches_the_weights(mirrored_1x2_cpu):
    with _compat.disabled("sum_gradients_before_apply"):
        finite, scale = _overflow_on_second_replica(
            _mixed_precision_model(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu)
        )
    assert not all(finite) and scale == 64.0


def test_with_fix_an_overflow_on_one_replica_skips_the_step_everywhere(mirrored_1x2_cpu):
    one_device = _overflow_on_second_replica(_mixed_precision_model(keras.Model))
    distributed = _overflow_on_second_replica(
        _mixed_precision_model(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu)
    )
    assert distributed == one_device == ([True] * 4, 32.0)
