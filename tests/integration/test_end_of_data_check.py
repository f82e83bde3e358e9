"""TensorFlow's per-step end-of-data check on 2 workers: skipped where every worker has as many batches.

Under several workers TensorFlow asks the other workers before every step of a finite dataset
whether any still has data (one collective per step). keras-dist skips the question where the
workers' inputs have the same number of batches (DATA sharding, a known cardinality or Keras'
arrays of the same length everywhere: `keras_dist.data._distribute.same_number_of_batches`).
tests/integration/end_of_data_worker.py trains a tiny model on each kind of input (2x1 and 2x2),
and counts each worker's batches without the check for a sweep of dataset sizes.
"""

import json
import os

import keras
import numpy as np
import pytest

from keras_dist.testing import clean_env, run_workers

pytestmark = pytest.mark.multi_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "end_of_data_worker.py")
NONE = "none ("
ASKS = "one collective per step ("


@pytest.fixture(scope="module", params=[1, 2], ids=["multi_worker_2x1_cpu", "multi_worker_2x2_cpu"])
def outputs(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"end-of-data-2x{request.param}")
    _write_records(out / "records")
    result = run_workers(
        WORKER,
        [str(out)],
        num_workers=2,
        cpu_replicas=request.param,
        timeout=240,
        env=clean_env(TF_CPP_MIN_LOG_LEVEL="3", KERAS_DIST_QUIET="1"),
    )
    assert result.ok, result.describe()
    return [json.loads((out / f"worker-{i}.json").read_text()) for i in range(2)]


def _write_records(directory):
    """3 TFRecord files of 100 examples: FILE sharding gives worker 0 two files and worker 1 one."""
    import tensorflow as tf

    directory.mkdir()
    x, y = _data(300)
    for k in range(3):
        with tf.io.TFRecordWriter(str(directory / f"part-{k}.tfrecord")) as writer:
            for i in range(100 * k, 100 * (k + 1)):
                features = {
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x[i].tolist())),
                    "y": tf.train.Feature(float_list=tf.train.FloatList(value=y[i].tolist())),
                }
                writer.write(tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString())


def _one_device(x, y, **kwargs):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="ones")(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, epochs=2, verbose=0, shuffle=False, **kwargs)
    return model.get_weights()


def _data(n):
    rs = np.random.RandomState(0)
    return rs.rand(n, 3).astype("float32"), rs.rand(n, 1).astype("float32")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name, check",
    [
        ("arrays", NONE + "every worker's arrays have the same length and batch size)"),
        ("arrays_validation_split", NONE + "every worker's arrays have the same length and batch size)"),
        ("dataset", NONE + "every worker has 2 global batches)"),
        ("filtered", ASKS + "the number of batches is not known in advance)"),
        ("repeated", NONE + "the input repeats without end)"),
        ("different_lengths", ASKS + "the workers' inputs differ in length)"),
    ],
)
def test_the_check_is_skipped_only_where_the_workers_have_as_many_batches(outputs, name, check):
    for worker in outputs:
        assert worker[name]["check"] == check, (name, worker[name]["check"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["arrays", "arrays_validation_split"])
def test_training_without_the_check_matches_one_device(outputs, name):
    # 257 examples at 256: the last global batch (1 example) leaves worker 1 an empty batch.
    kwargs = {"batch_size": 256} if name == "arrays" else {"batch_size": 128, "validation_split": 0.2}
    reference = _one_device(*_data(257 if name == "arrays" else 300), **kwargs)
    for worker in outputs:
        for got, want in zip(worker[name]["weights"], reference):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_every_worker_gets_one_step_of_each_global_batch(outputs):
    # What skipping the check relies on (TensorFlow's DATA sharding after its rebatch), on this stack.
    for worker in outputs:
        for case in worker["sweep"]:
            assert case["batches"] == case["expected"], case


@pytest.mark.timeout(300)
def test_an_input_that_needs_the_check_after_one_that_does_not_gets_it(outputs):
    # fit on arrays traces the step functions without the check (validation too); a later evaluate of files
    # sharded by FILE (200 examples on worker 0, 100 on worker 1) must not reuse them: TensorFlow's iterator
    # type does not tell the two apart, and the workers would stop at different steps and wait (found by a
    # new-user probe: WorkerStalledError in evaluate).
    x, y = _data(300)
    keras.utils.set_random_seed(1)
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="ones")(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=64, validation_data=(x[:100], y[:100]), epochs=1, verbose=0, shuffle=False)
    reference = model.evaluate(x, y, batch_size=50, verbose=0)
    for worker in outputs:
        assert worker["then_files"]["checks"] == [
            NONE + "every worker's arrays have the same length and batch size)",
            ASKS + "sharded by FILE: the workers' batch counts may differ)",
        ]
        np.testing.assert_allclose(worker["then_files"]["evaluate"], reference, rtol=1e-5)
