"""Preparing the inputs a user passes to `fit`/`evaluate`/`predict`, before Keras adapts them.

Three things happen here, each a no-op for inputs that do not need it:
a `DatasetCreator` becomes a per-worker distributed dataset; a
`tf.data.Dataset` of single examples is batched to the global batch size;
a Python generator's batches are copied as they are yielded (compat fix
`generator_batch_copies`).
"""

import types

import keras
import numpy as np
import tensorflow as tf

from keras_dist import _compat
from keras_dist.data import _creator


def prepare(x, *, strategy, model, batch_size, batch_size_argument="batch_size"):
    """Returns `x` in a form Keras distributes correctly under `strategy`.

    Args:
        x: Anything `keras.Model.fit` accepts as `x` or `validation_data`, or a
            `keras_dist.data.DatasetCreator`.
        strategy: The model's `tf.distribute.Strategy`.
        model: The `keras.Model` (its input shapes tell batched from unbatched).
        batch_size: Integer global batch size the user passed, or `None`.
        batch_size_argument: String, the name of the `fit` argument that sets
            `batch_size` for this input (for the error message).

    Raises:
        ValueError: `x` is a dataset of single examples and no `batch_size` says
            how to batch them.
    """
    if isinstance(x, _creator.DatasetCreator):
        return strategy.distribute_datasets_from_function(x, options=x.input_options)
    if isinstance(x, tf.data.Dataset):
        return _batch_if_unbatched(x, model, batch_size, strategy.num_replicas_in_sync, batch_size_argument)
    if isinstance(x, types.GeneratorType) and _compat.is_active("generator_batch_copies"):
        return copy_batches(x)
    return x


def copy_batches(generator):
    """Yields the batches of `generator` with every NumPy array copied.

    Keras keeps the first batches it peeks at to learn the input's shapes, and
    TensorFlow may keep using an array's memory after it was yielded; a
    generator that refills one buffer (yielding views of it) would otherwise
    have batches overwritten: some examples lost, others seen twice.
    """
    for batch in generator:
        yield keras.tree.map_structure(lambda v: np.array(v, copy=True) if isinstance(v, np.ndarray) else v, batch)


def _batch_if_unbatched(dataset, model, batch_size, num_replicas, batch_size_argument):
    expected = _input_ranks(model)
    if expected is None:
        return dataset
    element = tf.nest.flatten(dataset.element_spec)[: len(expected)]
    ranks = [spec.shape.rank for spec in element if isinstance(spec, tf.TensorSpec)]
    if len(ranks) != len(expected) or any(r is None or r != e - 1 for r, e in zip(ranks, expected)):
        return dataset
    if not batch_size:
        shapes = [tuple(spec.shape) for spec in element]
        raise ValueError(
            "The dataset yields single examples, not batches: element shapes "
            f"{shapes}, model input ranks {expected} (batch first). Fix: batch it with "
            "`dataset.batch(global_batch_size)` (under "
            f"{num_replicas} replicas each gets global_batch_size / {num_replicas}), or pass "
            f"`{batch_size_argument}=` to say the global batch size."
        )
    return dataset.batch(batch_size)


def _input_ranks(model):
    inputs = getattr(model, "inputs", None)
    if not inputs or not getattr(model, "_is_graph_network", True):
        return None
    try:
        return [len(i.shape) for i in inputs]
    except (TypeError, AttributeError):
        return None
