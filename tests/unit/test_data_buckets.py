"""bucket_by_length: every example once, a few padded lengths, less padding, trains under a strategy."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from keras_dist.callbacks import RetracingMonitor
from keras_dist.data import bucket_by_length

RS = np.random.RandomState(0)
SEQUENCES = [RS.randint(1, 50, RS.randint(3, 60)).astype("int32") for _ in range(256)]
LABELS = np.arange(256, dtype="float32")


def _examples():
    return tf.data.Dataset.from_generator(
        lambda: zip(SEQUENCES, LABELS),
        output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.float32)),
    )


def _padding_fraction(dataset):
    padded = total = 0
    for x, _ in dataset:
        padded += int(tf.reduce_sum(tf.cast(tf.equal(x, 0), tf.int32)))
        total += int(tf.size(x))
    return padded / total


def test_every_example_once_in_bucket_lengths_with_less_padding():
    bucketed = bucket_by_length(_examples(), boundaries=[16, 32, 48, 64], global_batch_size=32)
    labels = sorted(float(v) for _, y in bucketed for v in y.numpy())
    assert labels == list(LABELS)
    assert {int(x.shape[1]) for x, _ in bucketed} <= {15, 31, 47, 63}  # Each bucket's longest length (boundary - 1).
    bucketed_padding = _padding_fraction(bucketed)
    naive_padding = _padding_fraction(_examples().padded_batch(32))
    assert bucketed_padding < 0.5 * naive_padding, (bucketed_padding, naive_padding)


def test_bucketed_batches_train_under_a_strategy_with_masks(mirrored_1x2_cpu):
    inputs = keras.Input((None,), dtype="int32")
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 4, mask_zero=True)(inputs))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(hidden), strategy=mirrored_1x2_cpu)
    model.compile(optimizer="adam", loss="mse")
    dataset = bucket_by_length(_examples(), boundaries=[16, 32, 48, 64], global_batch_size=32)
    history = model.fit(dataset, epochs=2, verbose=0, callbacks=[RetracingMonitor()])
    assert np.isfinite(history.history["loss"]).all()
    assert history.history["train_traces"][1] == 0  # No retrace in the second epoch.


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"boundaries": [], "global_batch_size": 8}, "non-empty list of increasing"),
        ({"boundaries": [32, 16], "global_batch_size": 8}, "increasing integers"),
        ({"boundaries": [16], "global_batch_size": 0}, "global_batch_size` must be an integer > 0"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bucket_by_length(_examples(), **kwargs)


def test_an_already_batched_dataset_is_refused():
    with pytest.raises(ValueError, match="call it before `batch`"):
        bucket_by_length(_examples().padded_batch(4), boundaries=[16], global_batch_size=8)
