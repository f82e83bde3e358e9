"""`DatasetCreator`: an input function called once per worker, for pipelines that shard themselves."""

from collections.abc import Callable

import tensorflow as tf


class DatasetCreator:
    """An input function that builds each worker's own `tf.data.Dataset`.

    Pass it to `fit`, `evaluate` or `predict` (also as `validation_data`)
    where a dataset would go, like tf.keras'
    `tf.keras.utils.experimental.DatasetCreator`. keras-dist calls
    `strategy.distribute_datasets_from_function(dataset_fn)`: `dataset_fn`
    runs once per worker with a `tf.distribute.InputContext` and must shard
    and batch the data itself, batching to
    `input_context.get_per_replica_batch_size(global_batch_size)`. Use it to
    read only this worker's files (e.g. `tfds.ReadConfig(input_context=...)`)
    instead of letting every worker read everything (DATA sharding).

    Args:
        dataset_fn: Callable taking a `tf.distribute.InputContext` and returning
            a `tf.data.Dataset` of per-replica batches.
        input_options: Optional `tf.distribute.InputOptions`.

    Raises:
        TypeError: `dataset_fn` is not callable, or (when called) returns
            something other than a `tf.data.Dataset`.

    Distributed behavior:
        No auto-sharding is applied: every example the function yields on
        every worker is used. `evaluate` and `predict` require the functions
        of all workers together to yield each example once; `predict` returns
        rows in the order tf.distribute gathers them.

    Example:
    >>> import tensorflow as tf
    >>> from keras_dist.data import DatasetCreator
    >>> def dataset_fn(input_context):
    ...     batch = input_context.get_per_replica_batch_size(8)
    ...     ds = tf.data.Dataset.range(64).map(lambda i: (tf.cast(i, "float32")[None], 0.0))
    ...     ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    ...     return ds.batch(batch)
    >>> creator = DatasetCreator(dataset_fn)

    References:
        TF guide "Distributed input", section
        "tf.distribute.Strategy.distribute_datasets_from_function".
    """

    def __init__(
        self,
        dataset_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset],
        input_options: tf.distribute.InputOptions | None = None,
    ) -> None:
        if not callable(dataset_fn):
            raise TypeError(
                "`dataset_fn` must be a callable taking a tf.distribute.InputContext and "
                f"returning a tf.data.Dataset. Received: {type(dataset_fn).__name__}."
            )
        self.dataset_fn = dataset_fn
        self.input_options = input_options

    def __call__(self, input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        dataset = self.dataset_fn(input_context)
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                "A DatasetCreator's `dataset_fn` must return a tf.data.Dataset. Received: "
                f"{type(dataset).__name__}. Fix: return the batched dataset from the function."
            )
        return dataset
