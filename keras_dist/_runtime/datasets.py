"""What a `tf.data.Dataset` reads, and how TensorFlow splits its batches over replicas.

Private: walks the Python objects of a tf.data pipeline (`_inputs()`,
`_map_func`, `_filenames`), which TensorFlow does not document, and mirrors
`tf.distribute`'s batch-splitting rule. `keras_dist.data` asks these questions
to choose an auto-shard policy and to print the input plan.
"""

import tensorflow as tf

# Dataset ops that read files; TensorFlow's FILE auto-sharding looks for the same ones
# (tensorflow/core/grappler/optimizers/data/auto_shard.cc, kReaderDatasetOps).
READER_OPS = frozenset(
    {
        "TFRecordDataset",
        "TFRecordDatasetV2",
        "FixedLengthRecordDataset",
        "FixedLengthRecordDatasetV2",
        "TextLineDataset",
        "ArrayRecordDataset",
        "SSTableDataset",
        "RecordIODataset",
    }
)
_READER_CLASSES = frozenset({"TFRecordDatasetV2", "TextLineDatasetV2", "FixedLengthRecordDatasetV2"})
_MAX_FILES_COUNTED = 1_000_000


def _inputs(dataset):
    try:
        return list(dataset._inputs())
    except (AttributeError, NotImplementedError):
        return []


def _function_ops(wrapper):
    """Returns the names of the ops in a traced tf.data function and in the functions it calls."""
    graph_def = wrapper.function.graph.as_graph_def()
    ops = {node.op for node in graph_def.node}
    for function in graph_def.library.function:
        ops.update(node.op for node in function.node_def)
    return ops


def _function_reads_files(wrapper):
    """Returns whether a traced tf.data function (or one it calls) creates a reader dataset."""
    return not _function_ops(wrapper).isdisjoint(READER_OPS)


# Ops that run Python and return what it returned: `Dataset.from_generator` and
# `tf.numpy_function` (PyFunc, PyFuncStateless), `tf.py_function` (EagerPyFunc).
PYTHON_FUNCTION_OPS = frozenset({"PyFunc", "PyFuncStateless", "EagerPyFunc"})


def calls_python(dataset):
    """Returns whether any step of `dataset` runs Python (`from_generator`, `py_function`, `numpy_function`).

    Keras builds such a dataset for a `keras.utils.PyDataset` and for a Python
    generator. Walks the pipeline's Python objects and the graphs of its
    traced functions (and of the functions they call).

    Args:
        dataset: A `tf.data.Dataset`.

    Returns:
        Boolean.
    """
    pending, seen = [dataset], set()
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for value in vars(node).values():
            graph = getattr(getattr(value, "function", None), "graph", None)
            if graph is not None and not _function_ops(value).isdisjoint(PYTHON_FUNCTION_OPS):
                return True
        pending.extend(_inputs(node))
    return False


def with_own_buffers(dataset):
    """Returns `dataset` with every tensor of every element copied into memory TensorFlow allocates.

    A tensor a Python function returned (a NumPy batch of a `PyDataset`, a
    generator, `py_function`) may share the NumPy array's memory; after a
    strategy splits the batch over replicas, the step's ops may write into
    that memory (compat fix `python_batches_written_in_place`). After the copy
    they write into the copy. Costs one copy of each batch, made on tf.data's
    threads; elements, their order and the cardinality are unchanged.

    Args:
        dataset: A `tf.data.Dataset` (any element structure, composite tensors included).

    Returns:
        A `tf.data.Dataset` with the same element spec.
    """

    def copy(tensor):
        if tensor.dtype in (tf.variant, tf.resource):  # Handles, not data: nothing to copy.
            return tensor
        return tf.raw_ops.DeepCopy(x=tensor)

    unpacked = type(dataset.element_spec) is tuple  # tf.data passes a tuple's items as arguments.

    @tf.autograph.experimental.do_not_convert
    def copy_element(*element):
        return tf.nest.map_structure(copy, element if unpacked else element[0], expand_composites=True)

    return dataset.map(copy_element, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def filenames_dataset(dataset):
    """Returns the dataset of file names `dataset` reads, or `None` when it reads no files.

    Recognizes readers made directly (`tf.data.TFRecordDataset(files)`) and
    inside `interleave`/`flat_map` over a dataset of file names (the
    `list_files(...).interleave(tf.data.TFRecordDataset)` idiom, and TFDS).

    Args:
        dataset: A `tf.data.Dataset`.

    Returns:
        A `tf.data.Dataset` of scalar strings, or `None`.
    """
    pending = [dataset]
    while pending:
        node = pending.pop()
        if type(node).__name__ in _READER_CLASSES and hasattr(node, "_filenames"):
            return node._filenames
        map_func = getattr(node, "_map_func", None)
        source = getattr(node, "_input_dataset", None)
        if map_func is not None and source is not None and _function_reads_files(map_func):
            return source
        pending.extend(_inputs(node))
    return None


# Transformations after the file readers under which FILE sharding keeps "each example once":
# each applies per element or per batch, never to a position in the whole stream.
# `repeat()` is not one: each worker would cycle through its own files, so a worker with
# fewer examples repeats them more often within an epoch of `steps_per_epoch` steps.
_PER_ELEMENT = (
    "Map",
    "Filter",
    "Batch",
    "Prefetch",
    "Options",
    "Shuffle",
    "Cache",
    "Unbatch",
    "Restructured",
    "Ragged",
    "AssertCardinality",
    "Ignore",
    "MaxIntraOpParallelism",
    "PrivateThreadPool",
    "Apply",
    "Interleave",
    "FlatMap",
    "ParallelInterleave",
    "Parse",
)


def position_dependent_step(dataset):
    """Returns the name of a transformation after the file readers that depends on stream position.

    `take(n)`, `skip(n)`, `repeat()`, `enumerate()`, `zip`, `window` and the
    like apply to the whole stream on one device, but to each worker's own
    files under FILE sharding: `take(3)` then keeps 3 examples per worker, and
    `repeat()` cycles each worker through its own files at its own pace.

    Returns:
        String class name (e.g. `"_TakeDataset"`), or `None` when every step is per element.
    """
    pending = [dataset]
    while pending:
        node = pending.pop()
        name = type(node).__name__
        if name in _READER_CLASSES or _reads_files_here(node):
            continue
        if not any(kind in name for kind in _PER_ELEMENT):
            return name
        pending.extend(_inputs(node))
    return None


def _reads_files_here(node):
    map_func = getattr(node, "_map_func", None)
    return (
        map_func is not None and getattr(node, "_input_dataset", None) is not None and _function_reads_files(map_func)
    )


def has_cache_after_files(dataset):
    """Returns whether a `cache()` (in memory or in a file) sits between the file readers and the output.

    TFDS adds an in-memory one to small datasets (`ReadConfig(try_autocache=True)`).
    Once such a cache is filled (any full pass over the dataset), TensorFlow's
    FILE auto-shard rewrite still shards the file names but the cache serves
    every example to every worker.
    """
    pending = [dataset]
    while pending:
        node = pending.pop()
        if type(node).__name__ in _READER_CLASSES:
            continue
        if "Cache" in type(node).__name__:
            return filenames_dataset(node) is not None
        pending.extend(_inputs(node))
    return False


def count_files(filenames):
    """Returns how many file names the dataset `filenames` holds (`None` if unbounded).

    Raises:
        tf.errors.OpError: Listing the files failed (e.g. a bad glob).
    """
    cardinality = int(filenames.cardinality())
    if cardinality >= 0:
        return cardinality
    if cardinality == tf.data.INFINITE_CARDINALITY:
        return None
    count = filenames.take(_MAX_FILES_COUNTED).reduce(tf.constant(0, tf.int64), lambda n, _: n + 1)
    count = int(count)
    return None if count == _MAX_FILES_COUNTED else count


def static_batch_size(dataset):
    """Returns the leading dimension shared by every component of an element, or `None`."""
    sizes = {
        spec.shape[0] if spec.shape.rank else None
        for spec in tf.nest.flatten(dataset.element_spec)
        if isinstance(spec, tf.TensorSpec)
    }
    return sizes.pop() if len(sizes) == 1 else None


def replica_batch_sizes(global_batch_size, num_replicas):
    """Returns the per-replica split of one global batch, as `tf.distribute` makes it.

    `experimental_distribute_dataset` gives each of the `num_replicas` replicas
    `global_batch_size // num_replicas` examples and one more to the first
    `global_batch_size % num_replicas` of them (`distribute.batch_sizes_for_worker`
    in tensorflow/python/data/experimental/ops/distribute.py).

    Args:
        global_batch_size: Integer, examples per step over all replicas.
        num_replicas: Integer, `num_replicas_in_sync`.

    Returns:
        Tuple of `num_replicas` integers summing to `global_batch_size`.
    """
    base, extra = divmod(global_batch_size, num_replicas)
    return tuple(base + 1 if i < extra else base for i in range(num_replicas))


def batch_size_of(dataset):
    """Returns the batch size `tf.distribute` will split, or `None` when it cannot tell.

    Uses the same search as `experimental_distribute_dataset` (the last `batch`
    in the pipeline, `distribute.compute_batch_size`), so datasets batched
    before a `map` and Keras' own array pipelines are recognized.
    """
    from tensorflow.python.data.experimental.ops import distribute as data_distribute

    try:
        size = int(data_distribute.compute_batch_size(dataset))
    except (tf.errors.OpError, ValueError, TypeError, IndexError):  # unbatched elements
        size = -1
    if size < 0:
        size = static_batch_size(dataset) or _batch_op_size(dataset)
    return size


# Transformations that keep each element (a batch) a batch of the same size.
_BATCH_PRESERVING = (
    "Map",
    "Prefetch",
    "Options",
    "Repeat",
    "Take",
    "Skip",
    "Cache",
    "Shuffle",
    "Filter",
    "AssertCardinality",
    "Ignore",
    "Apply",
    "MaxIntraOpParallelism",
    "PrivateThreadPool",
)


def _batch_op_size(dataset):
    """Returns the constant `batch_size` of the last `batch()` before `dataset`'s output, or `None`."""
    node = dataset
    while node is not None:
        name = type(node).__name__
        if "Batch" in name and "Rebatch" not in name and "Unbatch" not in name:
            size = getattr(node, "_batch_size", None)
            try:
                return int(size) if size is not None and int(size) > 0 else None
            except (TypeError, ValueError):
                return None
        if not any(kind in name for kind in _BATCH_PRESERVING):
            return None
        inputs = _inputs(node)
        node = inputs[0] if len(inputs) == 1 else None
    return None
