"""Worker of test_end_of_data_check.py: the per-step end-of-data check on 2 workers, and what it skips.

Writes `worker-<task>.json` into `sys.argv[1]`: for each input, the input plan's end-of-data
line and the final weights of a tiny model trained by `fit`; and, for a sweep of dataset sizes,
how many batches this worker's share of a DATA-sharded dataset has when TensorFlow does not
check (`without_per_step_agreement`), with the number the check-free path relies on.
"""

import json
import os
import sys

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_dist  # keras_dist: joins the cluster before TensorFlow runs anything.
from keras_dist._runtime import distribute_dataset as runtime_distribute_dataset  # noqa: E402

SWEEP = [(1, 4), (3, 4), (5, 4), (7, 4), (8, 4), (9, 4), (13, 4), (257, 256), (1000, 256), (100, 256)]


def data(n):
    rs = np.random.RandomState(0)
    return rs.rand(n, 3).astype("float32"), rs.rand(n, 1).astype("float32")


def train(x, y=None, epochs=2, **kwargs):
    keras.utils.set_random_seed(1)
    model = keras_dist.DistributedModel(*_layers())
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, epochs=epochs, verbose=0, shuffle=False, **kwargs)
    return {"check": model.input_plan.per_step_check, "weights": [w.tolist() for w in model.get_weights()]}


def _layers():
    inputs = keras.Input((3,))
    return inputs, keras.layers.Dense(1, kernel_initializer="ones")(inputs)


def batches_without_the_check(strategy, n, batch_size):
    dataset = tf.data.Dataset.range(n).batch(batch_size)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    with runtime_distribute_dataset.without_per_step_agreement(strategy):
        distributed = strategy.experimental_distribute_dataset(dataset.with_options(options))
    assert not runtime_distribute_dataset.asks_every_step(distributed)
    return sum(1 for _ in distributed)  # Per-replica values of this worker's replicas, one per step; no collective.


def arrays_then_files(directory):
    """fit on arrays (step functions traced without the check), then evaluate files sharded by FILE (uneven)."""
    keras.utils.set_random_seed(1)
    model = keras_dist.DistributedModel(*_layers())
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = data(300)
    model.fit(x, y, batch_size=64, validation_data=(x[:100], y[:100]), epochs=1, verbose=0, shuffle=False)
    checks = [model.input_plan.per_step_check]

    def parse(record):
        spec = {"x": tf.io.FixedLenFeature([3], tf.float32), "y": tf.io.FixedLenFeature([1], tf.float32)}
        example = tf.io.parse_single_example(record, spec)
        return example["x"], example["y"]

    files = sorted(os.path.join(directory, name) for name in os.listdir(directory))
    result = model.evaluate(tf.data.TFRecordDataset(files).map(parse).batch(50), verbose=0)
    checks.append(model.input_plan.per_step_check)
    return {"checks": checks, "evaluate": float(result)}


def main(out_dir):
    strategy = keras_dist.resolve_strategy("auto")
    task = keras_dist.task_id()
    x, y = data(257)  # Global batches of 256 and 1: the second gives worker 1 an empty batch.
    results = {
        "arrays": train(x, y, batch_size=256),
        "arrays_validation_split": train(*data(300), batch_size=128, validation_split=0.2),
        "dataset": train(tf.data.Dataset.from_tensor_slices((x, y)).batch(256)),
        "filtered": train(tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(256)),
        "repeated": train(tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(256), steps_per_epoch=2),
        # Each worker its own arrays, of different lengths (3 and 2 batches; Keras' own loop is kept to
        # 2 steps on both): the check stays.
        "different_lengths": train(*data(300 if task == 0 else 200), batch_size=128, epochs=1, steps_per_epoch=2),
    }
    results["then_files"] = arrays_then_files(os.path.join(out_dir, "records"))
    results["sweep"] = [
        {"n": n, "batch_size": b, "batches": batches_without_the_check(strategy, n, b), "expected": -(-n // b)}
        for n, b in SWEEP
    ]
    with open(os.path.join(out_dir, f"worker-{task}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
