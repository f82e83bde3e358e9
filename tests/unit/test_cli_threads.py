"""CPU threads per worker: the launcher's arithmetic and environment, the worker's reading of it (no launches)."""

import re

import pytest

from keras_dist import errors
from keras_dist._runtime import threads as runtime_threads
from keras_dist.cli import launch, main
from keras_dist.cli._threads import INTER_OP_THREADS_ENV, INTRA_OP_THREADS_ENV, threads_for_launch
from keras_dist.cli.launch import build_worker_env, threads_per_worker

SPEC_2 = {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}


@pytest.mark.parametrize(
    "num_local_workers, cpu_count, requested, expected",
    [
        (2, 2, None, 1),
        (2, 16, None, 8),
        (3, 16, None, 5),  # Floor: never more threads than cores in total.
        (4, 2, None, 1),  # At least 1, even with more workers than cores.
        (1, 16, None, 0),  # One worker on the host keeps TensorFlow's defaults.
        (2, 16, 0, 0),  # The flag's 0: TensorFlow's defaults.
        (2, 16, 3, 3),
        (1, 16, 3, 3),
    ],
)
def test_threads_per_worker_shares_the_cores(num_local_workers, cpu_count, requested, expected):
    assert threads_per_worker(num_local_workers, cpu_count, requested) == expected


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 2), r"`num_local_workers` must be an integer >= 1. Received: num_local_workers=0"),
        ((2, 0), r"`cpu_count` must be an integer >= 1. Received: cpu_count=0"),
        ((2, 2, -1), r"`requested` must be an integer >= 0.*Received: requested=-1. Fix:"),
        ((2, 2, 1.5), r"Received: requested=1.5"),
    ],
)
def test_threads_per_worker_errors(args, match):
    with pytest.raises(ValueError, match=match):
        threads_per_worker(*args)


def test_build_worker_env_sets_and_removes_thread_variables():
    env = build_worker_env({}, cluster_spec=SPEC_2, task_id=1, threads_per_worker=2)
    assert env[INTRA_OP_THREADS_ENV] == env[INTER_OP_THREADS_ENV] == "2"
    inherited = {INTRA_OP_THREADS_ENV: "7", INTER_OP_THREADS_ENV: "7"}
    env = build_worker_env(inherited, cluster_spec=SPEC_2, task_id=0, threads_per_worker=0)
    assert INTRA_OP_THREADS_ENV not in env and INTER_OP_THREADS_ENV not in env
    env = build_worker_env(inherited, cluster_spec=SPEC_2, task_id=0)  # None: left as inherited.
    assert env[INTRA_OP_THREADS_ENV] == "7"
    with pytest.raises(
        ValueError, match=r"`threads_per_worker` must be an integer >= 0.*Received: threads_per_worker=-2"
    ):
        build_worker_env({}, cluster_spec=SPEC_2, task_id=0, threads_per_worker=-2)


def test_threads_for_launch_precedence(monkeypatch):
    monkeypatch.setattr("keras_dist.cli._threads.host_cpu_count", lambda: 8)
    assert threads_for_launch(2, None, {}) == 4  # Default: shared out.
    assert threads_for_launch(2, None, {INTRA_OP_THREADS_ENV: "3"}) is None  # Exported by the user: kept.
    assert threads_for_launch(2, 0, {INTRA_OP_THREADS_ENV: "3"}) == 0  # The flag wins.
    assert threads_for_launch(1, None, {}) == 0  # A cluster launch: one worker on this host.


class _CapturingGroup:
    envs = None

    def __init__(self, grace_period):
        del grace_period

    def run(self, command, envs):
        _CapturingGroup.envs = envs
        return 0


@pytest.mark.parametrize(
    "flag, expected", [([], "4"), (["--threads-per-worker", "2"], "2"), (["--threads-per-worker", "0"], None)]
)
def test_launch_passes_threads_to_every_worker(flag, expected, monkeypatch, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    monkeypatch.setattr(launch, "WorkerGroup", _CapturingGroup)
    monkeypatch.setattr("keras_dist.cli._threads.host_cpu_count", lambda: 8)
    monkeypatch.delenv(INTRA_OP_THREADS_ENV, raising=False)
    monkeypatch.delenv(INTER_OP_THREADS_ENV, raising=False)
    assert main(["launch", "--num-workers", "2", *flag, str(script)]) == 0
    assert len(_CapturingGroup.envs) == 2
    for env in _CapturingGroup.envs.values():
        assert env.get(INTRA_OP_THREADS_ENV) == expected and env.get(INTER_OP_THREADS_ENV) == expected


def test_launch_rejects_negative_threads(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    with pytest.raises(SystemExit) as exc_info:
        main(["launch", "--threads-per-worker", "-1", str(script)])
    assert exc_info.value.code == 2
    assert re.search(
        r"`--threads-per-worker` must be an integer >= 0.*Received: --threads-per-worker=-1", capsys.readouterr().err
    )


def test_requested_threads_reads_the_environment():
    assert runtime_threads.requested_threads({}) == {"intra_op": None, "inter_op": None}
    environ = {INTRA_OP_THREADS_ENV: "2", INTER_OP_THREADS_ENV: "0"}
    assert runtime_threads.requested_threads(environ) == {"intra_op": 2, "inter_op": None}
    for raw in ("-1", "two"):
        with pytest.raises(
            ValueError,
            match=rf"`{INTRA_OP_THREADS_ENV}` must be an integer >= 0.*Received: {INTRA_OP_THREADS_ENV}='{raw}'",
        ):
            runtime_threads.requested_threads({INTRA_OP_THREADS_ENV: raw})


def test_apply_requested_threads_too_late_warns_and_keeps_defaults():
    import tensorflow as tf

    tf.constant(1.0) + 1.0  # TensorFlow's context is initialized in the unit tier.
    current = tf.config.threading.get_intra_op_parallelism_threads()
    with pytest.warns(
        errors.KerasDistWarning,
        match=r"could not set TensorFlow's intra-op threads to \d+.*Fix: put `import keras_dist`",
    ):
        applied = runtime_threads.apply_requested_threads({INTRA_OP_THREADS_ENV: str(current + 3)})
    assert applied == {"intra_op": None, "inter_op": None}
    assert tf.config.threading.get_intra_op_parallelism_threads() == current
