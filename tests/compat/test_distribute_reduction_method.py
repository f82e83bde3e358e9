"""shared/cases/28: setting distribute_reduction_method must change how step outputs combine."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from keras_dist import _compat


pytestmark = pytest.mark.compat


class ReplicaId(keras_dist.DistributedModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        return {"rid": tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, "float32")}


def _fit_with_sum(strategy):
    model = ReplicaId(strategy=strategy)
    model.compile(optimizer="sgd", loss="mse")
    model.distribute_reduction_method = "sum"
    x = np.ones((16, 4), "float32")
    return model.fit(x, x[:, :1], batch_size=8, verbose=0).history["rid"][-1]


def test_without_fix_setting_is_ignored(mirrored_1x2_cpu):
    with _compat.disabled("distribute_reduction_method"):
        assert _fit_with_sum(mirrored_1x2_cpu) == pytest.approx(0.5)


def test_with_fix_sum_is_applied(mirrored_1x2_cpu):
    assert _fit_with_sum(mirrored_1x2_cpu) == pytest.approx(1.0)
