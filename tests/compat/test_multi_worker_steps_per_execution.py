"""`steps_per_execution` > 1 under MultiWorkerMirroredStrategy (found by a new-user session)."""

import json
import math
import os
import types

import keras
import numpy as np
import pytest
import steps_per_execution_worker
import tensorflow as tf
from helpers import MW_WORKER, multi_worker_env

import keras_dist
from keras_dist import _compat, errors
from keras_dist._model import step_functions
from keras_dist.testing import run_launcher

pytestmark = [pytest.mark.compat, pytest.mark.multi_worker]

SPE_WORKER = os.path.join(os.path.dirname(__file__), "steps_per_execution_worker.py")


def _launch(tmp_path, disabled_fixes):
    launch_args = ["--num-workers", "2", MW_WORKER, str(tmp_path), "--steps-per-execution", "4"]
    return run_launcher(launch_args, env=multi_worker_env(disabled_fixes), timeout=110)


@pytest.mark.timeout(120)
def test_without_fix_tensorflow_fails_in_the_multi_step_loop(tmp_path):
    result = _launch(tmp_path, "multi_worker_steps_per_execution")
    assert result.returncode != 0
    assert "You must feed a value for placeholder tensor" in result.stdout, result.stdout[-3000:]


@pytest.mark.timeout(120)
def test_with_fix_it_warns_and_trains_like_one_step_per_execution(tmp_path):
    result = _launch(tmp_path, "")
    assert result.returncode == 0, result.stdout[-3000:]
    assert result.stdout.count("KerasDistWarning: `steps_per_execution` > 1 is not supported") == 2
    outputs = [json.loads((tmp_path / f"worker-{i}.json").read_text()) for i in range(2)]
    assert outputs[0]["weights"] == outputs[1]["weights"]
    assert outputs[0]["history"]["count"] == [37.0, 37.0]


@pytest.mark.timeout(150)
def test_with_fix_step_counts_run_whole_executions_as_on_one_device(tmp_path):
    # steps_per_epoch=5, validation_steps=2, evaluate/predict steps=4 with steps_per_execution=3:
    # Keras runs 6, 3, 6 and 6 steps (found by a new-user probe: 2 workers ran 5 an epoch, iterations 10).
    result = run_launcher(["--num-workers", "2", SPE_WORKER, str(tmp_path)], env=multi_worker_env(""), timeout=130)
    assert result.returncode == 0, result.stdout[-3000:]
    expected = steps_per_execution_worker.run(keras.Model)
    assert expected["iterations"] == 12 and len(expected["predictions"]) == 6 * 8
    for i in range(2):
        output = json.loads((tmp_path / f"worker-{i}.json").read_text())
        assert output["iterations"] == expected["iterations"]
        assert sorted(output["history"]) == sorted(expected["history"])
        for name, values in expected["history"].items():
            np.testing.assert_allclose(output["history"][name], values, rtol=1e-5, err_msg=name)
        for name, value in expected["evaluate"].items():
            np.testing.assert_allclose(output["evaluate"][name], value, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(output["predictions"], expected["predictions"], rtol=1e-5, atol=1e-6)
        for got, want in zip(output["weights"], expected["weights"]):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


class _Counts(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.steps = []

    def on_epoch_end(self, epoch, logs=None):
        self.steps.append(int(self.model.optimizer.iterations.numpy()))


@pytest.mark.parametrize("per_execution", [3, 4])
@pytest.mark.parametrize("repeat, steps_per_epoch", [(True, 5), (True, 8), (False, 5), (False, 8), (False, None)])
def test_rounded_step_counts_are_keras_own_on_one_device(per_execution, repeat, steps_per_epoch):
    # Keras' rule (epoch_iterator.py): ceil(steps / k) executions of k steps, each ending early only
    # where the input ends (10 batches: an epoch may end early too). `keras_step_counts` must give one step per execution the same count.
    def run(compiled_per_execution, arguments):
        dataset = tf.data.Dataset.range(10).map(lambda i: (tf.cast([i], "float32"), tf.cast([i], "float32")))
        dataset = dataset.batch(1).repeat() if repeat else dataset.batch(1)
        inputs = keras.Input((1,))
        model = keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(inputs))
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=compiled_per_execution)
        counts = _Counts()
        model.fit(dataset, epochs=3, verbose=0, callbacks=[counts], **arguments)
        return counts.steps

    arguments = {"steps_per_epoch": steps_per_epoch, "validation_steps": None}
    fake_model = types.SimpleNamespace(_requested_steps_per_execution=per_execution, steps_per_execution=1)
    step_functions.keras_step_counts(fake_model, arguments, ("steps_per_epoch", "validation_steps"))
    if steps_per_epoch:
        assert arguments["steps_per_epoch"] == math.ceil(steps_per_epoch / per_execution) * per_execution
    del arguments["validation_steps"]
    assert run(1, arguments) == run(per_execution, {"steps_per_epoch": steps_per_epoch})


def _one_worker_spe(strategy, weights=None):
    """`fit` and `evaluate` with `steps_per_execution=2`, 24 examples in batches of 6 (a new-user probe's); one device
    with `strategy=None`."""
    x = np.random.default_rng(0).normal(size=(24, 5)).astype("float32")
    y = x[:, :1] * 2
    inputs = keras.Input((5,))
    outputs = keras.layers.Dense(1)(inputs)
    model = (
        keras.Model(inputs, outputs)
        if strategy is None
        else keras_dist.DistributedModel(inputs, outputs, strategy=strategy)
    )
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    if weights is not None:
        model.set_weights(weights)
    initial = model.get_weights()
    history = model.fit(x, y, batch_size=6, epochs=1, verbose=0, shuffle=False).history
    return model, initial, history, model.evaluate(x, y, batch_size=6, verbose=0)


def test_one_worker_with_collective_all_reduce_fails_without_the_fix(mirrored_1x2_cpu_collective):
    """MirroredStrategy's default all-reduce on several CPUs (`CollectiveAllReduce`) fails the same way."""
    with _compat.disabled("multi_worker_steps_per_execution"), pytest.raises(tf.errors.InvalidArgumentError):
        _one_worker_spe(mirrored_1x2_cpu_collective)


def test_one_worker_with_collective_all_reduce_warns_and_matches_one_device(mirrored_1x2_cpu_collective):
    with pytest.warns(errors.KerasDistWarning, match="`steps_per_execution` > 1 is not supported"):
        model, initial, history, evaluated = _one_worker_spe(mirrored_1x2_cpu_collective)
    assert model.steps_per_execution == 1 and int(model.optimizer.iterations.numpy()) == 4
    reference, _, expected_history, expected = _one_worker_spe(None, weights=initial)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history["loss"], expected_history["loss"], rtol=1e-5)
    np.testing.assert_allclose(evaluated, expected, rtol=1e-5)
