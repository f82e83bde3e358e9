"""BatchNormalization must stay finite when a partial batch leaves a replica without examples."""

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist import _compat

pytestmark = pytest.mark.compat


def _fit(strategy, layers):
    inputs = keras.Input((3,))
    hidden = inputs
    for layer in layers:
        hidden = layer(hidden)
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(hidden), strategy=strategy)
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.RandomState(0).rand(9, 3).astype("float32")  # batch 4: last batch of 1 -> one replica empty
    model.fit(x, x[:, :1], batch_size=4, epochs=2, shuffle=False, verbose=0)
    return model


def test_without_fix_weights_become_nan(mirrored_1x2_cpu):
    with _compat.disabled("empty_replica_batch_norm"):
        model = _fit(mirrored_1x2_cpu, [keras.layers.BatchNormalization()])
    assert not all(np.all(np.isfinite(w)) for w in model.get_weights())


@pytest.mark.parametrize("nested", [False, True], ids=["layer", "inside_a_sequential"])
def test_with_fix_weights_stay_finite(mirrored_1x2_cpu, nested):
    layers = [keras.layers.BatchNormalization()]
    if nested:
        layers = [keras.Sequential([keras.layers.Dense(3), keras.layers.BatchNormalization()])]
    model = _fit(mirrored_1x2_cpu, layers)
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    assert np.isfinite(model.predict(np.ones((2, 3), "float32"), verbose=0)).all()


def test_with_fix_full_batches_match_without_guard(mirrored_1x2_cpu):
    """On batches that give every replica examples the guard changes nothing."""
    x = np.random.RandomState(1).rand(16, 3).astype("float32")
    weights = []
    for disabled in ([], ["empty_replica_batch_norm"]):
        keras.utils.set_random_seed(3)
        with _compat.disabled(*disabled):
            inputs = keras.Input((3,))
            bn = keras.layers.BatchNormalization()
            model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(bn(inputs)), strategy=mirrored_1x2_cpu)
            model.compile(optimizer="sgd", loss="mse")
            model.fit(x, x[:, :1], batch_size=8, epochs=2, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    for a, b in zip(*weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
