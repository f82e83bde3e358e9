"""One epoch of `fit` on every kind of Keras input, recording which replica saw which example.

Used in-process by tests/unit/test_data_sharding.py (mirrored 1xN) and in
worker processes by tests/integration/sharding_worker.py (2x1, 2x2).
Each example's id is its target `y` (0 .. NUM_EXAMPLES-1); the `SeenIds`
metric counts ids per replica in a sync-on-read variable, so after `fit` its
value is the `(num_replicas_in_sync, NUM_EXAMPLES)` count matrix over all
workers. Uneven on purpose: 37 examples in global batches of 8.
"""

import os

import keras
import numpy as np
import tensorflow as tf

NUM_EXAMPLES = 37
GLOBAL_BATCH_SIZE = 8
INPUT_KINDS = (
    "dataset",
    "dataset_unbatched",
    "numpy",
    "numpy_dict",
    "generator",
    "generator_views",
    "pydataset",
    "tfrecord_1_file",
    "tfrecord_1_file_policy_file",
    "tfrecord_4_files",
    "dataset_creator",
)


class SeenIds(keras.metrics.Metric):
    """Counts, per replica, how often each example id (the target) was trained on."""

    def __init__(self, num_replicas, **kwargs):
        super().__init__(**kwargs)
        self.counts = self.add_variable((num_replicas, NUM_EXAMPLES), "zeros", name="counts", aggregation="sum")

    def update_state(self, y_true, y_pred, sample_weight=None):
        ids = tf.cast(tf.reshape(y_true, [-1]), tf.int32)
        context = tf.distribute.get_replica_context()
        replica = context.replica_id_in_sync_group if context is not None else 0
        indices = tf.stack([tf.fill(tf.shape(ids), replica), ids], axis=1)
        self.counts.assign_add(tf.scatter_nd(indices, tf.ones_like(ids, "float32"), self.counts.shape))

    def result(self):
        return tf.reduce_sum(self.counts)


def ids():
    return np.arange(NUM_EXAMPLES, dtype="float32")[:, None]


def write_tfrecords(directory, num_files, task_id=0):
    """Writes the ids as `num_files` TFRecord files (example i in file i % num_files)."""
    paths = []
    for f in range(num_files):
        path = os.path.join(directory, f"ids-{num_files}-{f}.tfrecord")
        partial = f"{path}.{task_id}.partial"
        with tf.io.TFRecordWriter(partial) as writer:
            for i in range(f, NUM_EXAMPLES, num_files):
                feature = tf.train.Feature(float_list=tf.train.FloatList(value=[float(i)]))
                example = tf.train.Example(features=tf.train.Features(feature={"id": feature}))
                writer.write(example.SerializeToString())
        os.replace(partial, path)
        paths.append(path)
    return paths


def _parse(record):
    value = tf.io.parse_single_example(record, {"id": tf.io.FixedLenFeature([1], tf.float32)})["id"]
    return value, value


def inputs_for(kind, directory, task_id=0):
    """Returns `(args, kwargs)` for `fit` feeding the ids as input `kind`."""
    from keras_dist.data import DatasetCreator, with_auto_shard_policy

    x, b = ids(), GLOBAL_BATCH_SIZE
    if kind == "dataset":
        return (tf.data.Dataset.from_tensor_slices((x, x)).batch(b),), {}
    if kind == "dataset_unbatched":
        return (tf.data.Dataset.from_tensor_slices((x, x)),), {"batch_size": b}
    if kind == "numpy":
        return (x, x), {"batch_size": b}  # shuffled (Keras' default): same permutation on every worker
    if kind == "numpy_dict":
        return ({"ids": x}, x), {"batch_size": b, "shuffle": False}
    if kind in ("generator", "generator_views"):
        buffer = np.zeros((b, 1), "float32")

        def generator():
            for start in range(0, NUM_EXAMPLES, b):
                rows = x[start : start + b]
                if kind == "generator":
                    yield rows, rows
                else:  # One buffer refilled for every batch: each batch is a view of it.
                    buffer[: len(rows)] = rows
                    yield buffer[: len(rows)], buffer[: len(rows)]

        return (generator(),), {}
    if kind == "pydataset":

        class Ids(keras.utils.PyDataset):
            def __len__(self):
                return -(-NUM_EXAMPLES // b)

            def __getitem__(self, i):
                return x[i * b : (i + 1) * b], x[i * b : (i + 1) * b]

        return (Ids(),), {}
    if kind.startswith("tfrecord"):
        num_files = int(kind.split("_")[1])
        files = write_tfrecords(directory, num_files, task_id)
        dataset = tf.data.Dataset.from_tensor_slices(files).interleave(tf.data.TFRecordDataset, cycle_length=1)
        dataset = dataset.map(_parse).batch(b)
        if kind.endswith("policy_file"):
            dataset = with_auto_shard_policy(dataset, "file")
        return (dataset,), {}
    if kind == "dataset_creator":

        def dataset_fn(input_context):
            dataset = tf.data.Dataset.from_tensor_slices((x, x))
            dataset = dataset.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
            return dataset.batch(input_context.get_per_replica_batch_size(b))

        return (DatasetCreator(dataset_fn),), {}
    raise ValueError(kind)


def build(model_class, kind, **kwargs):
    """Returns a compiled model taking the ids (a dict input for `numpy_dict`) and its `SeenIds` metric."""
    inputs = keras.Input((1,), name="ids")
    model = model_class({"ids": inputs} if kind == "numpy_dict" else inputs, keras.layers.Dense(1)(inputs), **kwargs)
    seen = SeenIds(model.distribute_strategy.num_replicas_in_sync, name="seen")
    model.compile(optimizer="sgd", loss="mse", metrics=[seen])
    return model, seen


def seen_counts(model_class, kind, directory, task_id=0, **kwargs):
    """Trains one epoch on input `kind`; returns the `(replicas, NUM_EXAMPLES)` count matrix."""
    model, seen = build(model_class, kind, **kwargs)
    args, fit_kwargs = inputs_for(kind, directory, task_id)
    model.fit(*args, epochs=1, verbose=0, **fit_kwargs)
    return np.asarray(seen.counts.numpy())


def assert_each_example_once(counts, kind):
    total = counts.sum(axis=0)
    wrong = {i: int(c) for i, c in enumerate(total) if c != 1}
    assert not wrong, f"{kind}: example id -> times seen (should be 1): {wrong}"
    assert (counts.sum(axis=1) > 0).all(), f"{kind}: a replica saw no example: {counts.sum(axis=1)}"
