"""Layer 3: a compiled loss or metric computed on the global batch (`keras_dist.global_batch`).

A loss that couples the examples of a batch (an in-batch softmax over
`q @ c^T`, a contrastive or batch-hard triplet loss, a Dice over the whole
batch) gives another value on each replica's part than on the global batch,
and no weighting of the parts' values gives one device's. `loss_on_global_batch`
gathers `y_true`, `y_pred`, the sample weights and the Keras mask over the
replicas (`gather.all_gather`: global order, uneven and empty parts, its
gradient weighted as keras-dist weights the replicas' gradients) and computes
the loss there. The value is then the same on every replica; `loss_terms`
counts its term once (by each replica's example share, shares summing to 1),
in value and in gradient. `update_metric_on_global_batch` updates a metric's
state with the gathered batch on replica 0 only, so the state summed over the
replicas holds the global batch once.

Inside `on_global_batch()` (a loss or metric already given the global batch)
the wrappers compute on what they are given: no second gather.
"""

import keras
import tensorflow as tf
from keras import tree

from keras_dist._runtime import batch_coupling, gather, loss_terms, step_state
from keras_dist._runtime import keras_internals as ki

_STATE = gather.ThreadDepth()  # Inside `on_global_batch` on this thread (one per replica under Mirrored).


def on_global_batch():
    """While the block runs on this thread, losses and metrics wrapped by `keras_dist.global_batch` do not gather."""
    return _STATE


def _gathering_context(values):
    """This replica's context when `values` must be gathered, else `None`.

    `None` on one replica, outside any strategy, in cross-replica context (no
    replica's part: the values are whatever the caller has), for Keras'
    symbolic tensors, and inside `on_global_batch`.
    """
    if _STATE:
        return None
    context = tf.distribute.get_replica_context()
    if context is None or tf.distribute.in_cross_replica_context() or context.num_replicas_in_sync == 1:
        return None
    if any(keras.backend.is_keras_tensor(v) for v in tree.flatten(values)):
        return None
    return context


def _gathered_mask(y_pred):
    """The Keras mask of `y_pred` gathered over the replicas (as bool), or `None`."""
    mask = ki.get_keras_mask(y_pred) if tf.is_tensor(y_pred) else None
    if mask is None:
        return None
    return tf.cast(gather.all_gather_without_gradient(tf.cast(mask, tf.int32)), tf.bool)


def gathered_batch(y_true, y_pred, sample_weight, *, differentiable):
    """`(y_true, y_pred, sample_weight)` of the global batch, `y_pred` carrying the gathered Keras mask.

    `y_pred` is gathered with `gather.all_gather` (its gradient reaches each
    replica's own part) when `differentiable`, the rest without a gradient.
    Call only where `_gathering_context` is not `None`.
    """
    mask = _gathered_mask(y_pred)
    plain = gather.all_gather_without_gradient
    y_true = tree.map_structure(lambda v: None if v is None else plain(v), y_true)
    if differentiable:
        y_pred = gather.all_gather(y_pred)
    else:
        y_pred = tree.map_structure(lambda v: plain(tf.stop_gradient(v)), y_pred)
    sample_weight = None if sample_weight is None else plain(tf.stop_gradient(sample_weight))
    if mask is not None:
        y_pred = tf.identity(y_pred)
        ki.set_keras_mask(y_pred, mask)
    return y_true, y_pred, sample_weight


def loss_on_global_batch(loss, y_true, y_pred, sample_weight=None):
    """`loss(y_true, y_pred, sample_weight)` computed on the global batch; the same value on every replica.

    On one replica, outside any strategy and in cross-replica context it is
    `loss(y_true, y_pred, sample_weight)`. Inside a keras-dist step the term
    it records counts once over the replicas (`loss_terms.counted_once`).

    Distributed behavior:
        Collective in replica context: one all-gather per tensor of `y_true`,
        `y_pred`, `sample_weight` and the mask; every replica must call it.
    """
    context = _gathering_context([y_true, y_pred, sample_weight])
    if context is None:
        return loss(y_true, y_pred, sample_weight)
    y_true, y_pred, sample_weight = gathered_batch(y_true, y_pred, sample_weight, differentiable=True)
    with on_global_batch(), loss_terms.counted_once():
        return loss(y_true, y_pred, sample_weight)


def values_on_global_batch(loss, y_true, y_pred):
    """`loss.call(y_true, y_pred)` (the unreduced values) on the global batch; its gradient reaches each part."""
    context = _gathering_context([y_true, y_pred])
    if context is not None:
        y_true, y_pred, _ = gathered_batch(y_true, y_pred, None, differentiable=True)
    with on_global_batch():
        return loss.call(y_true, y_pred)


def update_metric_on_global_batch(metric, y_true, y_pred, sample_weight=None):
    """Updates `metric` with the global batch once: on replica 0, whose state the replicas' sum then holds.

    The new state is computed without assigning (`keras.StatelessScope`), on
    every replica from the gathered batch, and kept on replica 0 only for
    variables summed over the replicas (aggregation `"sum"`, Keras' default
    for metric state); a variable aggregated otherwise (`"mean"`, the same on
    every replica) takes it on every replica. keras-dist's own metric
    dispatchers (`batch_metrics`, scalar `Mean` in a step of one's own) see
    one device's update: the step is suspended while the metric updates.

    Distributed behavior:
        Collective in replica context: one all-gather per tensor of `y_true`,
        `y_pred`, `sample_weight` and the mask; every replica must call it.
    """
    context = _gathering_context([y_true, y_pred, sample_weight])
    if context is None:
        return metric.update_state(y_true, y_pred, sample_weight=sample_weight)
    y_true, y_pred, sample_weight = gathered_batch(y_true, y_pred, sample_weight, differentiable=False)
    variables = list(metric.variables)
    with step_state.running(None), on_global_batch():
        with keras.StatelessScope(state_mapping=[(v, v.value) for v in variables]) as scope:
            metric.update_state(y_true, y_pred, sample_weight=sample_weight)
        new_values = [scope.get_current_value(v) for v in variables]
    first = tf.equal(context.replica_id_in_sync_group, 0)
    for variable, value in zip(variables, new_values):
        if value is None:
            continue
        if getattr(variable, "aggregation", "sum") == "sum":
            value = tf.where(first, tf.cast(value, variable.dtype), variable.value)
        variable.assign(value)


def batch_mean(values):
    """The mean of `values` over the global batch (axis 0): a differentiable all-reduce in replica context.

    Each replica sums its own rows and counts them; one all-reduce sums both
    over the replicas (its gradient is the all-reduce of the gradients, so
    every replica's rows get the global mean's gradient). Outside replica
    context, or with one replica, `ops.mean(values, axis=0)`.

    Distributed behavior:
        Collective in replica context with several replicas: every replica
        must call it, in the same order.
    """
    batch_coupling.note_batch_statistic()
    values = tf.convert_to_tensor(values)
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return keras.ops.mean(values, axis=0)
    rows = tf.cast(tf.shape(values)[0], values.dtype)
    total, count = context.all_reduce(tf.distribute.ReduceOp.SUM, [tf.reduce_sum(values, axis=0), rows])
    return tf.math.divide_no_nan(total, tf.stop_gradient(count))
