"""Multi-worker training on loopback: numerics against single-device Keras, and faults.

Real worker processes (TensorFlow's gRPC runtime, `MultiWorkerMirroredStrategy`),
started through `keras-dist launch` or, for fault injection where the launcher
would stop the survivors itself, directly with the launcher's own TF_CONFIG
builders. Every test has a timeout and leaves no process behind.
"""

import json
import os
import subprocess
import sys

import keras
import mw_workload
import numpy as np
import pytest

from keras_dist.cli.launch import build_cluster_spec, build_worker_env, find_free_ports
from keras_dist.testing import clean_env, run_launcher, run_workers

pytestmark = pytest.mark.multi_worker

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mw_worker.py")
ENV = clean_env(TF_CPP_MIN_LOG_LEVEL="3", KERAS_DIST_QUIET="1")


def _launch(options, script_args, timeout, env=None):
    return run_launcher([*options, WORKER, *script_args], env={**ENV, **(env or {})}, timeout=timeout)


@pytest.fixture(scope="module")
def single_device_results():
    return mw_workload.run(mw_workload.build(keras.Model))


def _assert_matches(reference, got):
    for key in ("history", "history_numpy", "evaluate"):
        assert sorted(got[key]) == sorted(reference[key])
        for name, expected in reference[key].items():
            np.testing.assert_allclose(got[key][name], expected, rtol=1e-5, atol=1e-5, err_msg=f"{key}.{name}")
    np.testing.assert_allclose(got["predictions"], reference["predictions"], rtol=1e-5, atol=1e-5)
    for w_got, w_ref in zip(got["weights"], reference["weights"], strict=True):
        np.testing.assert_allclose(w_got, w_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("cpu_replicas", [1, 2], ids=["multi_worker_2x1_cpu", "multi_worker_2x2_cpu"])
def test_two_workers_match_single_device(tmp_path, single_device_results, cpu_replicas):
    result = _launch(["--num-workers", "2", "--cpu-replicas", str(cpu_replicas)], [str(tmp_path)], timeout=140)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    outputs = [json.loads((tmp_path / f"worker-{i}.json").read_text()) for i in range(2)]
    assert [o["num_replicas_in_sync"] for o in outputs] == [2 * cpu_replicas] * 2
    assert [o["is_chief"] for o in outputs] == [True, False]
    # 37 training and 13 validation examples, each counted once per epoch.
    assert outputs[0]["history"]["count"] == [37.0, 37.0]
    assert outputs[0]["history"]["val_count"] == [13.0, 13.0]
    assert outputs[0]["evaluate"]["count"] == 13.0
    assert len(outputs[0]["predictions"]) == 11
    # Per replica and step: the gradients with the example counts and the gradient-kind check, then the
    # metric sums after apply, since the workload's `count` metric is a class of its own (Keras' own metric
    # classes ride in the gradients' pack too: tests/unit/test_step_all_reduce.py). 14 at first, then 3.
    assert outputs[0]["collectives_per_train_step"] == [2 * cpu_replicas]
    assert outputs[0]["bytes_per_pack"] == 8 * 2**20  # "auto" between CPU workers
    assert "pack auto (8388608 bytes)" in outputs[0]["communication"]  # what the plan prints
    for got in outputs:
        _assert_matches(single_device_results, got)


@pytest.mark.timeout(150)
def test_communication_options_on_real_collectives_match_single_device(tmp_path, single_device_results):
    """RING, 64-byte packs (one collective per few tensors) and a timeout: same numbers."""
    communication = '{"implementation": "ring", "bytes_per_pack": 64, "timeout_seconds": 60}'
    result = _launch(["--num-workers", "2"], [str(tmp_path), "--communication", communication], timeout=140)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for i in range(2):
        _assert_matches(single_device_results, json.loads((tmp_path / f"worker-{i}.json").read_text()))


@pytest.mark.timeout(150)
def test_gradient_accumulation_on_two_workers_matches_single_device(tmp_path):
    reference = mw_workload.run(mw_workload.build(keras.Model, gradient_accumulation_steps=2))
    result = _launch(["--num-workers", "2", "--cpu-replicas", "2"], [str(tmp_path), "--accumulation", "2"], timeout=140)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for i in range(2):
        _assert_matches(reference, json.loads((tmp_path / f"worker-{i}.json").read_text()))


@pytest.mark.timeout(150)
def test_sparse_gradients_on_two_workers_match_single_device(tmp_path):
    """Repeated token ids and a position embedding, Adam, against plain Keras on one device.

    Token rows are each worker's rows concatenated (a repeated id keeps its rows), position rows are
    summed position by position over the workers (one row per position), as on one device.
    """
    reference = mw_workload.run_sparse(mw_workload.build_sparse(keras.Model))
    result = _launch(["--num-workers", "2"], [str(tmp_path), "--workload", "sparse"], timeout=140)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for i in range(2):
        got = json.loads((tmp_path / f"worker-{i}.json").read_text())
        for w_got, w_ref in zip(got["weights"], reference["weights"], strict=True):
            np.testing.assert_allclose(w_got, w_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(150)
def test_sparse_gradients_accumulated_on_two_workers_match_single_device(tmp_path):
    """Adam with k=3 on 2 workers x 2 replicas: the rows summed merged by index match one device's dense accumulation.

    10 micro-batches: the last cycle (the uneven last batch alone) is in progress at the end, and each
    replica's running sum of a table holds rows (at most the 10 ids), not a table-sized tensor.
    """
    reference = mw_workload.run_sparse(mw_workload.build_sparse(keras.Model, gradient_accumulation_steps=3))
    result = _launch(
        ["--num-workers", "2", "--cpu-replicas", "2"],
        [str(tmp_path), "--workload", "sparse", "--accumulation", "3"],
        timeout=140,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for i in range(2):
        got = json.loads((tmp_path / f"worker-{i}.json").read_text())
        for w_got, w_ref in zip(got["weights"], reference["weights"], strict=True):
            np.testing.assert_allclose(w_got, w_ref, rtol=1e-5, atol=1e-5)
        held = [n for rows in got["sum_rows"] for n in rows]  # A replica without examples in the last batch: 0.
        assert held and all(n <= 10 for n in held) and any(held), got["sum_rows"]


@pytest.mark.timeout(120)
def test_worker_killed_mid_epoch_fails_the_others_naming_it(tmp_path):
    result = run_workers(
        WORKER,
        [str(tmp_path), "--die-at-batch", "5", "--die-task-id", "1"],
        env={**ENV, "KERAS_DIST_HEARTBEAT_TIMEOUT": "5"},
        timeout=100,  # worker 0 would train 1000 epochs if not stopped
        stop_on_failure=False,
    )
    returncodes, log = result.returncodes, result[0].output
    assert returncodes[1] == -9
    assert returncodes[0] == 1, log[-3000:]
    assert "WorkerUnavailableError: [worker:0] worker:1 (127.0.0.1:" in log, log[-3000:]
    assert "stopped answering or crashed" in log


@pytest.mark.timeout(120)
@pytest.mark.parametrize("started, missing", [(0, 1), (1, 0)], ids=["worker_1_missing", "leader_missing"])
def test_worker_never_started_fails_the_others_naming_it(tmp_path, started, missing):
    result = run_workers(
        WORKER,
        [str(tmp_path)],
        num_workers=2,
        task_ids=[started],
        env={**ENV, "KERAS_DIST_STARTUP_TIMEOUT": "5"},
        timeout=100,
        stop_on_failure=False,
    )
    returncodes, log = result.returncodes, result[started].output
    assert returncodes[started] == 1, log[-3000:]
    assert f"WorkerUnavailableError: [worker:{started}] worker:{missing} (127.0.0.1:" in log, log[-3000:]
    assert "did not join the cluster within 5 s (KERAS_DIST_STARTUP_TIMEOUT)" in log


@pytest.mark.timeout(120)
def test_launcher_stops_survivors_when_a_worker_is_killed(tmp_path):
    result = _launch(
        ["--num-workers", "2", "--grace-period", "2"],
        [str(tmp_path), "--die-at-batch", "5", "--die-task-id", "1"],
        timeout=110,
    )
    assert result.returncode == 137, result.stdout[-2000:] + result.stderr[-2000:]
    assert "worker 1 was killed by SIGKILL" in result.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "tf_config, match",
    [
        ("{not json", "not valid JSON"),
        (
            '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}',
            "share the address",
        ),
        (
            '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 2}}',
            "out of range",
        ),
    ],
    ids=["bad_json", "duplicate_address", "index_out_of_range"],
)
def test_bad_tf_config_fails_at_import_before_any_server(tf_config, match):
    result = subprocess.run(
        [sys.executable, "-c", "import keras_dist"],
        env={**ENV, "TF_CONFIG": tf_config},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert result.returncode == 1
    assert "Invalid TF_CONFIG" in result.stderr and match in result.stderr, result.stderr[-2000:]
    assert "Started server" not in result.stderr


@pytest.mark.timeout(60)
def test_tensorflow_op_before_import_says_what_to_move():
    cluster = build_cluster_spec(ports=find_free_ports(2))
    env = build_worker_env(ENV, cluster_spec=cluster, task_id=0)
    code = "import tensorflow as tf\ntf.constant(1.0) + 1\nimport keras_dist\n"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=50)
    assert result.returncode == 1
    assert "put `import keras_dist` at the top of the script" in result.stderr, result.stderr[-2000:]


@pytest.mark.timeout(150)
def test_main_example_runs_unchanged_on_two_workers():
    example = os.path.join(HERE, os.pardir, os.pardir, "examples", "digits_cnn.py")
    result = run_launcher(
        ["--num-workers", "2", example, "--smoke"], env=clean_env(TF_CPP_MIN_LOG_LEVEL="3"), timeout=140
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines.count("[worker:0] keras-dist plan") == 1 and "[worker:1] keras-dist plan" not in lines
    assert "[worker:0]   workers:              2 (this is worker:0)" in lines
    assert not any(line.startswith("[worker:1] Epoch") for line in lines)  # progress on the chief only
    accuracies = [line.split(": ")[-1] for line in lines if "test accuracy:" in line]
    assert len(accuracies) == 2 and accuracies[0] == accuracies[1]


SEEN_IDS_SCRIPT = """
import sys
import keras_dist
import keras, numpy as np, tensorflow as tf

path = f"{sys.argv[1]}/seen-{keras_dist.task_id()}.txt"
ids = np.arange(96, dtype="float32")[:, None]


class RecordIds(keras.layers.Layer):
    def call(self, x, training=None):
        if training:
            tf.print(tf.cast(x[:, 0], tf.int32), output_stream="file://" + path, summarize=-1)
        return x


inputs = keras.Input((1,))
model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(RecordIds()(inputs)))
model.compile("sgd", "mse")
model.fit(ids, np.zeros_like(ids), batch_size=16, epochs=2, verbose=0)  # shuffle=True, no seed
"""


@pytest.mark.timeout(120)
def test_unseeded_numpy_shuffle_sees_every_example_once_per_epoch(tmp_path):
    script = tmp_path / "seen_ids.py"
    script.write_text(SEEN_IDS_SCRIPT)
    result = run_launcher(["--num-workers", "2", str(script), str(tmp_path)], env=ENV, timeout=110)
    assert result.returncode == 0, result.stdout[-3000:]
    rows = {
        i: [[int(v) for v in line.strip("[]\n").split()] for line in open(tmp_path / f"seen-{i}.txt") if line.strip()]
        for i in range(2)
    }
    assert [len(r) for r in rows.values()] == [12, 12]  # 6 steps x 2 epochs on each worker
    for epoch in range(2):
        seen = sorted(i for r in rows.values() for batch in r[6 * epoch : 6 * (epoch + 1)] for i in batch)
        assert seen == list(range(96)), f"epoch {epoch}"


MISMATCHED_SCRIPT = """
import keras_dist
import keras, numpy as np

x = np.random.RandomState(0).rand(64, 4).astype("float32")
inputs = keras.Input((4,))
model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs))
model.compile(optimizer="sgd", loss="mse")
model.fit(x, x[:, :1], batch_size=8, epochs=3 if keras_dist.task_id() == 0 else 5, verbose=0)
model.evaluate(x, x[:, :1], batch_size=8, verbose=0)
"""


@pytest.mark.timeout(120)
def test_workers_running_different_programs_get_a_clear_error(tmp_path):
    script = tmp_path / "mismatched.py"
    script.write_text(MISMATCHED_SCRIPT)
    result = run_launcher(["--num-workers", "2", "--grace-period", "3", str(script)], env=ENV, timeout=110)
    assert result.returncode == 1, result.stdout[-3000:]
    assert "The workers are out of step: another worker ran a different collective" in result.stdout


BRANCHING_SCRIPT = """
import sys
import keras_dist
import keras, numpy as np


class Branching(keras_dist.DistributedModel):
    def __init__(self):
        super().__init__()
        self.shared = keras.layers.Dense(1, name="shared")
        self.first = keras.layers.Dense(1, name="first_worker_only")
        self.second = keras.layers.Dense(1, name="second_worker_only")

    def call(self, x):
        # A per-worker Python branch: equal shapes, so the packed all-reduce sizes agree and, unchecked,
        # worker 0's `first` gradient would be summed with worker 1's `second` gradient.
        other = self.first if keras_dist.task_id() == 0 else self.second
        return self.shared(x) + other(x)


x = np.random.RandomState(0).rand(64, 4).astype("float32")
model = Branching()
model.build((None, 4))
model.first.build((None, 4))
model.second.build((None, 4))
steps = int(sys.argv[1])
model.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=steps if steps > 1 else None), loss="mse")
model.fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0)
print("finished without error", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "accumulation, second_bias", [(1, True), (2, True), (1, False)], ids=["equal", "equal_accumulating", "unequal"]
)
def test_workers_giving_gradients_to_different_variables_fail_naming_them(tmp_path, accumulation, second_bias):
    """Issue 5 item 6: no hang and no silently wrong sum when workers disagree on which gradients are None.

    With equal gradient sizes the flags summed in the gradients' all-reduce name the variables; with
    unequal sizes (no bias on worker 1's layer) TensorFlow's shape check fails the same collective.
    """
    script = tmp_path / "branching.py"
    source = BRANCHING_SCRIPT
    if not second_bias:
        source = source.replace(
            'Dense(1, name="second_worker_only")', 'Dense(1, use_bias=False, name="second_worker_only")'
        )
    script.write_text(source)
    result = run_launcher(
        ["--num-workers", "2", "--grace-period", "3", str(script), str(accumulation)], env=ENV, timeout=110
    )
    assert result.returncode == 1, result.stdout[-3000:]
    assert "finished without error" not in result.stdout
    if not second_bias:
        lines = [line for line in result.stdout.splitlines() if "The workers are out of step" in line]
        assert lines and "Shape mismatch" in lines[0] and "#gradient-structure" in lines[0], result.stdout[-3000:]
        return
    lines = [line for line in result.stdout.splitlines() if "The workers disagree on which variables receive" in line]
    assert lines, result.stdout[-3000:]
    assert "first_worker_only/kernel" in lines[0] and "second_worker_only/kernel" in lines[0]
    assert "shared/kernel" not in lines[0]
    assert "finished without error" not in result.stdout
