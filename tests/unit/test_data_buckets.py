"""bucket_by_length: every example once, a few padded lengths, less padding, trains under a strategy."""

import re
from pathlib import Path

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


def _sequences(lengths, *extra_specs, extra=lambda n: ()):
    """Examples `(arange(1, n + 1), *extra(n))`, one per length."""
    return tf.data.Dataset.from_generator(
        lambda: ((np.arange(1, n + 1, dtype="int32"), *extra(n)) for n in lengths),
        output_signature=(tf.TensorSpec([None], tf.int32), *extra_specs),
    )


def test_a_sequence_past_the_last_boundary_names_its_length_and_the_fixes(mirrored_1x2_cpu):
    examples = _sequences([5, 40], tf.TensorSpec([], tf.float32), extra=lambda n: (1.0,))
    batches = bucket_by_length(examples, boundaries=[16, 32], global_batch_size=2)
    match = (
        r"shorter than the last boundary\. Received: last boundary=32, sequence length=\] \[40\].*pad_to_boundary=False"
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
        list(batches)
    inputs = keras.Input((None,), dtype="int32")
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 4, mask_zero=True)(inputs))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(hidden), strategy=mirrored_1x2_cpu)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):  # What fit shows (TF 2.21), as documented.
        model.fit(batches, epochs=1, verbose=0)
    unbounded = bucket_by_length(examples, boundaries=[16, 32], global_batch_size=2, pad_to_boundary=False)
    assert sorted(int(x.shape[1]) for x, _ in unbounded) == [5, 40]


def test_string_and_bool_parts_are_kept_and_padded_with_their_own_dtype():
    specs = (tf.TensorSpec([], tf.string), tf.TensorSpec([], tf.bool), tf.TensorSpec([None], tf.string))
    examples = _sequences([2, 3, 20], *specs, extra=lambda n: (f"id{n}", n > 2, ["w"] * n))
    batches = list(
        bucket_by_length(examples, boundaries=[8, 32], global_batch_size=2, length_fn=lambda x, *_: tf.shape(x)[0])
    )
    ids = sorted(i.decode() for _, batch_ids, _, _ in batches for i in batch_ids.numpy())
    assert ids == ["id2", "id20", "id3"]
    short = next(batch for batch in batches if batch[0].shape == (2, 7))
    assert short[1].numpy().tolist() == [b"id2", b"id3"] and short[2].numpy().tolist() == [False, True]
    assert short[3].numpy()[0].tolist() == [b"w", b"w", b"", b"", b"", b"", b""]  # Strings padded with "".
    with pytest.raises(TypeError, match=r"padding_value` must convert.*Received: padding_value='x' for example\[0\]"):
        bucket_by_length(
            examples, boundaries=[8], global_batch_size=2, padding_value="x", length_fn=lambda x, *_: tf.shape(x)[0]
        )


def test_numpy_integers_are_accepted_and_bools_and_floats_refused():
    lengths = np.array([3, 8, 19])
    boundaries = np.percentile(lengths, [50, 100]).astype(int) + 1  # NumPy int64s: [9, 20].
    batches = bucket_by_length(_sequences(lengths), boundaries=boundaries, global_batch_size=np.int64(2))
    assert sorted(tuple(x.shape) for (x,) in batches) == [(1, 19), (2, 8)]
    with pytest.raises(TypeError, match=r"global_batch_size=True of type bool"):
        bucket_by_length(_sequences(lengths), boundaries=[9], global_batch_size=True)
    with pytest.raises(TypeError, match=r"with 8\.0 of type float"):
        bucket_by_length(_sequences(lengths), boundaries=[8.0], global_batch_size=2)


def _dict_examples(**specs):
    return tf.data.Dataset.from_generator(
        lambda: ({"tokens": np.arange(1, n + 1, dtype="int32"), "label": n} for n in (3, 12)),
        output_signature={"tokens": tf.TensorSpec([None], tf.int32), "label": tf.TensorSpec([], tf.int32), **specs},
    )


def test_dict_examples_are_measured_by_their_only_sequence_whatever_the_key_order():
    batches = list(
        bucket_by_length(_dict_examples(), boundaries=[8, 16], global_batch_size=2)
    )  # Sorted: "label" first.
    assert sorted((b["label"].numpy().tolist(), tuple(b["tokens"].shape)) for b in batches) == [
        ([3], (1, 7)),
        ([12], (1, 15)),
    ]


def test_several_or_no_sequences_need_a_length_fn_and_the_message_names_the_parts():
    two_sequences = _dict_examples().map(lambda ex: {**ex, "mask": tf.ones_like(ex["tokens"])})
    with pytest.raises(
        ValueError, match=r"found several\. Received: example\['mask'\], example\['tokens'\].*length_fn=lambda"
    ):
        bucket_by_length(two_sequences, boundaries=[8], global_batch_size=2)
    chosen = bucket_by_length(
        two_sequences, boundaries=[8, 16], global_batch_size=2, length_fn=lambda ex: tf.shape(ex["tokens"])[0]
    )
    assert sorted(tuple(b["mask"].shape) for b in chosen) == [(1, 7), (1, 15)]
    with pytest.raises(
        ValueError,
        match=r"looks already batched.*Received: example\['label'\]: TensorSpec\(shape=\(None,\).*before `batch`",
    ):
        bucket_by_length(_dict_examples().padded_batch(2), boundaries=[8], global_batch_size=2)
    features = _dict_examples().map(lambda ex: {"tokens": tf.stack([ex["tokens"]] * 2, axis=1), "label": ex["label"]})
    with pytest.raises(
        ValueError, match=r"found none\..*length_fn=lambda example: tf\.shape\(example\['tokens'\]\)\[0\]"
    ):
        bucket_by_length(features, boundaries=[8], global_batch_size=2)


def test_the_one_machine_guide_imports_keras_dist_testing_before_using_it():
    """`import keras_dist` alone leaves `keras_dist.testing` unset, so the guide must import it."""
    guide = (Path(__file__).parents[2] / "docs" / "one_machine.md").read_text()
    assert "keras_dist.testing.simulate_cpu_devices(" in guide
    for use in re.finditer(r"keras_dist\.testing\.simulate_cpu_devices\(", guide):
        assert "import keras_dist.testing" in guide[: use.start()], guide[max(0, use.start() - 300) : use.end()]
