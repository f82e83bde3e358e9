"""The gradient all-reduce of `DistributedModel.train_step`, on `ReplicaContext.all_reduce`."""

import tensorflow as tf


def all_reduce_gradients(gradients, options):
    """Sums `gradients` over all replicas, with `options`' packing, timeout and compression.

    Args:
        gradients: List of per-replica gradients: `tf.Tensor`,
            `tf.IndexedSlices` (embeddings; all-gathered, never densified or
            compressed here) or `None` (a variable without gradient, kept as
            `None`).
        options: A `keras_dist.CommunicationOptions`.

    Returns:
        List of the summed gradients, in the same order and dtypes.

    Distributed behavior:
        Runs in replica context and is a collective: every replica of every
        worker must call it with the same structure of gradients (the same
        `None` positions), which holds because every replica runs the same
        step function on the same model.
    """
    context = tf.distribute.get_replica_context()
    present = [i for i, g in enumerate(gradients) if g is not None]
    if context is None or not present:
        return list(gradients)
    values = [_compress(gradients[i], options.compressed_dtype) for i in present]
    reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, values, options=options.to_tensorflow())
    result = list(gradients)
    for i, value in zip(present, reduced):
        result[i] = _decompress(value, gradients[i].dtype)
    return result


def _compress(gradient, dtype):
    if dtype is None or isinstance(gradient, tf.IndexedSlices) or not gradient.dtype.is_floating:
        return gradient
    return tf.cast(gradient, dtype)


def _decompress(value, dtype):
    if isinstance(value, tf.IndexedSlices) or value.dtype == dtype:
        return value
    return tf.cast(value, dtype)
