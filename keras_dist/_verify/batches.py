"""The global batches `verify` trains on: taken once from the user's data, the same on every worker.

Each batch is what `fit` hands `train_step`: Keras' own data adapter
(`keras_internals.get_data_adapter`, the one `fit` builds) turns the input into
its `tf.data.Dataset`, and its first `steps` elements are kept as they are
(a bare `x` for arrays or a dataset of tensors, `(x,)` for a dataset of
1-tuples or a `PyDataset` of arrays, `(x, y)`, `(x, y, sample_weight)`, dicts);
both runs train on `dataset(batches)`, which yields them in order.
"""

import hashlib
import itertools

import keras
import numpy as np
import tensorflow as tf

from keras_dist._runtime import keras_internals as ki
from keras_dist.data import _creator
from keras_dist.data import _inputs as data_inputs
from keras_dist.strategy import _plan


def global_batches(model, x, y, sample_weight, batch_size, steps):
    """Returns the first `steps` global batches of the input (fewer when it has fewer), as `fit` yields them.

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
    kind = type(x).__name__
    if isinstance(x, tf.data.Dataset):
        x = data_inputs.prepare(x, strategy=model._distribute_strategy, model=model, batch_size=batch_size)
    elif isinstance(x, keras.utils.PyDataset):  # Its first batches only: no workers, no epoch hooks.
        count = x.num_batches
        x = _FirstBatches([x[i] for i in range(steps if count is None else min(steps, count))])
    elif hasattr(x, "__next__"):  # Consumed: `steps` batches taken, the rest left.
        x = (batch for batch in list(itertools.islice(x, steps)))
    else:
        if sample_weight is not None and y is None:
            raise ValueError("`sample_weight` needs `y`. Received: y=None with sample_weight. Fix: pass y too.")
        batch_size = data_inputs.KERAS_ARRAY_BATCH_SIZE if batch_size is None else batch_size
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise ValueError(f"`batch_size` must be an integer >= 1. Received: batch_size={batch_size!r}.")
    batches = _first_elements(x, y, sample_weight, batch_size, steps)
    if not batches or not batch_length(batches[0]):
        raise ValueError(
            f"`verify` found no batch to train on in x (a {kind}). Fix: pass data with at least one example."
        )
    return batches


def _first_elements(x, y, sample_weight, batch_size, steps):
    """The first `steps` elements of the `tf.data.Dataset` Keras' `fit` builds from the input (unshuffled)."""
    try:
        dataset = ki.get_data_adapter(x, y, sample_weight=sample_weight, batch_size=batch_size).get_tf_dataset()
    except ValueError as error:  # An empty generator or PyDataset: said below, as for the other inputs.
        if "empty generator" in str(error) or "length 0" in str(error):
            return []
        raise
    return list(dataset.take(steps))


class _FirstBatches(keras.utils.PyDataset):
    """The first batches of a user's `PyDataset`, as it returned them (Keras' adapter standardizes them as in `fit`)."""

    def __init__(self, batches):
        super().__init__()
        self._batches = batches

    def __len__(self):
        return len(self._batches)

    def __getitem__(self, index):
        return self._batches[index]


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
