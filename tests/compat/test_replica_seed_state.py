"""Dropout must draw different masks on different replicas (as on different examples of one batch)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from keras_dist import _compat

pytestmark = pytest.mark.compat


class DropoutProbe(keras_dist.DistributedModel):
    """predict returns a training-mode Dropout of all-ones rows: the masks themselves."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dropout = keras.layers.Dropout(0.5, seed=7)

    def call(self, x, training=None):
        return self.dropout(x, training=training)

    def predict_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        return self(x, training=True)


def _masks_per_replica(strategy):
    model = DropoutProbe(strategy=strategy)
    model(np.ones((1, 64), "float32"))
    masks = model.predict(np.ones((2, 64), "float32"), batch_size=2, verbose=0)  # one row per replica
    return masks[0] != 0, masks[1] != 0


def test_without_fix_replicas_share_masks(mirrored_1x2_cpu):
    with _compat.disabled("replica_seed_state"):
        first, second = _masks_per_replica(mirrored_1x2_cpu)
    np.testing.assert_array_equal(first, second)


def test_with_fix_masks_differ_and_replica_zero_keeps_the_seed(mirrored_1x2_cpu):
    first, second = _masks_per_replica(mirrored_1x2_cpu)
    assert (first != second).sum() > 10
    model = DropoutProbe(strategy=mirrored_1x2_cpu)
    model.predict(np.ones((2, 4), "float32"), batch_size=2, verbose=0)
    state = model.dropout.seed_generator.state.value
    assert isinstance(state, tf.distribute.DistributedValues)
    seeds = [int(c.numpy()[0]) for c in mirrored_1x2_cpu.experimental_local_results(state)]
    assert seeds == [7, 8]
