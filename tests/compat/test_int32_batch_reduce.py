"""A compiled metric whose state is int32 (a counter, as public code writes them) fails `fit` on several replicas.

TensorFlow's `MirroredExtended._get_cross_device_ops` returns a new `ReductionToOneDevice`
for every int32 value, and `batch_reduce_to` refuses values whose cross-device ops differ:
keras-dist's one packed sum of the metrics' state per dtype (`_model/metrics.result_from_summed_state`)
failed with "Inputs to batch_reduce_to must be either all on the host or all on the compute
devices" as soon as a metric had two int32 variables (a new-user probe, stop 51).
"""

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist import _compat
from keras_dist.testing import assert_matches_single_device

pytestmark = pytest.mark.compat


class _PositiveRate(keras.metrics.Metric):
    """The rate of positive predictions, counted in two int32 variables."""

    def __init__(self, name="positive_rate", **kwargs):
        super().__init__(name=name, **kwargs)
        self.positives = self.add_variable(shape=(), name="positives", initializer="zeros", dtype="int32")
        self.seen = self.add_variable(shape=(), name="seen", initializer="zeros", dtype="int32")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.positives.assign_add(keras.ops.sum(keras.ops.cast(y_pred > 0, "int32")))
        self.seen.assign_add(keras.ops.cast(keras.ops.shape(y_pred)[0], "int32"))

    def result(self):
        return keras.ops.cast(self.positives, "float32") / keras.ops.cast(self.seen, "float32")


def _data():
    rs = np.random.RandomState(0)
    return rs.normal(size=(37, 5)).astype("float32"), rs.normal(size=(37, 1)).astype("float32")


def _build(cls, **kwargs):
    inputs = keras.Input((5,))
    model = cls(inputs, keras.layers.Dense(1)(inputs), **kwargs)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=[_PositiveRate()])
    return model


def _train(model):
    x, y = _data()
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0).history
    return {"history": history, "evaluate": model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)}


def test_without_fix_fit_fails_in_batch_reduce_to(mirrored_1x2_cpu):
    if not _compat.FIXES["int32_batch_reduce"].applies_to_installed():
        pytest.skip("The installed TensorFlow is outside the fix's verified range: the bug is reproduced only there.")
    with _compat.disabled("int32_batch_reduce"):
        model = _build(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu)
        with pytest.raises(ValueError, match="Inputs to batch_reduce_to must be either all on the host"):
            _train(model)


def test_with_fix_an_int32_metric_matches_one_device(mirrored_1x3_cpu):
    """3 replicas: 37 examples in batches of 8 split unevenly, and the last batch of 5 leaves none empty."""
    assert_matches_single_device(_build, strategy=mirrored_1x3_cpu, train=_train, atol=1e-5)
