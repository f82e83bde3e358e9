"""The global batches `verify` trains on: taken once from the user's data, the same on every worker.

Each batch is a tuple `(x,)`, `(x, y)` or `(x, y, sample_weight)` as `fit`
unpacks it; both runs train on `dataset(batches)`, which yields them in order.
"""

import hashlib

import keras
import numpy as np
import tensorflow as tf

from keras_dist.data import _creator
from keras_dist.data import _inputs as data_inputs
from keras_dist.strategy import _plan

_KERAS_DEFAULT_BATCH_SIZE = 32


def global_batches(model, x, y, sample_weight, batch_size, steps):
    """Returns the first `steps` global batches of the input (fewer when it has fewer).

    Raises:
        TypeError: `x` is a `DatasetCreator`.
        ValueError: No data, no batch in it, `y`/`sample_weight` with a dataset, or a bad `batch_size`.
    """
    if x is None:
        raise ValueError("`verify` needs data to train on. Received: x=None. Fix: pass x (and y) as for `fit`.")
    if isinstance(x, _creator.DatasetCreator):
        raise TypeError(
            "`verify` needs the global batches themselves, the same on every worker; a `DatasetCreator` "
            "builds a different input per worker. Received: a DatasetCreator. Fix: pass the dataset (or "
            "arrays) that holds the global batches."
        )
    dataset_like = isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)) or hasattr(x, "__next__")
    if dataset_like and (y is not None or sample_weight is not None):
        raise ValueError(
            "`y` and `sample_weight` go with array inputs; a dataset, PyDataset or generator yields them "
            f"in its batches. Received: x of type {type(x).__name__} and y or sample_weight. Fix: drop them."
        )
    if isinstance(x, tf.data.Dataset):
        dataset = data_inputs.prepare(x, strategy=model._distribute_strategy, model=model, batch_size=batch_size)
        batches = [_as_tuples(b) for b in dataset.take(steps)]
    elif isinstance(x, keras.utils.PyDataset):
        count = x.num_batches
        batches = [_as_tuples(x[i]) for i in range(steps if count is None else min(steps, count))]
    elif hasattr(x, "__next__"):
        batches = []
        for batch in x:
            batches.append(_as_tuples(batch))
            if len(batches) == steps:
                break
    else:
        batches = _array_batches(x, y, sample_weight, batch_size or _KERAS_DEFAULT_BATCH_SIZE, steps)
    batches = [b if isinstance(b, tuple) else (b,) for b in batches]
    if not batches or not batch_length(batches[0]):
        raise ValueError(
            f"`verify` found no batch to train on in x (a {type(x).__name__}). Fix: pass data with at least one example."
        )
    return batches


def _array_batches(x, y, sample_weight, batch_size, steps):
    if sample_weight is not None and y is None:
        raise ValueError("`sample_weight` needs `y`. Received: y=None with sample_weight. Fix: pass y too.")
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"`batch_size` must be an integer >= 1. Received: batch_size={batch_size!r}.")
    parts = tuple(_as_tuples(p) for p in (x, y, sample_weight) if p is not None)
    leaves = keras.tree.flatten(parts)
    num_examples = len(leaves[0]) if leaves else 0
    return [
        keras.tree.map_structure(lambda a, s=start: np.asarray(a)[s : s + batch_size], parts)
        for start in range(0, min(num_examples, steps * batch_size), batch_size)
    ]


def _as_tuples(value):
    """Lists become tuples (tf.data would stack a list of arrays into one tensor), recursively."""
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return tuple(_as_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _as_tuples(v) for k, v in value.items()}
    return value


def batch_length(batch):
    """Integer, the examples in `batch` (the first dimension of its first part; 0 if unknown)."""
    leaves = tf.nest.flatten(batch, expand_composites=False)
    shape = getattr(leaves[0], "shape", None) if leaves else None
    return int(shape[0]) if shape is not None and len(shape) and shape[0] is not None else 0


def dataset(batches):
    """A `tf.data.Dataset` yielding `batches` in order (each element one global batch)."""
    result = None
    for batch in batches:
        part = tf.data.Dataset.from_tensors(batch)
        result = part if result is None else result.concatenate(part)
    return result


def fingerprint(batches):
    """Four integers below 2**18 from a SHA-256 of every batch (values, shapes, dtypes): exact sums in float32."""
    digest = hashlib.sha256()
    for batch in batches:
        for leaf in tf.nest.flatten(batch, expand_composites=True):
            array = np.asarray(leaf)
            digest.update(f"{array.dtype}{array.shape}".encode())
            digest.update(np.ascontiguousarray(array).tobytes())
    raw = digest.digest()
    return [float(int.from_bytes(raw[i : i + 3], "big") >> 6) for i in range(0, 12, 3)]


def check_same_batches(agreement, batches):
    """Several workers: raises `ValueError` on every worker unless every worker took the same batches.

    Distributed behavior:
        Collective (two all-reduces of a few floats) under several workers; nothing otherwise.
    """
    if not agreement.multi_worker:
        return
    own = fingerprint(batches)
    num_workers = _plan.cluster_info_of(agreement.strategy).num_workers
    summed = agreement.summed(own)
    if agreement.any(any(s != num_workers * v for s, v in zip(summed, own))):
        raise ValueError(
            "`verify` needs the same global batches on every worker (each computes the one-device "
            "reference from them). Received: different batches on some workers. Fix: pass every worker the "
            "same full data, unsharded, in the same order (a dataset shuffled with the same seed, or arrays)."
        )
