"""The gradient all-reduce of `distributed_optimizer`, on TensorFlow's cross-device ops."""

import dataclasses

import tensorflow as tf

from keras_dist.collectives import _windows

GRADIENT_STRUCTURE_MISMATCH = "keras-dist: the workers disagree on which variables receive a gradient"


def sparse_row_counts(gradients, replica_id, num_replicas):
    """Returns this replica's row counts of the sparse `gradients`, placed at its replica's position.

    Summed over the replicas (in the all-reduce that carries the other side
    values), the result tells every replica how many rows each replica sent
    for each sparse gradient, which `combine_gathered_rows` needs.

    Args:
        gradients: List of the gradients about to be sent; only the
            `tf.IndexedSlices` among them count, in order.
        replica_id: Integer scalar (Python or tensor), this replica's
            `replica_id_in_sync_group` (global under several workers).
        num_replicas: Python int, `num_replicas_in_sync`.

    Returns:
        A float32 vector of length `num_replicas * S` (S: the number of sparse
        gradients), row-major `(num_replicas, S)`: zero except row
        `replica_id`, which holds each sparse gradient's number of rows
        (exact up to 2**24 rows per replica).
    """
    counts = [tf.cast(tf.shape(g.indices)[0], tf.float32) for g in gradients if isinstance(g, tf.IndexedSlices)]
    position = tf.one_hot(tf.cast(replica_id, tf.int32), num_replicas, dtype=tf.float32)
    return tf.reshape(position[:, None] * tf.stack(counts)[None, :], [-1])


def combine_gathered_rows(gathered, row_counts):
    """The rows one device would have, from the replicas' all-gathered rows of a sparse gradient.

    Keras 3's optimizers apply a `tf.IndexedSlices` gradient row by row (Adam,
    AdamW, RMSprop and Adagrad square each row before the rows are added into
    the table's slots; `clipnorm` takes the norm of the rows), so the rows
    themselves, not only their sum, must be one device's. One device gets one
    row per entry of the lookup's index tensor:

    - lookups with a batch dimension (token ids) give each replica the rows of
      its own examples, so the replicas' rows concatenated are one device's
      rows (returned as gathered);
    - lookups that do not depend on the batch (a position embedding looked
      up with `ops.arange`) give every replica the same indices, each row a
      partial sum over that replica's examples, where one device has one row
      per index summed over the global batch: when every replica sent the
      same number of rows with identical indices, the replicas' rows are
      summed position by position (one replica's indices kept).

    Every replica holds the same gathered rows and counts, so every replica
    decides alike; nothing is communicated here. Known residual: token
    lookups whose indices happen to be identical on every replica (same
    number and order of ids) are summed too, where one device would keep
    them apart.

    Args:
        gathered: A `tf.IndexedSlices`, the concatenation of the replicas'
            rows (`values` `(M, ...)`, `indices` `(M,)`), in any replica
            order.
        row_counts: float32 vector `(num_replicas,)`, the number of rows each
            replica sent (`sparse_row_counts` summed over the replicas).

    Returns:
        A `tf.IndexedSlices` with the same `dense_shape` and dtypes: `T` rows
        (`values` summed over the replicas, the first replica's `indices`)
        when every replica sent `T` rows with identical indices, else
        `gathered` unchanged. The rows stay sparse.
    """
    num_replicas = row_counts.shape[0]
    counts = tf.cast(tf.round(row_counts), tf.int32)
    rows = counts[0]
    total = tf.shape(gathered.indices)[0]
    equal_lengths = tf.logical_and(tf.reduce_all(tf.equal(counts, rows)), tf.equal(total, num_replicas * rows))

    # Sliced to the rows the branch reads (all of them where it runs): a static row count that
    # `num_replicas` does not divide (TensorFlow 2.23 keeps it) must not fail the untaken branch's shape check.
    def identical_indices():
        indices = tf.reshape(gathered.indices[: num_replicas * rows], [num_replicas, rows])
        return tf.reduce_all(tf.equal(indices, indices[:1]))

    identical = tf.cond(equal_lengths, identical_indices, lambda: tf.constant(False))

    def summed():
        shape = tf.concat([[num_replicas, rows], tf.shape(gathered.values)[1:]], 0)
        values = tf.reduce_sum(tf.reshape(gathered.values[: num_replicas * rows], shape), axis=0)
        return values, gathered.indices[:rows]

    values, indices = tf.cond(identical, summed, lambda: (gathered.values, gathered.indices))
    return tf.IndexedSlices(values, indices, gathered.dense_shape)


def gradient_kinds(gradients):
    """Returns a float32 vector of length `2 * len(gradients)`: 1 where a gradient is dense, then 1 where sparse.

    Which gradients are `None`, dense or `tf.IndexedSlices` is fixed when the
    step is traced; it is a run-time tensor here only so that it can be summed
    over the replicas.
    """
    dense = [float(g is not None and not isinstance(g, tf.IndexedSlices)) for g in gradients]
    sparse = [float(isinstance(g, tf.IndexedSlices)) for g in gradients]
    return tf.constant(dense + sparse, tf.float32)


def assert_same_gradient_kinds(summed_kinds, num_replicas, names):
    """Fails the step on every worker when replicas traced different gradient structures.

    A variable that receives a gradient on some workers and none (or a sparse
    one) on others would make the gradient all-reduce mismatch: a wrong sum
    when the packed sizes happen to agree, a hang or a shape error otherwise.
    Every worker sees the same summed vector, so every worker fails alike,
    before the gradients are sent.

    Args:
        summed_kinds: `gradient_kinds` summed over all replicas.
        num_replicas: Integer, `num_replicas_in_sync`.
        names: List of the variables' names (strings), in gradient order.

    Returns:
        The assertion op (run it before the gradient all-reduce).

    Raises:
        tf.errors.InvalidArgumentError: At run time, naming the variables
            whose gradient kind differs between replicas.
    """
    disagree = tf.logical_and(tf.not_equal(summed_kinds, 0.0), tf.not_equal(summed_kinds, float(num_replicas)))
    disagree = tf.reduce_any(tf.reshape(disagree, [2, len(names)]), axis=0)
    return tf.debugging.Assert(
        tf.logical_not(tf.reduce_any(disagree)),
        [
            f"{GRADIENT_STRUCTURE_MISMATCH}; those below get a gradient on some replicas and none (or a "
            "sparse one instead of a dense one) on others:",
            tf.boolean_mask(tf.constant(names), disagree),
        ],
        summarize=20,
    )


def all_reduce_gradients(gradients, options, *, names=None, num_examples=None, extras=()):
    """Sums `gradients` over all replicas, with `options`' packing, timeout and compression.

    Args:
        gradients: List of per-replica gradients: `tf.Tensor`,
            `tf.IndexedSlices` (embeddings; all-gathered as rows, neither
            densified nor compressed; the gathered rows are one device's
            rows, see `combine_gathered_rows`; densified first with
            `options.sparse_gradients="dense"`) or `None` (a variable without
            gradient, kept as `None`).
        options: A `keras_dist.CommunicationOptions` (`bytes_per_pack="auto"`
            is resolved for this replica context's strategy).
        names: Optional list of the variables' names. When given, the replicas
            check that they agree on which gradients are `None`, dense or
            sparse (`2 * len(gradients)` floats summed over the replicas), and
            all fail with those names if not (see `assert_same_gradient_kinds`).
        num_examples: Optional int32 scalar tensor, this replica's examples.
            When given, each replica's gradients count by its share of the
            examples: the replicas send `num_examples x gradient` and
            `num_examples`, and the sums are divided by the total examples
            (each replica's gradient is then that of its own mean loss, as
            one device computes it). Gradients sent in another dtype
            than float32 (float16 weights, compression) are multiplied by
            this replica's share of the total instead, once the total is
            summed, not by the count: `count x gradient` overflows float16
            (a new-user probe's float16 model: NaN weights, where one device
            trained).
        extras: List of float32 tensors (any shapes) to sum over the replicas
            along with the gradients, e.g. metric state.

    Returns:
        `(summed_gradients, summed_extras)`: the gradients in the same order
        and dtypes (`None` kept; a `tf.IndexedSlices` with the rows one
        device would have), and one tensor per `extras` entry.

    Raises:
        tf.errors.InvalidArgumentError: At run time, with `names`, when the
            replicas disagree on the gradient structure. Nothing summed is
            returned to the caller then.

    Distributed behavior:
        Runs in replica context and is a collective: every replica of every
        worker must call it with the same structure of gradients (the same
        `None` positions). Replicas of one worker run the same trace; workers
        can differ only when Python code branches on the worker, which
        `names` turns into an error instead of a wrong sum.

        When every dense value sent is float32 (no compression), the example
        count, `extras` and the structure check travel in the gradients' own
        collective: one all-reduce per step. Disagreeing workers then send
        packs of different sizes (TensorFlow fails the collective with "Shape
        mismatch") or of equal sizes, in which case the summed check fails
        before any sum is returned. Otherwise (compressed or non-float32
        gradients) they are summed in one all-reduce first and the gradients
        are sent only after the check passed. With sparse gradients, each
        replica's row counts (`num_replicas_in_sync` floats per sparse
        gradient) travel with the side values too.
    """
    context = tf.distribute.get_replica_context()
    extras = [tf.identity(tf.convert_to_tensor(e, tf.float32)) for e in extras]  # On this replica's device.
    if context is None:
        return list(gradients), extras
    options = options.resolved(context.strategy)
    gradients = densified(gradients, options)
    present = [i for i, g in enumerate(gradients) if g is not None]
    to_send = [gradients[i] for i in present]
    side = list(extras)
    to_send = compress(to_send, options)
    together = all(v.dtype == tf.float32 for v in to_send if not isinstance(v, tf.IndexedSlices))
    if num_examples is not None:
        count = tf.cast(num_examples, tf.float32)
        if together:  # Else scaled by the share once the total is known: `count x gradient` overflows float16.
            to_send = [_scaled(g, count) for g in to_send]
        side.append(tf.reshape(count, [1]))
    if names is not None:
        side.append(gradient_kinds(gradients))
    num_sparse = sum(isinstance(g, tf.IndexedSlices) for g in to_send) if context.num_replicas_in_sync > 1 else 0
    if num_sparse:  # Appended last, taken first.
        side.append(sparse_row_counts(to_send, context.replica_id_in_sync_group, context.num_replicas_in_sync))
    # With `bytes_per_pack` > 0 the dense values travel in windows of that many bytes, the last layers'
    # gradients first and the side values (counts, flags, metric state) in the last window (`_windows`).
    reduced, side_sums = [], []
    if together and (to_send or side):
        side_sums, reduced = _sum(context, to_send, options, side)
    elif not together and side:
        side_sums = context.all_reduce(tf.distribute.ReduceOp.SUM, side, options=options.to_tensorflow())
    if num_sparse:
        row_counts = iter(tf.unstack(tf.reshape(side_sums.pop(), [context.num_replicas_in_sync, num_sparse]), axis=1))
    checks = []
    if names is not None:
        checks = [assert_same_gradient_kinds(side_sums.pop(), context.num_replicas_in_sync, names)]
    if num_examples is not None:
        total = side_sums.pop()[0]
        factor = tf.math.divide_no_nan(1.0, total)
    if not together and to_send:
        with tf.control_dependencies(checks):  # Nothing is sent before the workers agree.
            to_send = [_after_checks(v) for v in to_send]
            if num_examples is not None:  # This replica's share (at most 1), multiplied in float32.
                to_send = [_scaled(v, count * factor) for v in to_send]
        _, reduced = _sum(context, to_send, options)
    result = list(gradients)
    with tf.control_dependencies(checks):  # Nothing summed is used unless the workers agree.
        for i, value in zip(present, reduced):
            value = decompress(value, gradients[i].dtype)
            if num_sparse and isinstance(value, tf.IndexedSlices):  # Every replica holds every replica's rows.
                value = combine_gathered_rows(value, next(row_counts))
            result[i] = _after_checks(value)
            if num_examples is not None and together:
                result[i] = _scaled(result[i], factor)
        side_sums = [tf.identity(s) for s in side_sums]
    return result, side_sums


def _sum(context, values, options, side=()):
    """`(summed side, summed values)`: in windows (`_windows`) when `options.bytes_per_pack` > 0, else in one call.

    Sparse values are all-gathered as rows by TensorFlow in a call of their own, after the windows,
    with the dense values whose size is known only when the step runs (in one pack).
    """
    side, values = list(side), list(values)
    if not options.bytes_per_pack:
        # TensorFlow's collective all-reduce reverses the dense values before packing them and launches the
        # packs in that order (TF 2.18-2.21 checked): handed the side values first and the gradients in
        # variable order, the last layers' gradients go first and the side values last.
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, side + values, options=options.to_tensorflow())
        return list(summed[: len(side)]), list(summed[len(side) :])
    windowed = [
        i for i, v in enumerate(values) if not isinstance(v, tf.IndexedSlices) and _windows.has_static_sizes([v])
    ]
    rest = sorted(set(range(len(values))) - set(windowed))  # rows, and sizes known only when the step runs
    side_sums, windowed_sums = _windows.all_reduce_in_windows(context, [values[i] for i in windowed], options, side)
    result = [None] * len(values)
    for i, value in zip(windowed, windowed_sums):
        result[i] = value
    if rest:
        one_pack = dataclasses.replace(options, bytes_per_pack=0).to_tensorflow()
        for i, value in zip(
            rest, context.all_reduce(tf.distribute.ReduceOp.SUM, [values[i] for i in rest], options=one_pack)
        ):
            result[i] = value
    return side_sums, result


def densified(gradients, options):
    """`gradients` with each `tf.IndexedSlices` made dense when `options.sparse_gradients == "dense"` (else as given).

    Args:
        gradients: List of tensors, `tf.IndexedSlices` or `None`.
        options: A `keras_dist.CommunicationOptions`.

    Returns:
        A list of the same length; a densified entry has its variable's
        shape and its values' dtype, repeated indices summed.
    """
    if options.sparse_gradients != "dense":
        return list(gradients)
    return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in gradients]


def _scaled(gradient, factor):
    """`gradient` (a tensor or `tf.IndexedSlices`) times the float32 scalar `factor`, rounded once to its dtype."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(_times(gradient.values, factor), gradient.indices, gradient.dense_shape)
    return _times(gradient, factor)


def _times(value, factor):
    if value.dtype.size >= 4:  # float32, float64
        return value * tf.cast(factor, value.dtype)
    return tf.cast(tf.cast(value, tf.float32) * factor, value.dtype)  # A share like 13/29 is not a float16.


def _after_checks(value):
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(value.values), value.indices, value.dense_shape)
    return tf.identity(value)


def cross_replica_sum(strategy, per_replica_values, options):
    """Sums per-replica values over all replicas, from cross-replica context (`merge_call`).

    Args:
        strategy: The `tf.distribute.Strategy`.
        per_replica_values: List of `PerReplica` tensors (already compressed
            by `compress` when `options` asks for compression).
        options: A `keras_dist.CommunicationOptions` (packing and timeout are used).

    Returns:
        List of mirrored sums, one per value.
    """
    pairs = [(value, value) for value in per_replica_values]
    if not pairs:
        return []
    return strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, pairs, options=options.to_tensorflow())


def compress(gradients, options):
    """Casts floating dense gradients to `options`' compressed dtype (others unchanged)."""
    return [_compress(g, options.compressed_dtype) for g in gradients]


def decompress(value, dtype):
    """Casts a summed value back to its gradient's `dtype`."""
    if isinstance(value, tf.IndexedSlices) or value.dtype == dtype:
        return value
    return tf.cast(value, dtype)


def _compress(gradient, dtype):
    if dtype is None or isinstance(gradient, tf.IndexedSlices) or not gradient.dtype.is_floating:
        return gradient
    return tf.cast(gradient, dtype)
