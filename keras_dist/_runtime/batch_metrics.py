"""Layer 3: metric functions that return one number per batch see the global batch.

A compiled metric function (`keras.metrics.MeanMetricWrapper`, what
`compile(metrics=[fn])` makes of a function) usually returns one value per
example; their mean over the replicas' parts is the global batch's mean, and
summing the metric state over the replicas is exact. A function that reduces
the batch itself (`ops.max(ops.abs(y_true - y_pred))`: the batch's largest
error; tensorflow/tensorflow#39268) returns one number that depends on the
whole batch: each replica would see only its part (the batch's max error was
0.98321 instead of one device's 0.98911 on 2 replicas).
Inside a keras-dist step, such a function is computed on the global batch
instead, as Accelerate's `gather_for_metrics` does: `y_true`, `y_pred` and the
sample weights are all-gathered over the replicas in global order (one
all-gather each, only for these metrics), and each replica adds `1 /
replicas` of the global value, so that the summed state holds it once.

`MeanMetricWrapper.update_state` is replaced by a dispatcher once (`install`);
outside a keras-dist step on several replicas it is Keras' own.
"""

import threading

import tensorflow as tf
from keras import tree
from keras.src.losses import loss as keras_loss
from keras.src.metrics import reduction_metrics

from keras_dist._runtime import gather as gather_module
from keras_dist._runtime import global_batch, step_state
from keras_dist._runtime import keras_internals as ki

_ORIGINAL_UPDATE_STATE = reduction_metrics.MeanMetricWrapper.update_state
_LOCK = threading.Lock()


def install():
    """Installs the dispatcher on `keras.metrics.MeanMetricWrapper` (idempotent)."""
    with _LOCK:
        if reduction_metrics.MeanMetricWrapper.update_state is not _update_state:
            reduction_metrics.MeanMetricWrapper.update_state = _update_state


def _update_state(self, y_true, y_pred, sample_weight=None):
    context = tf.distribute.get_replica_context()
    if (
        step_state.current() is None
        or context is None
        or context.num_replicas_in_sync == 1
        or type(self).update_state is not _update_state
    ):
        return _ORIGINAL_UPDATE_STATE(self, y_true, y_pred, sample_weight)
    with global_batch.on_global_batch():  # A loss of `keras_dist.global_batch` as the function: no gather here.
        local = self._fn(y_true, y_pred, **self._fn_kwargs)  # Only its rank is used: pruned from the graph.
    if tf.convert_to_tensor(local).shape.rank != 0:
        return _ORIGINAL_UPDATE_STATE(self, y_true, y_pred, sample_weight)
    mask = ki.get_keras_mask(y_pred)

    def gather(value):  # keras-dist's own gather: labels straight from the iterator have no device (workers)
        return None if value is None else gather_module.all_gather_without_gradient(value)

    y_true, y_pred, sample_weight = (
        tree.map_structure(gather, y_true),
        tree.map_structure(gather, y_pred),
        gather(sample_weight),
    )
    if mask is not None:
        mask = gather(mask)
    with global_batch.on_global_batch():
        values = self._fn(y_true, y_pred, **self._fn_kwargs)
    sample_weight = keras_loss.apply_mask(sample_weight, mask, dtype=self.dtype, reduction="sum")
    share = tf.constant(1.0 / context.num_replicas_in_sync, self.dtype)
    sample_weight = share if sample_weight is None else tf.cast(sample_weight, self.dtype) * share
    return reduction_metrics.Mean.update_state(self, values, sample_weight=sample_weight)
