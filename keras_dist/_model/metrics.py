"""Metric results computed from metric state summed over all replicas (one device's results).

On a replica, `metric.result()` reads that replica's state only, and Keras
averages the replicas' results, which an uneven split makes differ from one
device's. Summing the sync-on-read state over the replicas first (one packed
all-reduce, or inside the gradient all-reduce: `SummedMetrics`) gives one
device's results.
"""

import keras
import tensorflow as tf

from keras_dist import _compat
from keras_dist._runtime import keras_internals as ki
from keras_dist._runtime import metric_results, step_state


def get_metrics_result(model, keras_get_metrics_result):
    """`DistributedModel.get_metrics_result`: from summed state in replica context, Keras' own elsewhere.

    In a step of the user's, `result()` reads the summed state already (`_runtime.metric_results`).
    """
    context = tf.distribute.get_replica_context()
    if (
        context is None
        or model._distribute_strategy.num_replicas_in_sync == 1
        or not _compat.is_active("cross_replica_metrics")
    ):
        return keras_get_metrics_result()
    if getattr(step_state.current(), "global_results", None) is not None:
        return model._metrics_result_from_summed_state(None)
    return context.merge_call(model._metrics_result_from_summed_state)


def result_from_summed_state(model, strategy, keras_get_metrics_result):
    """Metric results from state summed over all replicas, in one all-reduce (cross-replica context).

    Reading each sync-on-read metric variable would sum it with its own
    all-reduce (two per `Mean` metric, one collective each per step under
    several workers); `batch_reduce_to` sums them in one packed collective
    per dtype (a pack is one tensor: `MeanIoU`'s int64 confusion matrix
    cannot share the float32 sums' pack), and Keras computes the results
    from those sums. `strategy=None`: in a replica's step of the user's,
    whose metrics' `result()` reads the summed state already
    (`_runtime.metric_results`): Keras' own results, without another all-reduce.
    """
    if strategy is None:
        return keras.tree.map_structure(metric_results.read_if_variable, keras_get_metrics_result())
    by_dtype: dict[str, list] = {}
    for metric in model.metrics:
        for v in metric.variables:
            if (
                isinstance(v.value, tf.distribute.DistributedValues)
                and v.value.aggregation == tf.VariableAggregation.SUM
            ):
                by_dtype.setdefault(v.value.dtype.name, []).append(v)
    if not by_dtype:
        return keras_get_metrics_result()
    state_mapping = []
    for dtype, summed in by_dtype.items():
        # int32: TensorFlow's MirroredStrategy reduces each int32 value with its own ReductionToOneDevice
        # and refuses two in one batch_reduce_to (`_compat` `int32_batch_reduce`): one call per variable.
        if dtype == "int32" and _compat.is_active("int32_batch_reduce"):
            batches = [[v] for v in summed]
        else:
            batches = [summed]
        for batch in batches:
            reduced = strategy.extended.batch_reduce_to(
                tf.distribute.ReduceOp.SUM,
                [(v.value, v.value) for v in batch],
                options=model.communication.to_tensorflow(),
            )
            state_mapping += [(v, strategy.experimental_local_results(r)[0]) for v, r in zip(batch, reduced)]
    with keras.StatelessScope(state_mapping=state_mapping):
        # Read inside the scope: a metric whose `result()` returns its variable itself (a running
        # maximum) would otherwise hand out the variable, read later as this replica's own state.
        return keras.tree.map_structure(metric_results.read_if_variable, keras_get_metrics_result())


class SummedMetrics:
    """The metric state `DistributedModel.train_step` sums in the gradient all-reduce (see `steps.train_step`).

    Args:
        model: The `DistributedModel`.
        overrides_metrics_result: Boolean, `model`'s class has its own
            `get_metrics_result` (its results may read other state).
    """

    def __init__(self, model, *, overrides_metrics_result):
        self.model = model
        self.overrides_metrics_result = overrides_metrics_result

    def variables(self):
        """The metric variables (float32, sync-on-read, summed), or `None` when the metrics cannot ride along.

        Not when the model overrides `compute_metrics` or `get_metrics_result`
        (they may read other state), nor with variables aggregated otherwise,
        nor when a compiled metric is not one of Keras' own classes: the
        metrics are then updated before `apply`, and a metric of one's own
        may read the weights (it would see them before the step).
        """
        model = self.model
        compiled = ki.compiled_metrics(model)
        if (
            type(model).compute_metrics is not keras.Model.compute_metrics
            or self.overrides_metrics_result
            or not _compat.is_active("cross_replica_metrics")
            or not all(type(m).__module__.startswith("keras.") for m in compiled)
        ):
            return None
        variables = list({id(v): v for metric in model.metrics for v in metric.variables}.values())
        if not variables or not all(
            isinstance(v.value, tf.distribute.DistributedValues)
            and v.value.aggregation == tf.VariableAggregation.SUM
            and v.dtype == "float32"
            for v in variables
        ):
            return None
        return variables

    def results(self, variables, sums):
        """Keras' metric results computed from `sums` (float32 tensors, one per variable)."""
        with keras.StatelessScope(state_mapping=list(zip(variables, sums))):
            return keras.Model.get_metrics_result(self.model)
