"""A `train_step`/`test_step` the user wrote for one device, run as exact for the global batch.

keras.io writes such a step with its replica's own mean loss, `tape.gradient`,
`optimizer.apply_gradients` and `keras.metrics.Mean` trackers. While it runs
under several replicas, `_runtime.user_steps.user_step` registers the replica's
step (`step_state.ReplicaStep`, `user_step=True`) so that the optimizer weights
its gradients by its example share and `DistributedModel.compute_loss` returns
its part of the global batch's loss; `result()` of its metrics reads
their state summed over the replicas. `custom_step_losses =
"global"` (TensorFlow's guide: the step scales its own loss) turns this off.
"""

import tensorflow as tf

from keras_dist import _compat
from keras_dist._runtime import loss_terms, steps, user_steps
from keras_dist.collectives import _all_reduce
from keras_dist.collectives import _optimizer as collectives_optimizer

CUSTOM_STEP_LOSSES = ("mean", "global")


def exact_for_global_batch(model, step, *, marks=None):
    """`step` (a train or test step of the user's own) run as exact for the global batch (see `custom_step_losses`).

    `marks`: `None`, or the timeline's `StepMarksBuffer` (a train step: it takes its timestamps there).
    """
    if (
        model._distribute_strategy.num_replicas_in_sync == 1
        or model.custom_step_losses == "global"
        or not _compat.is_active("custom_step_example_weighting")
    ):
        return step

    def run(data):
        if not isinstance(model._distribute_strategy, tf.distribute.TPUStrategy):  # A TPU traces static shapes only.
            data = steps.with_dynamic_batch(data)
        with user_steps.user_step(
            model,
            data,
            options=model.communication.to_tensorflow(),
            marks=marks,
            tape_all_reduce=_tape_all_reduce(model),
            metrics=model.metrics if _compat.is_active("cross_replica_metrics") else None,
        ) as state:
            return _with_global_metric_results(
                model, step(data), _raw_value_weighting(model, state), state.global_results
            )

    return run


def _tape_all_reduce(model):
    """The all-reduce that makes `tape.gradient` in a step of the user's return the global batch's gradients.

    With gradient accumulation too: the step may clip or otherwise edit each
    micro-batch's gradients before `apply_gradients` adds them up, as one
    device edits the micro-batch's (the replicas' own gradients, summed only
    every k-th micro-batch, were clipped each by its own norm). Each
    micro-batch then costs an all-reduce, as under PyTorch DDP without
    `no_sync`; keras-dist's own step (no `train_step` of the user's) keeps
    one all-reduce per k micro-batches. `None` (the replica's gradients
    reach `apply`, which sums them) when Keras' own sum inside `apply` is
    in use (`sum_gradients_before_apply` off).
    """
    if not _compat.is_active("sum_gradients_before_apply"):
        return None
    strategy = model._distribute_strategy

    def all_reduce(gradients, sources):
        names = collectives_optimizer.structure_check_names(sources, strategy)
        return _all_reduce.all_reduce_gradients(gradients, model.communication, names=names)[0]

    return all_reduce


def _raw_value_weighting(model, state):
    """Returns the function that makes a raw scalar the step returns count by this replica's share of it.

    Keras averages the values a step returns over the replicas
    (`distribute_reduction_method` `"auto"` or `"mean"`): a raw loss tensor
    (keras.io's WGAN-GP returns `{"d_loss": d_loss, "g_loss": g_loss}`), a
    mean over this replica's examples, then logs the replicas' unweighted
    mean, and NaN when a replica had no examples (the mean of nothing).
    Each float scalar becomes `share x replicas x value` (0 on a replica
    without examples), term by term (`loss_terms.shared_value`): the share
    of the examples for a mean over them, of the denominator for a ratio of
    sums, 1 for a sum over the examples; the mean over the replicas is one
    device's value. An integer (a count of rows or of correct predictions)
    is taken as float32 first: Keras' mean of integers over the replicas
    truncates. A tensor of higher rank (a mean or count per class) counts
    by its share as a whole (`loss_terms.shared_tensor`); one with a row per
    example is left as it is. A largest or smallest entry of the batch's
    values (`ops.max(error)`) becomes the global batch's on every replica
    (`loss_terms.global_extreme`).
    Not a metric's result returned under another name (keras.io's VAE
    returns `total_loss_tracker.result()` as `"loss"`): inside the step it
    reads the state summed over the replicas, so it is the global batch's
    already (`GlobalResults.is_returned`, read from the traced graph; a
    run-time comparison with the results misread a raw loss as one where a
    replica held the whole global batch: a new-user probe, stop 52).
    Returns the identity where Keras does not average (`"sum"`, `"first"`, a TPU).
    """
    method = model.distribute_reduction_method
    strategy = model._distribute_strategy
    if method not in ("auto", "mean") or isinstance(strategy, tf.distribute.TPUStrategy):
        return lambda value: value
    num_replicas = float(strategy.num_replicas_in_sync)

    def weighted(value):
        if not isinstance(value, (tf.Tensor, tf.Variable)) or value.shape.rank is None:
            return value
        if not (value.dtype.is_floating or value.dtype.is_integer):
            return value
        value = tf.convert_to_tensor(value)
        if value.dtype.is_integer:  # Keras' mean of integers truncates: 5 rows on 3 replicas were logged as 1.
            value = tf.cast(value, tf.float32)
        if value.shape.rank != 0:
            return loss_terms.shared_tensor(value, state, value.dtype) * tf.cast(num_replicas, value.dtype)
        extreme = loss_terms.global_extreme(value, state)
        if extreme is not None:  # `ops.max(error)`: every replica holds the global batch's.
            return extreme
        if state.global_results is not None and state.global_results.is_returned(value):
            return value  # A metric's result, read from the state summed over the replicas: global already.
        return loss_terms.shared_value(value, state, value.dtype) * tf.cast(num_replicas, value.dtype)

    return weighted


def _with_global_metric_results(model, logs, weighted, global_results):
    """`logs` a step of yours returned, each value named after one of `model.metrics` replaced by its global result.

    keras.io returns `{m.name: m.result() for m in self.metrics}`. Inside
    the step (`user_steps.user_step(metrics=model.metrics)`), `m.result()`
    reads the metrics' state summed over the replicas (one all-reduce,
    `_runtime.metric_results`), one device's results, and so does what the
    step computes from them (a perplexity); Keras then averages equal values.
    A container's results (`compile_metrics`) are taken here the same way.

    A value under a metric's name that is not that metric's result stays the
    step's value: TensorFlow Recommenders' step returns `{m.name: m.result()
    for m in self.metrics}` and then overwrites `"loss"` (Keras' own loss
    tracker, which such a step never updates) with its raw loss tensor. So
    a value is kept as a result only where it is what a metric's `result()`
    returned in the step (`_global_if_a_result`, read from the traced graph).

    Every other float scalar (a raw loss tensor) goes through `weighted`
    (`_raw_value_weighting`: counted by this replica's example share).
    """
    if not isinstance(logs, dict):
        return logs
    by_name = {m.name: m for m in model.metrics} if _compat.is_active("cross_replica_metrics") else {}
    # In the step, `result()` reads the state summed over the replicas (`user_steps.user_step(metrics=...)`).
    results = model._metrics_result_from_summed_state(None) if any(key in by_name for key in logs) else {}
    merged = dict(logs)
    for key, value in logs.items():
        if key not in by_name or key not in results and not isinstance(value, dict):
            merged[key] = weighted(value)
        elif isinstance(value, dict):  # A metrics container (`compile_metrics`): one result per metric it holds.
            merged[key] = {name: results.get(name, part) for name, part in value.items()}
        else:
            merged[key] = _global_if_a_result(value, weighted, global_results)
    return merged


def _global_if_a_result(value, weighted, global_results):
    """`value` where it is what a metric's `result()` returned in the step (the global result already), else `weighted(value)`.

    Decided from the traced graph (`GlobalResults.is_returned`): a run-time
    comparison with the result took a raw loss for the result on a replica
    that held the whole global batch (a one-example step: the logs read one
    device's value divided by the replicas, a new-user probe, stop 52).
    """
    try:
        value = tf.convert_to_tensor(value)
    except (TypeError, ValueError):
        return value  # Not a tensor: not a metric's result.
    if global_results is not None and global_results.is_returned(value):
        return value  # Read from the state summed over the replicas (at the step's end, or earlier in it).
    return weighted(value)


def compute_loss(model, keras_compute_loss, step):
    """`compute_loss` inside a user's step (`step`, its `ReplicaStep`): this replica's part of the global loss."""
    return user_steps.user_step_loss(model, keras_compute_loss, step, model.communication.to_tensorflow())


def check_custom_step_losses(value):
    """Raises `ValueError` unless `value` is one of `CUSTOM_STEP_LOSSES`."""
    if value not in CUSTOM_STEP_LOSSES:
        raise ValueError(
            f"`custom_step_losses` must be one of {CUSTOM_STEP_LOSSES}. Received: custom_step_losses={value!r}. "
            "Fix: 'mean' for a train_step that computes its replica's mean loss (keras.io), 'global' for one "
            "that scales its loss for the global batch (tf.nn.compute_average_loss)."
        )
