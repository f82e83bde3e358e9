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
    with _compat.disabled("clip_after_all_reduce"):
        model = _train(keras_dist.DistributedModel, clipping, strategy=mirrored_1x2_cpu)
    assert max_weight_difference(reference, model) > 1e-3


@pytest.mark.parametrize("clipping", CLIPPING, ids=lambda c: next(iter(c)))
def test_with_fix_clipping_matches_single_device(multi_replica_strategy, clipping):
    reference = _train(keras.Model, clipping)
    model = _train(keras_dist.DistributedModel, clipping, strategy=multi_replica_strategy)
    assert max_weight_difference(reference, model) < 1e-5
