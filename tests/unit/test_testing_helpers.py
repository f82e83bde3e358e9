"""keras_dist.testing: the single-device comparison passes when it should and fails when it should;
the worker runners report failures, stop hung workers at the timeout and leave no process behind."""

import glob
import os
import sys
import textwrap
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from _support import zygote_servers
from keras import ops

import keras_dist
from keras_dist import _env
from keras_dist.testing import (
    assert_matches_single_device,
    clean_env,
    max_weight_difference,
    run_launcher,
    run_workers,
)


def _regression(n=10):
    x = np.random.RandomState(0).rand(n, 3).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5]], "float32")).astype("float32")


def _build(Model, learning_rate=0.1, **kwargs):
    inputs = keras.Input((3,))
    model = Model(inputs, keras.layers.Dense(1, name="head")(inputs), **kwargs)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse", metrics=["mae"])
    return model


# ------------------------------------------------------------------ assert_matches_single_device
def test_passes_on_uneven_batches_and_returns_both_models(mirrored_1x3_cpu):
    x, y = _regression(10)  # batch 4 on 3 replicas: 2/1/1, then 1/1/0
    comparison = assert_matches_single_device(_build, x, y, strategy=mirrored_1x3_cpu, batch_size=4, epochs=2)
    assert isinstance(comparison.model, keras_dist.DistributedModel)
    assert comparison.model.distribute_strategy is mirrored_1x3_cpu
    assert not isinstance(comparison.reference, keras_dist.DistributedModel)
    assert comparison.max_weight_difference == max_weight_difference(comparison.reference, comparison.model)
    assert comparison.max_weight_difference < 1e-5
    assert sorted(comparison.results) == ["loss", "mae"] and len(comparison.results["loss"]) == 2


def test_passes_with_a_builder_of_plain_keras_and_distribute(mirrored_1x2_cpu):
    x, y = _regression(12)
    comparison = assert_matches_single_device(
        lambda: _build(keras.Model), x, y, strategy=mirrored_1x2_cpu, batch_size=4, epochs=2
    )
    assert isinstance(comparison.model, keras_dist.DistributedModel)


def test_passes_with_a_train_callable_comparing_evaluate_and_predict(mirrored_1x2_cpu):
    x, y = _regression(9)

    def train(model):
        history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        return {
            "history": history,
            "evaluate": model.evaluate(x, y, batch_size=4, verbose=0, return_dict=True),
            "predict": model.predict(x, batch_size=4, verbose=0),
        }

    comparison = assert_matches_single_device(_build, strategy=mirrored_1x2_cpu, train=train)
    assert sorted(comparison.results) == ["evaluate", "history", "predict"]
    assert comparison.results["predict"].shape == (9, 1)


def test_fails_naming_the_weight_when_the_learning_rate_differs(mirrored_1x2_cpu):
    def build(Model, **kwargs):  # Deliberately wrong: the distributed model trains at twice the rate.
        return _build(Model, learning_rate=0.2 if kwargs else 0.1, **kwargs)

    x, y = _regression(8)
    with pytest.raises(AssertionError) as info:
        assert_matches_single_device(build, x, y, strategy=mirrored_1x2_cpu, batch_size=4)
    message = str(info.value)
    assert "does not match plain Keras on one device" in message
    assert "weight head/kernel (3, 1): max |difference|" in message, message
    assert "under the strategy vs" in message and "atol=1e-05 + rtol=1e-05" in message
    assert "result results.loss" in message, message  # The logged losses differ too.


class PlainMeanStep(keras.Model):
    """A keras.io custom train_step (ops.mean loss, apply_gradients): right on one device only."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = ops.mean(ops.square(self(x, training=True) - y))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_weights), self.trainable_weights))
        return {"loss": loss}


def test_fails_for_plain_keras_under_mirrored_strategy_without_keras_dist(mirrored_1x2_cpu):
    """Deliberately wrong: plain Keras in the strategy's scope sums the replicas' mean-loss gradients."""

    def build(Model, **kwargs):
        if kwargs:  # The "distributed" model: plain Keras under MirroredStrategy, no keras-dist.
            with kwargs["strategy"].scope():
                return build(keras.Model)
        inputs = keras.Input((3,))
        model = PlainMeanStep(inputs, keras.layers.Dense(1, name="head")(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.1))
        return model

    x, y = _regression(8)
    with pytest.raises(AssertionError, match=r"weight head/kernel \(3, 1\): max \|difference\|"):
        assert_matches_single_device(build, x, y, strategy=mirrored_1x2_cpu, batch_size=4, epochs=2)


def test_tolerances_bound_what_passes(mirrored_1x2_cpu):
    def build(Model, **kwargs):
        return _build(Model, learning_rate=0.1 + (1e-4 if kwargs else 0.0), **kwargs)

    x, y = _regression(8)
    assert_matches_single_device(build, x, y, strategy=mirrored_1x2_cpu, batch_size=4, atol=1e-2, rtol=0)
    with pytest.raises(AssertionError, match="weight head/"):
        assert_matches_single_device(build, x, y, strategy=mirrored_1x2_cpu, batch_size=4, atol=1e-7, rtol=0)


def test_structure_differences_fail(mirrored_1x2_cpu):
    def train(model):
        model.fit(*_regression(8), batch_size=4, verbose=0)
        return {"steps": 1} if isinstance(model, keras_dist.DistributedModel) else {"steps": 1, "extra": 2}

    with pytest.raises(AssertionError, match=r"differ in structure: only on one device \['results.extra'\]"):
        assert_matches_single_device(_build, strategy=mirrored_1x2_cpu, train=train)


def test_bad_arguments_say_how_to_fix(mirrored_1x2_cpu):
    x, y = _regression(8)
    with pytest.raises(ValueError, match="Pass either `train`.*not both"):
        assert_matches_single_device(_build, x, y, strategy=mirrored_1x2_cpu, train=lambda m: None)
    with pytest.raises(ValueError, match="needs training data or a `train` callable"):
        assert_matches_single_device(_build, strategy=mirrored_1x2_cpu)
    with pytest.raises(ValueError, match="`atol` must be a number >= 0. Received: atol=-1"):
        assert_matches_single_device(_build, x, y, strategy=mirrored_1x2_cpu, atol=-1)


# ------------------------------------------------------------------ clean_env
def test_clean_env_drops_session_variables_and_applies_overrides():
    base = {
        "PATH": "/bin",
        "TF_CONFIG": "{}",
        "KERAS_DIST_CPU_REPLICAS": "2",
        "KERAS_DIST_STARTUP_TIMEOUT": "5",
        "KERAS_DIST_QUIET": "1",
        "TF_ENABLE_ONEDNN_OPTS": "1",
        "DROP_ME": "x",
    }
    env = clean_env(base, TF_CPP_MIN_LOG_LEVEL="3", DROP_ME=None)
    assert env == {"PATH": "/bin", "TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPP_MIN_LOG_LEVEL": "3"}
    assert base["TF_CONFIG"] == "{}"  # not modified
    assert "TF_CONFIG" not in clean_env() and clean_env()["TF_ENABLE_ONEDNN_OPTS"] == "0"
    with pytest.raises(TypeError, match="must be strings.*Fix: pass KERAS_DIST_QUIET='1'"):
        clean_env(KERAS_DIST_QUIET=1)


# ------------------------------------------------------------------ run_workers / run_launcher
WORKER_PREAMBLE = """
import json, os, signal, subprocess, sys, time
TASK_ID = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
DIR = sys.argv[1]
def write(name, text):
    with open(os.path.join(DIR, name + ".tmp"), "w") as f:
        f.write(str(text))
    os.replace(os.path.join(DIR, name + ".tmp"), os.path.join(DIR, name))
"""


def _script(tmp_path, body):
    path = tmp_path / "worker.py"
    path.write_text(WORKER_PREAMBLE + textwrap.dedent(body))
    return path


def _assert_gone(pid, timeout=5.0):
    """The process is gone or a zombie (an orphan waits a moment for init to reap it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        assert time.monotonic() < deadline, f"process {pid} is still running"
        time.sleep(0.05)


def _pid(tmp_path, name):
    return int((tmp_path / name).read_text())


@pytest.fixture(scope="module")
def _zygote_directory():
    with zygote_servers() as directory:
        yield directory


@pytest.fixture(params=["new_interpreter", "zygote"])
def worker_start(request, monkeypatch, _zygote_directory):
    """Each runner test twice: workers as new interpreters, and forked from a zygote server (the suite's way)."""
    if request.param == "zygote":
        monkeypatch.setenv(_env.ZYGOTE_ENV, _zygote_directory)
    else:
        monkeypatch.delenv(_env.ZYGOTE_ENV, raising=False)
    yield request.param
    if request.param == "zygote":
        assert glob.glob(os.path.join(_zygote_directory, "*.socket")), "no zygote server was started"


@pytest.mark.timeout(60)
def test_run_workers_reports_each_status_and_output(tmp_path, worker_start):
    script = _script(
        tmp_path,
        """
        print("hello from", TASK_ID, os.environ["KERAS_DIST_CPU_REPLICAS"], sys.argv[2])
        sys.exit(TASK_ID)
        """,
    )
    result = run_workers(
        script, [str(tmp_path), "arg"], num_workers=2, cpu_replicas=3, timeout=40, stop_on_failure=False
    )
    assert result.returncodes == {0: 0, 1: 1} and not result.ok and not result.timed_out
    assert [w.output for w in result.workers] == ["hello from 0 3 arg\n", "hello from 1 3 arg\n"]
    assert "worker 1: returncode 1" in result.describe()


@pytest.mark.timeout(60)
def test_run_workers_stops_the_others_when_one_fails(tmp_path, worker_start):
    script = _script(
        tmp_path,
        """
        if TASK_ID == 0:
            write("pid0", os.getpid())
            time.sleep(50)
        while not os.path.exists(os.path.join(DIR, "pid0")):
            time.sleep(0.05)
        sys.exit(1)
        """,
    )
    started = time.monotonic()
    result = run_workers(script, [str(tmp_path)], timeout=40)
    assert time.monotonic() - started < 30
    assert result[1].returncode == 1 and not result[1].stopped
    assert result[0].returncode == -15 and result[0].stopped and not result[0].timed_out
    _assert_gone(_pid(tmp_path, "pid0"))


@pytest.mark.timeout(60)
def test_run_workers_kills_a_hung_worker_and_its_children_at_the_timeout(tmp_path, worker_start):
    script = _script(
        tmp_path,
        """
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # Only SIGKILL ends it.
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        write(f"child{TASK_ID}", child.pid)
        write(f"pid{TASK_ID}", os.getpid())
        if TASK_ID == 0:
            time.sleep(60)
        """,
    )
    # 10 s: worker 1 starts, starts its child and exits well before it on a loaded machine (3 s was too short at
    # a load of 8 on 2 cores, stop 51); worker 0 sleeps (no CPU) until the timeout.
    result = run_workers(script, [str(tmp_path)], timeout=10, grace_period=0.5, stop_on_failure=False)
    assert result.timed_out and not result.ok
    assert result[0].timed_out and result[0].returncode == -9
    assert result[1].returncode == 0 and not result[1].timed_out
    for name in ("pid0", "child0", "child1"):  # Worker 1's child outlived worker 1: its group is killed too.
        _assert_gone(_pid(tmp_path, name))


@pytest.mark.timeout(60)
def test_run_workers_starts_only_the_given_tasks(tmp_path, worker_start):
    script = _script(tmp_path, "print(os.environ['TF_CONFIG'])\n")
    result = run_workers(script, [str(tmp_path)], num_workers=3, task_ids=[1], timeout=40)
    assert [w.task_id for w in result.workers] == [1] and result.ok
    assert '"index": 1' in result[1].output and result[1].output.count("127.0.0.1:") == 3


@pytest.mark.timeout(90)
def test_run_launcher_returns_the_failing_status_and_stops_hung_workers_at_the_timeout(tmp_path, worker_start):
    script = _script(tmp_path, "sys.exit(3 if TASK_ID == 1 else 0)\n")
    failed = run_launcher(["--num-workers", "2", str(script), str(tmp_path)], timeout=40)
    assert failed.returncode == 3 and not failed.timed_out, failed.stderr
    assert "worker 1 exited with status 3" in failed.stderr

    script = _script(
        tmp_path,
        """
        write(f"pid{TASK_ID}", os.getpid())
        print("started", flush=True)
        time.sleep(60)
        """,
    )
    hung = run_launcher(["--num-workers", "2", "--grace-period", "1", str(script), str(tmp_path)], timeout=8)
    assert hung.timed_out and hung.returncode == 143, hung.stderr
    assert hung.worker_lines(0) == ["started"] and hung.worker_lines(1) == ["started"]
    assert "timed out after 8 s" in hung.stderr
    for task_id in (0, 1):
        _assert_gone(_pid(tmp_path, f"pid{task_id}"))


def test_runners_refuse_a_bad_timeout(tmp_path):
    with pytest.raises(ValueError, match="`timeout` must be a number of seconds > 0"):
        run_workers(sys.executable, timeout=0)
    with pytest.raises(ValueError, match="`timeout` must be a number of seconds > 0"):
        run_launcher([], timeout=-1)
