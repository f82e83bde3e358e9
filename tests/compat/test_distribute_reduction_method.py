"""Setting distribute_reduction_method must change how step outputs combine (plain Keras 3 ignored it; a `train_step` returning the replica id logs 1.0 with "sum", 0.5 with "mean", 0.0 with "first")."""

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


class ReplicaIdEvaluation(ReplicaId):
    def test_step(self, data):
        return {"rid": tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, "float32")}


@pytest.mark.parametrize("method, expected", [("sum", 1.0), ("mean", 0.5), ("first", 0.0)])
def test_evaluate_and_predict_with_each_method(mirrored_1x2_cpu, method, expected):
    """With `distribute_reduction_method="sum"` or `"mean"`, `evaluate` raised `ValueError: destinations can not be empty`.

    `float`: Keras before 3.14 returns a custom `test_step`'s logs from `evaluate` as they are (a
    tensor, on one device too); 3.14 converts them to Python numbers (`pythonify_logs`).
    """
    model = ReplicaIdEvaluation(strategy=mirrored_1x2_cpu)
    model.compile(optimizer="sgd", loss="mse")
    model.distribute_reduction_method = method
    x = np.ones((16, 4), "float32")
    logs = model.evaluate(x, x[:, :1], batch_size=8, verbose=0, return_dict=True)
    assert float(logs["rid"]) == pytest.approx(expected)
    assert model.predict(x, batch_size=8, verbose=0).shape == (16, 1)


@pytest.mark.parametrize("method", ["sum", "mean", "first"])
def test_keras_dist_steps_keep_their_global_values(mirrored_1x2_cpu, method):
    """The built-in steps' outputs are the global batch's already: no method multiplies them by the replicas."""
    inputs = keras.Input((3,))
    model = keras_dist.DistributedModel(
        inputs, keras.layers.Dense(1, kernel_initializer="ones")(inputs), strategy=mirrored_1x2_cpu
    )
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", metrics=["mae"])
    model.distribute_reduction_method = method
    x, y = np.ones((8, 3), "float32"), np.zeros((8, 1), "float32")
    assert model.fit(x, y, batch_size=8, verbose=0).history["loss"] == [pytest.approx(9.0)]
    assert model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True) == {
        "loss": pytest.approx(9.0),
        "mae": pytest.approx(3.0),
    }
