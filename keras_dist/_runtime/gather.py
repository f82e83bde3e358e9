"""Layer 3: a differentiable all-gather of the global batch, exact under keras-dist's gradient weighting.

A loss that couples the examples of a batch (contrastive InfoNCE, in-batch
negatives, batch-hard triplets) needs the global batch on every replica.
TensorFlow's `ReplicaContext.all_gather` gives it, in global replica order
(uneven and empty parts included), and its gradient gives each replica the sum
over the replicas of the upstream gradient of its own slice (a reduce-scatter):
the gradient of the sum of the replicas' losses.

keras-dist does not always sum the replicas' losses as they are: in a step
written for one device it weights each replica's gradients by its example
share after the backward pass (`step_state.EXAMPLES`, or
`EXAMPLES_IN_ALL_REDUCE` in keras-dist's own step). The objective is then
`J = sum_q w_q L_q` (`w_q`: replica q's examples over the global examples),
whose gradient with respect to replica r's slice is `sum_q w_q dL_q/dZ[r]`,
while replica r's whole gradient is multiplied by `w_r` afterwards. So the
gather scales its upstream gradient by `w_q` on each replica before the
reduce-scatter and by `1 / w_r` after it (the global examples cancel: the
unnormalized example counts are used). The weighting is read when the
gradient is computed, after the step has fixed it. With a global loss (equal
on every replica) this gives one device's gradient on any split; with a loss
over this replica's queries against the gathered keys too.

Because of that weighting these gathers are exact in keras-dist's one-collective
step too (`steps.observing_collectives` does not count them as a collective in
`call` that would need the two-collective step): `weighted_gathers_running()`
says when one runs on this thread.
"""

import threading

import keras
import tensorflow as tf
from keras import tree

from keras_dist import _compat
from keras_dist._runtime import step_state


class ThreadDepth:
    """A nesting count per thread (one thread per replica under `MirroredStrategy`): `with depth:`, `bool(depth)`."""

    def __init__(self):
        self._local = threading.local()

    def __enter__(self):
        self._local.depth = getattr(self._local, "depth", 0) + 1

    def __exit__(self, *exc_info):
        self._local.depth -= 1

    def __bool__(self):
        return bool(getattr(self._local, "depth", 0))


_weighted_gather = ThreadDepth()  # A gather of this module runs on this thread.


def weighted_gathers_running():
    """Whether a gather of this module (weighted as keras-dist weights gradients, or without one) runs on this thread."""
    return bool(_weighted_gather)


def _replica_context():
    """This replica's context, or `None` on one replica / outside any strategy (where the gather is the identity).

    Raises:
        RuntimeError: in the cross-replica context of a strategy with several
            replicas (eager code outside a step), where there is no replica's
            part to gather.
    """
    strategy = tf.distribute.get_strategy()
    if strategy.num_replicas_in_sync == 1:
        return None
    if tf.distribute.in_cross_replica_context():
        raise RuntimeError(
            "keras_dist.ops.all_gather gathers the replicas' parts of a batch inside a step. Expected: a call "
            "from a `train_step`/`test_step`/`predict_step`, a loss, a metric or a layer's `call` while "
            f"{type(strategy).__name__} runs the step on its {strategy.num_replicas_in_sync} replicas. "
            "Received: a call in cross-replica context (outside any step). Fix: call it inside the step, "
            "or on the values the step returned."
        )
    return tf.distribute.get_replica_context()


def _gradient_weight(step):
    """float32 scalar: how this replica's gradient counts in keras-dist's sum (unnormalized), read at backward time."""
    if step is not None and step.weighted_in_backward:  # The target carries each replica's weight itself.
        return tf.constant(1.0)
    if step is not None and step.weighting in (step_state.EXAMPLES, step_state.EXAMPLES_IN_ALL_REDUCE):
        return tf.cast(step.num_examples, tf.float32)
    return tf.constant(1.0)


def _scale_gradient(value, scale):
    """`value`, whose gradient is multiplied by `scale()` (a callable evaluated when the gradient is computed)."""

    @tf.custom_gradient
    def identity(x):
        def gradient(upstream):
            factor = tf.cast(scale(), upstream.dtype)
            if isinstance(upstream, tf.IndexedSlices):
                return tf.IndexedSlices(upstream.values * factor, upstream.indices, upstream.dense_shape)
            return upstream * factor

        return tf.identity(x), gradient

    return identity(value)


def _gather_one(context, step, value, axis):
    if _compat.is_active("device_less_gather_input"):
        value = tf.identity(value)  # Placed on this replica's device (keras_dist._compat).
    if not value.dtype.is_floating:
        with _weighted_gather:
            return context.all_gather(value, axis=axis)
    weight = lambda: _gradient_weight(step)  # noqa: E731
    own = _scale_gradient(value, lambda: tf.math.divide_no_nan(1.0, weight()))
    with _weighted_gather:
        gathered = context.all_gather(own, axis=axis)
    return _scale_gradient(gathered, weight)


def all_gather(values, axis=0):
    """Concatenates every replica's `values` along `axis`, in global replica order; differentiable.

    Inside a step on N replicas (one `MirroredStrategy` or several workers),
    every replica gets the global batch: the parts of replicas 0..N-1
    concatenated, uneven and empty parts included (the global batch order is
    replica 0's examples first; `global_batch_offset` says where this
    replica's part starts). On one replica, or outside any strategy, returns
    `values` unchanged, so the same code runs on one device.

    The gradient reaches each replica's own part: the sum over the replicas of
    their losses' gradients with respect to it (a reduce-scatter, TensorFlow's
    gradient of `ReplicaContext.all_gather`), weighted as keras-dist weights
    the replicas' gradients in the step (`_runtime/gather.py`). A loss
    computed from the gathered values as one device computes it from its batch
    (a mean over the global batch's pairs, or over this replica's queries
    against the gathered keys) then trains to one device's weights, with no
    other change.

    Args:
        values: A tensor or a nested structure of tensors, each of shape
            `(n_r, ...)` along `axis` (`n_r`: this replica's examples), any
            dtype; integer tensors (labels, ids) are gathered without a
            gradient. Every replica must call it, with the same structure,
            dtypes and shapes outside `axis` (a collective).
        axis: Python int, the batch axis (default 0).

    Returns:
        The same structure, each tensor of shape `(sum_r n_r, ...)` along
        `axis`; the same values on every replica.

    Raises:
        RuntimeError: called in cross-replica context of a strategy with
            several replicas (outside a step).

    Communication:
        One all-gather per tensor per call (its bytes times N received by
        each replica), and in the backward pass one all-reduce of the
        gathered gradient (TensorFlow's gradient).
    """
    context = _replica_context()
    if context is None:
        return values
    if any(keras.backend.is_keras_tensor(v) for v in tree.flatten(values)):
        return values  # Keras' symbolic build traces shapes only.
    step = step_state.current()
    return tree.map_structure(lambda v: _gather_one(context, step, v, axis), values)


def all_gather_without_gradient(value, axis=0):
    """`value` (one tensor) of every replica concatenated along `axis` in global order, no gradient through it.

    For labels, sample weights and masks; the identity on one replica, outside
    any strategy and for Keras' symbolic tensors. A collective (one all-gather).
    """
    context = _replica_context()
    if context is None or keras.backend.is_keras_tensor(value):
        return value
    with _weighted_gather:
        return context.all_gather(tf.stop_gradient(tf.convert_to_tensor(value)), axis=axis)


def global_batch_offset(values):
    """int32 scalar: where this replica's part of the batch starts in `all_gather`'s global batch.

    `offset + ops.arange(n_r)` are this replica's examples' positions in the
    gathered batch: the labels of a contrastive loss over the global batch
    (the matching pair of example i is example `offset + i`).

    Args:
        values: A tensor or nested structure whose first leaf's leading
            dimension is this replica's number of examples (the batch, or
            the projections computed from it).

    Returns:
        int32 scalar tensor: the examples of the replicas before this one
        (0 on replica 0, on one replica and outside any strategy).

    Communication:
        One all-gather of one int32 per replica.
    """
    first = tree.flatten(values)[0]
    context = _replica_context()
    if context is None or keras.backend.is_keras_tensor(first):
        return tf.constant(0, tf.int32)
    count = tf.reshape(tf.shape(first, out_type=tf.int32)[0], [1])
    with _weighted_gather:
        counts = context.all_gather(count, axis=0)
    position = tf.cast(context.replica_id_in_sync_group, tf.int32)
    return tf.reduce_sum(counts[:position])


def num_replicas():
    """Python int: the replicas the batch is split over (`num_replicas_in_sync`; 1 outside any strategy)."""
    return tf.distribute.get_strategy().num_replicas_in_sync
