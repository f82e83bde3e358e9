"""Worker script for tests/integration/test_input_sharding.py, started by `keras-dist launch`.

Usage: sharding_worker.py OUT_DIR TFDS_DATA_DIR
Trains one epoch on every input kind of tests/sharding_workload.py, then runs
`verify_sharding` on TFDS and on a deliberately unsharded input. Writes
OUT_DIR/<task_type>-<task_id>.json.
"""

import json
import os
import sys
import traceback

import tensorflow as tf  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402

import keras_dist  # keras_dist: joins the cluster before TensorFlow runs anything.

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
import sharding_workload  # noqa: E402
import tfds_local  # noqa: E402

from keras_dist.data import DatasetCreator, verify_sharding  # noqa: E402


def _by_id(batch):
    return tf.cast(batch[1], tf.int64)


def _tfds_pipeline(data_dir, read_config=None, batch_size=40, shuffle_files=False):
    dataset = tfds.load(
        tfds_local.DIGITS_NAME, split="train", data_dir=data_dir, read_config=read_config, shuffle_files=shuffle_files
    )
    return dataset.map(lambda e: (tf.cast(e["image"], tf.float32), e["id"])).batch(batch_size)


def _predict_in_order(out_dir, task_id):
    """Predicts the ids of a 4-file TFRecord input with an identity model: must come back in order."""
    import keras

    files = sharding_workload.write_tfrecords(out_dir, 4, task_id)
    dataset = tf.data.TFRecordDataset(files).map(lambda r: sharding_workload._parse(r)[0]).batch(4)
    inputs = keras.Input((1,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1, kernel_initializer="ones")(inputs))
    expected = [float(v) for batch in dataset for v in batch.numpy().ravel()]
    return {"expected": expected, "predicted": model.predict(dataset, verbose=0).ravel().tolist()}


def _reports(data_dir, out_dir, task_id):
    def tfds_fn(input_context):
        config = tfds.ReadConfig(input_context=input_context)
        return _tfds_pipeline(data_dir, config, input_context.get_per_replica_batch_size(40))

    x = sharding_workload.ids()
    files = sharding_workload.write_tfrecords(out_dir, 4, task_id)
    take = tf.data.TFRecordDataset(files).map(sharding_workload._parse).take(10).batch(4)
    checks = {
        "tfrecord_take_10": lambda: verify_sharding(take, example_id=_by_id),
        "tfds_load": lambda: verify_sharding(_tfds_pipeline(data_dir), example_id=_by_id),
        "tfds_load_no_autocache": lambda: verify_sharding(
            _tfds_pipeline(data_dir, tfds.ReadConfig(try_autocache=False)), example_id=_by_id
        ),
        "tfds_shuffle_files": lambda: verify_sharding(_tfds_pipeline(data_dir, shuffle_files=True), example_id=_by_id),
        "tfds_dataset_creator": lambda: verify_sharding(DatasetCreator(tfds_fn), example_id=_by_id),
        "numpy_policy_off": lambda: verify_sharding(x, batch_size=8, auto_shard_policy="off"),
    }
    out = {}
    for name, check in checks.items():
        report = check()
        out[name] = {
            "policy": report.plan.auto_shard_policy,
            "num_files": report.plan.num_files,
            "per_worker": list(report.examples_per_worker),
            "num_examples": report.num_examples,
            "duplicated": report.num_duplicated,
            "missing": report.num_missing,
            "text": str(report),
        }
    return out


def main(out_dir, data_dir):
    info = keras_dist.cluster_info()
    results = {"counts": {}, "errors": {}}
    for kind in sharding_workload.INPUT_KINDS:
        try:
            counts = sharding_workload.seen_counts(keras_dist.DistributedModel, kind, out_dir, info.task_id)
            results["counts"][kind] = counts.tolist()
        except Exception:  # Recorded for the test's message; the other kinds still run.
            results["errors"][kind] = traceback.format_exc()[-2000:]
    results["reports"] = _reports(data_dir, out_dir, info.task_id)
    results["predict_tfrecord"] = _predict_in_order(out_dir, info.task_id)
    with open(os.path.join(out_dir, f"{info.task_type}-{info.task_id}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
