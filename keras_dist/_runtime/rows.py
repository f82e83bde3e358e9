"""Sparse gradients (`tf.IndexedSlices`) kept as rows where Keras would densify them.

Keras 3 keeps an `IndexedSlices` gradient as rows through most of `apply`, but
turns it into a dense tensor of the table's shape in two places keras-dist
reaches: its gradient accumulation (`(g + accumulator) / k`, the dense
accumulator added to the rows) and `global_clipnorm` (`rows * scale`, a
tensor times `IndexedSlices`). A dense gradient is the rows merged by index,
so rows merged by index (unique indices, values summed) give the optimizer the
same update without a tensor of the table's size. Private Keras attributes
used here: `BaseOptimizer._accumulated_gradients`, `_get_variable_index`,
`_backend_increment_gradient_accumulators`, `_clip_gradients`.
"""

import contextlib

import tensorflow as tf


def merge_rows(rows):
    """The rows of `rows` merged by index: one row per distinct index, the values summed.

    Densified, the result equals `rows` densified (`tf.convert_to_tensor`
    sums repeated indices too), so an optimizer that applies rows row by row
    gives the dense gradient's update from it.

    Args:
        rows: A `tf.IndexedSlices`: `values` `(M, ...)` of a floating dtype,
            `indices` `(M,)` int32 or int64.

    Returns:
        A `tf.IndexedSlices` with `U <= M` rows (`U` distinct indices, in the
        order they first appear), the same dtypes and `dense_shape`.
    """
    indices, positions = tf.unique(rows.indices)
    values = tf.math.unsorted_segment_sum(rows.values, positions, tf.shape(indices)[0])
    return tf.IndexedSlices(values, indices, rows.dense_shape)


class _RowsOverSteps:
    """`rows + accumulator` in Keras' update branch: divided by `k` next, it stays rows."""

    def __init__(self, rows):
        self.rows = rows

    def __truediv__(self, steps):
        values = self.rows.values / tf.cast(steps, self.rows.values.dtype)
        return tf.IndexedSlices(values, self.rows.indices, self.rows.dense_shape)


class _RowsPassThrough:
    """Stands in for Keras' (zero) accumulator of a variable whose summed gradient arrives as rows.

    Keras' update branch computes `(g + accumulator) / k` and then zeroes the
    accumulators; with this in the list, `g + self` keeps `g`'s rows, the
    division scales their values, and the zeroing does nothing (the real
    accumulator is zero already: keras-dist keeps the running sums itself).
    """

    shape = (0,)

    def __init__(self, dtype):
        self.dtype = dtype

    def __radd__(self, gradient):
        if not isinstance(gradient, tf.IndexedSlices):
            raise TypeError(f"keras-dist internal error: expected rows (tf.IndexedSlices), received {type(gradient)}.")
        return _RowsOverSteps(gradient)

    def assign(self, value):
        return None


@contextlib.contextmanager
def rows_through_keras_accumulation(optimizer, gradients, variables):
    """While the block runs, Keras' accumulation branch keeps the `tf.IndexedSlices` among `gradients` as rows.

    Keras' update step divides `gradient + accumulator` by `k`; the
    accumulators of the variables with a sparse gradient are replaced, for the
    block, by stand-ins that keep the rows (their values divided by `k`).
    Call it only where `optimizer` (which itself accumulates) applies, on an
    update micro-batch, gradients already summed over micro-batches and
    replicas, its accumulators zero: Keras' accumulating branch, traced but
    not taken, does nothing for the block.

    Args:
        optimizer: The Keras optimizer with `gradient_accumulation_steps`.
        gradients: List of the summed gradients, `None` allowed.
        variables: The matching trainable variables.
    """
    original = optimizer._accumulated_gradients
    replaced = list(original)
    sparse = [(g, v) for g, v in zip(gradients, variables) if isinstance(g, tf.IndexedSlices)]
    for gradient, variable in sparse:
        replaced[optimizer._get_variable_index(variable)] = _RowsPassThrough(gradient.values.dtype)
    if not sparse:
        yield
        return
    object.__setattr__(optimizer, "_accumulated_gradients", replaced)  # Past Keras' tracking: a plain list.
    # Keras traces its accumulating branch too (`ops.cond`); it never runs here (same `_iterations` test).
    optimizer.__dict__["_backend_increment_gradient_accumulators"] = lambda grads, acc_grads: None
    try:
        yield
    finally:
        object.__setattr__(optimizer, "_accumulated_gradients", original)
        optimizer.__dict__.pop("_backend_increment_gradient_accumulators", None)


def _clip_keeping_rows(optimizer, gradients):
    """Keras' `_clip_gradients`, with `global_clipnorm` scaling the rows' values instead of densifying them.

    Keras computes the norm from the rows (each row squared, as one device)
    and multiplies by the scale, which densifies (repeated rows summed); the
    rows' values times the scale, merged by index, are that dense gradient.
    """
    keras_clip = type(optimizer)._clip_gradients
    if not (optimizer.global_clipnorm and not optimizer.clipnorm):
        return keras_clip(optimizer, gradients)
    if not any(isinstance(g, tf.IndexedSlices) for g in gradients):
        return keras_clip(optimizer, gradients)
    clipped = keras_clip(optimizer, [g.values if isinstance(g, tf.IndexedSlices) else g for g in gradients])
    return [
        merge_rows(tf.IndexedSlices(c, g.indices, g.dense_shape)) if isinstance(g, tf.IndexedSlices) else c
        for g, c in zip(gradients, clipped)
    ]


@contextlib.contextmanager
def rows_kept_through_clipping(optimizers):
    """While the block runs, `global_clipnorm` on each of `optimizers` keeps sparse gradients as rows (merged by index).

    Re-entrant (MirroredStrategy's replica threads each enter it at trace
    time); only these instances change, only while the block runs.
    """
    for opt in optimizers:
        opt.__dict__["_keras_dist_rows_depth"] = opt.__dict__.get("_keras_dist_rows_depth", 0) + 1
        opt.__dict__["_clip_gradients"] = lambda gradients, opt=opt: _clip_keeping_rows(opt, gradients)
    try:
        yield
    finally:
        for opt in optimizers:
            opt.__dict__["_keras_dist_rows_depth"] -= 1
            if not opt.__dict__["_keras_dist_rows_depth"]:
                opt.__dict__.pop("_clip_gradients", None)
