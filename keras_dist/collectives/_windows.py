"""Gradient buckets: fixed-size windows over the gradients, last layers first, the side values in the last one.

PyTorch DDP lays its gradients out in one flat buffer, in reverse layer order,
and all-reduces it in buckets of `bucket_cap_mb` as the backward pass fills
them. keras-dist does the same with TensorFlow's collectives: the dense values
are read as one stream (the last variable's gradient first, each flattened),
the stream is cut into windows of exactly `bytes_per_pack` bytes, and each
window is summed by one `ReplicaContext.all_reduce` call, in stream order. So

- a gradient larger than a window travels in window-sized parts (one 64 MB
  gradient as 8 collectives of 8 MiB, which TensorFlow's gRPC ring summed
  1.2x-1.8x faster than one 64 MB collective between 2 CPU workers in three
  runs, `benchmarks/all_reduce.py`), where TensorFlow's own packing
  (`cross_device_utils.group_by_size`) keeps every tensor whole;
- the side values (example counts, structure flags, metric sums) are appended
  to the last window, where TensorFlow's packing gives them a collective of
  their own whenever the gradients fill the packs before them;
- the first window holds the last layers' gradients and depends on nothing
  else, so its collective can start before the backward pass ends (whether
  it does is TensorFlow's executor's choice: `docs/performance.md`, "Overlap,
  traced").

Sums are elementwise, so which values travel together never changes a sum:
the summed values equal one `all_reduce` of the whole list, bit for bit
(`tests/unit/test_gradient_buckets.py`).

Owns the plan (`plan_windows`, pure Python on static sizes) and its execution
(`all_reduce_in_windows`). Must not: pick the window size (`CommunicationOptions`
does) or touch sparse values (`tf.IndexedSlices` are all-gathered as rows by
TensorFlow, outside the windows).
"""

import tensorflow as tf


def plan_windows(sizes, dtypes, bytes_per_pack, side_sizes=()):
    """Cuts the stream of `sizes` (last value first) into windows of `bytes_per_pack` bytes.

    Args:
        sizes: List of Python ints >= 0, the number of elements of each
            value, in variable order.
        dtypes: List of `tf.DType`, one per value. A window never mixes
            dtypes: a change of dtype in the stream closes the window.
        bytes_per_pack: Python int >= 1, the window size in bytes.
        side_sizes: List of Python ints >= 0, the number of float32 elements
            of each side value. They are appended whole to the last window
            when it is float32 (else they get one window of their own), even
            when that makes it larger than `bytes_per_pack`.

    Returns:
        A list of windows in the order they are sent. Each window is a list
        of pieces `(kind, index, start, stop)`: elements `[start, stop)` of
        the flattened value `index` (`kind` "value") or side value `index`
        (`kind` "side"). Every element of every value and side value is in
        exactly one piece; a value's pieces come in increasing `start`; a
        value without elements has no piece.

    Raises:
        ValueError: `bytes_per_pack` < 1, or `sizes` and `dtypes` differ in
            length.

    Example:
    >>> plan_windows([3, 5], [tf.float32] * 2, 16, side_sizes=[1])
    [[('value', 1, 0, 4)], [('value', 1, 4, 5), ('value', 0, 0, 3), ('side', 0, 0, 1)]]
    """
    if isinstance(bytes_per_pack, bool) or not isinstance(bytes_per_pack, int) or bytes_per_pack < 1:
        raise ValueError(f"`bytes_per_pack` must be an integer >= 1 here. Received: {bytes_per_pack!r}.")
    if len(sizes) != len(dtypes):
        raise ValueError(f"`sizes` and `dtypes` must have the same length. Received: {len(sizes)} and {len(dtypes)}.")
    windows, window, used, dtype = [], [], 0, None
    for index in reversed(range(len(sizes))):
        if not sizes[index]:  # no elements, no piece: neither closes a window nor sets its dtype
            continue
        item = tf.as_dtype(dtypes[index]).size
        if window and dtypes[index] != dtype:
            windows.append(window)
            window, used = [], 0
        dtype = dtypes[index]
        start = 0
        while start < sizes[index]:
            room = max(1, (bytes_per_pack - used) // item)  # elements left in this window (at least one)
            stop = min(sizes[index], start + room)
            window.append(("value", index, start, stop))
            used += (stop - start) * item
            start = stop
            if used + item > bytes_per_pack:  # full: not one more element fits
                windows.append(window)
                window, used = [], 0
    side = [("side", i, 0, n) for i, n in enumerate(side_sizes)]
    if side:
        if window and dtype == tf.float32:
            window.extend(side)
        elif not window and windows and dtype == tf.float32:
            windows[-1].extend(side)
        else:
            if window:
                windows.append(window)
            window = side
    if window:
        windows.append(window)
    return windows


def all_reduce_in_windows(context, values, options, side=()):
    """Sums dense `values` and float32 `side` values over all replicas, one collective per window.

    Args:
        context: The `tf.distribute.ReplicaContext` of the step.
        values: List of dense tensors (any dtypes with a static number of
            elements), in variable order.
        options: A resolved `keras_dist.CommunicationOptions` whose
            `bytes_per_pack` is >= 1 (the window size in bytes).
        side: List of float32 tensors with a static number of elements.

    Returns:
        `(summed_side, summed_values)`: lists of tensors with the shapes and
        dtypes given, each the sum over the replicas.

    Raises:
        ValueError: A value or side value has no static number of elements
            (call `has_static_sizes` first).

    Distributed behavior:
        A collective: every replica must call it with the same sizes and
        dtypes. The windows are launched in order (TensorFlow orders the
        collectives of one step).
    """
    values, side = list(values), list(side)
    sizes = [_num_elements(v) for v in values]
    side_sizes = [_num_elements(s) for s in side]
    windows = plan_windows(sizes, [v.dtype for v in values], options.bytes_per_pack, side_sizes)
    flat = {"value": [tf.reshape(v, [-1]) for v in values], "side": [tf.reshape(s, [-1]) for s in side]}
    whole = {"value": sizes, "side": side_sizes}
    tf_options = options.to_tensorflow()
    pieces = {"value": [[] for _ in values], "side": [[] for _ in side]}
    for window in windows:
        parts = [_piece(flat[kind][i], start, stop, whole[kind][i]) for kind, i, start, stop in window]
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, _concat(parts), options=tf_options)
        outputs = [summed] if len(window) == 1 else tf.split(summed, [stop - start for _, _, start, stop in window])
        for (kind, i, _, _), output in zip(window, outputs):
            pieces[kind][i].append(output)

    def assemble(kind, originals):  # a value without elements travels in no window: it is its own sum
        return [tf.reshape(_concat(parts), tf.shape(o)) if parts else o for parts, o in zip(pieces[kind], originals)]

    return assemble("side", side), assemble("value", values)


def has_static_sizes(tensors):
    """True when every tensor's number of elements is known at trace time (windows can be planned)."""
    return all(t.shape.num_elements() is not None for t in tensors)


def _num_elements(tensor):
    n = tensor.shape.num_elements()
    if n is None:
        raise ValueError(
            f"Gradient windows need a static number of elements. Received a value of shape {tensor.shape}. "
            "Fix: call `has_static_sizes` first and send such values in one `all_reduce`."
        )
    return n


def _piece(flat, start, stop, size):
    return flat if (start, stop) == (0, size) else flat[start:stop]


def _concat(parts):
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)
