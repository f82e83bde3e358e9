"""TFDS inputs on one worker with N replicas, offline: a real sharded dataset built here, and mock_data.

The multi-worker TFDS cases (FILE sharding per worker, `ReadConfig(input_context=...)`
in a `DatasetCreator`, autocache) are in tests/integration/test_input_sharding.py.
"""

import keras
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
import tfds_local

import keras_dist
from keras_dist.data import DatasetCreator, verify_sharding


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tfds"))
    tfds_local.build_digits_tfds(directory, num_shards=4)
    return directory


def _digits(data_dir, batch_size=40, **load_kwargs):
    dataset = tfds.load(tfds_local.DIGITS_NAME, split="train", data_dir=data_dir, **load_kwargs)
    return dataset.map(lambda e: (tf.cast(e["image"], "float32") / 255.0, e["label"], e["id"])).batch(batch_size)


def _by_id(batch):
    return tf.cast(batch[2], tf.int64)


def _classifier(strategy):
    inputs = keras.Input((8, 8, 1))
    outputs = keras.layers.Dense(10, activation="softmax")(keras.layers.Flatten()(inputs))
    model = keras_dist.DistributedModel(inputs, outputs, strategy=strategy)
    model.compile(optimizer=keras.optimizers.Adam(0.02), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def test_local_tfds_dataset_has_several_shards(digits_dir):
    assert len(tfds_local.digits_shard_files(digits_dir)) == 4


@pytest.mark.parametrize("shuffle_files", [False, True])
def test_tfds_load_every_example_once(digits_dir, mirrored_1x2_cpu, shuffle_files):
    report = verify_sharding(
        _digits(digits_dir, shuffle_files=shuffle_files), example_id=_by_id, strategy=mirrored_1x2_cpu
    )
    assert report.num_examples == tfds_local.NUM_TRAIN and report.every_example_once, str(report)
    assert len(report.examples_per_replica) == 2 and sum(report.examples_per_replica) == tfds_local.NUM_TRAIN


def test_tfds_read_per_worker_with_input_context(digits_dir, mirrored_1x2_cpu):
    def dataset_fn(input_context):
        config = tfds.ReadConfig(input_context=input_context)
        return _digits(digits_dir, input_context.get_per_replica_batch_size(40), read_config=config)

    report = verify_sharding(DatasetCreator(dataset_fn), example_id=_by_id, strategy=mirrored_1x2_cpu)
    assert report.num_examples == tfds_local.NUM_TRAIN and report.every_example_once, str(report)


def test_fit_and_evaluate_on_tfds(digits_dir, mirrored_1x2_cpu):
    model = _classifier(mirrored_1x2_cpu)
    train = _digits(digits_dir, shuffle_files=True).map(lambda x, y, i: (x, y))
    history = model.fit(train, epochs=2, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0]
    assert model.input_plan.global_batch_size == 40 and model.input_plan.per_replica_batch_sizes == (20, 20)
    test = tfds.load(tfds_local.DIGITS_NAME, split="test", data_dir=digits_dir, as_supervised=True)
    _, accuracy = model.evaluate(test.map(lambda x, y: (tf.cast(x, "float32") / 255.0, y)).batch(64), verbose=0)
    assert accuracy > 0.5


def test_mock_data_trains(mirrored_1x2_cpu):
    with tfds_local.mock_mnist(num_examples=24):
        dataset = tfds.load("mnist", split="train", as_supervised=True)
    dataset = dataset.map(lambda x, y: (tf.image.resize(tf.cast(x, "float32"), (8, 8)), y)).batch(8)
    report = verify_sharding(dataset, strategy=mirrored_1x2_cpu)
    assert report.num_examples == 24 and report.expected_num_examples == 24, str(report)
    model = _classifier(mirrored_1x2_cpu)
    model.fit(dataset, epochs=1, verbose=0)
    assert model.input_plan.source == "tf.data.Dataset"
