"""Cluster resolution and validation as pure functions: no server, no process."""

import json

import pytest

from keras_dist import errors
from keras_dist.strategy import _cluster, _peer_errors, _resolve


def _tf_config(cluster, task=None, **extra):
    config = {"cluster": cluster, **extra}
    if task is not None:
        config["task"] = task
    return json.dumps(config)


TWO_WORKERS = {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"]}


def test_workers_only_worker_0_is_chief():
    infos = [_cluster.parse_tf_config(_tf_config(TWO_WORKERS, {"type": "worker", "index": i})) for i in (0, 1)]
    assert [(i.task_type, i.task_id, i.num_workers, i.is_chief) for i in infos] == [
        ("worker", 0, 2, True),
        ("worker", 1, 2, False),
    ]
    assert infos[1].addresses() == {"worker:0": "10.0.0.1:2222", "worker:1": "10.0.0.2:2222"}


def test_kubeflow_tfjob_with_chief_and_environment():
    text = _tf_config(
        {"chief": ["job-chief-0.ns.svc:2222"], "worker": ["job-worker-0.ns.svc:2222"]},
        {"type": "worker", "index": 0},
        environment="cloud",
    )
    info = _cluster.parse_tf_config(text)
    assert info.num_workers == 2 and not info.is_chief
    assert _cluster.parse_tf_config(text.replace('"type": "worker"', '"type": "chief"')).is_chief


def test_single_task_without_task_key():
    info = _cluster.parse_tf_config(_tf_config({"worker": ["localhost:2222"]}))
    assert (info.task_name, info.num_workers, info.is_chief) == ("worker:0", 1, True)


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", "not valid JSON"),
        ('["worker"]', "must be a JSON object, not a list"),
        ('{"cluster": {"worker": ["a:1"]}, "tsak": {}}', r"unknown key\(s\) \['tsak'\]"),
        ('{"task": {"type": "worker", "index": 0}}', "non-empty `cluster`"),
        (_tf_config({"master": ["a:1"]}, {"type": "master", "index": 0}), "calls it `chief`"),
        (_tf_config({"worker": ["a:1"], "ps": ["b:1"]}, {"type": "worker", "index": 0}), "remove the `ps` tasks"),
        (_tf_config({"trainer": ["a:1"]}, {"type": "trainer", "index": 0}), "Unknown task type 'trainer'"),
        (_tf_config({"worker": "a:1,b:2"}, {"type": "worker", "index": 0}), "must be a list"),
        (_tf_config({"worker": ["a", "b:2"]}, {"type": "worker", "index": 0}), "Address 'a'"),
        (_tf_config({"worker": ["a:70000"]}, {"type": "worker", "index": 0}), "port from 1 to 65535"),
        (
            _tf_config({"chief": ["a:1", "b:1"], "worker": ["c:1"]}, {"type": "chief", "index": 0}),
            "at most one `chief`",
        ),
        (_tf_config({"evaluator": ["a:1"]}, {"type": "evaluator", "index": 0}), "lists no `chief` or `worker`"),
        (_tf_config({"worker": ["a:1", "a:1"]}, {"type": "worker", "index": 0}), "worker:0 and worker:1 share"),
        (_tf_config({"chief": ["a:1"], "worker": ["a:1"]}, {"type": "worker", "index": 0}), "chief:0 and worker:0"),
        (_tf_config(TWO_WORKERS), '"task": {"type": ..., "index": ...}'),
        (_tf_config(TWO_WORKERS, {"type": "worker"}), '"task": {"type": ..., "index": ...}'),
        (_tf_config(TWO_WORKERS, {"type": "chief", "index": 0}), "'chief' is not a task type of `cluster`"),
        (_tf_config(TWO_WORKERS, {"type": "worker", "index": "1"}), "must be an integer; got '1'"),
        (_tf_config(TWO_WORKERS, {"type": "worker", "index": True}), "must be an integer"),
        (_tf_config(TWO_WORKERS, {"type": "worker", "index": 2}), "must be 0 to 1"),
        (_tf_config(TWO_WORKERS, {"type": "worker", "index": -1}), "out of range"),
        (
            _tf_config({**TWO_WORKERS, "evaluator": ["e:1"]}, {"type": "evaluator", "index": 0}),
            "side-car evaluation is not supported",
        ),
    ],
)
def test_invalid_tf_config_says_what_and_how_to_fix(text, match):
    with pytest.raises(ValueError, match=match) as raised:
        _cluster.parse_tf_config(text)
    message = str(raised.value)
    assert message.startswith("Invalid TF_CONFIG:")
    assert "Received: TF_CONFIG=" in message and "Fix:" in message


def test_environment_prefers_tf_config_and_defaults_to_local():
    assert _cluster.cluster_from_environment({}) is _cluster.LOCAL
    assert _cluster.cluster_from_environment({"TF_CONFIG": "  "}) is _cluster.LOCAL
    env = {"TF_CONFIG": _tf_config(TWO_WORKERS, {"type": "worker", "index": 1})}
    assert _cluster.cluster_from_environment(env).task_name == "worker:1"


def test_slurm_step_via_tensorflows_resolver(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for name, value in {
        "SLURM_PROCID": "1",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "KERAS_DIST_SLURM_PORT_BASE": "23456",
    }.items():
        monkeypatch.setenv(name, value)
    info = _cluster.cluster_from_environment()
    assert info == _cluster.ClusterInfo(
        cluster={"worker": ("node1:23456", "node2:23456")}, task_type="worker", task_id=1, source="SLURM"
    )


def test_single_task_slurm_job_is_local(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert _cluster.cluster_from_environment() is _cluster.LOCAL


def test_public_role_functions_without_cluster():
    import keras_dist

    assert (keras_dist.task_type(), keras_dist.task_id(), keras_dist.num_workers()) == ("worker", 0, 1)
    assert keras_dist.is_chief() is True
    assert keras_dist.cluster_info() is _cluster.LOCAL


def test_tasks_named_in_tensorflow_message_excludes_self():
    info = _cluster.parse_tf_config(_tf_config(TWO_WORKERS, {"type": "worker", "index": 0}))
    message = (
        "Barrier timed out. The first task at the barrier: /job:worker/replica:0/task:0. "
        "Some timed out task names:\n/job:worker/replica:0/task:1\n/job:worker/replica:0/task:7"
    )
    assert _peer_errors.tasks_named_in(message, info) == ["worker:1"]


def test_worker_unavailable_error_falls_back_to_tcp_probe():
    from keras_dist.cli.launch import find_free_ports

    port = find_free_ports(1)[0]  # closed again: nothing listens there
    info = _cluster.parse_tf_config(
        _tf_config({"worker": ["127.0.0.1:1", f"127.0.0.1:{port}"]}, {"type": "worker", "index": 0})
    )
    timeouts = _resolve.timeouts_from_environment({})
    error = _peer_errors.worker_unavailable_error(info, "Socket closed", during="training", timeouts=timeouts)
    assert isinstance(error, errors.WorkerUnavailableError) and error.missing == ("worker:1",)
    assert str(error).startswith(f"[worker:0] worker:1 (127.0.0.1:{port}) stopped answering or crashed")
    assert "after 30 s without heartbeats, KERAS_DIST_HEARTBEAT_TIMEOUT" in str(error)
    assert "Received from TensorFlow: Socket closed" in str(error)
    assert "same fit/evaluate/predict calls" in str(error)
    collective = _peer_errors.worker_unavailable_error(
        info, "/job:worker/replica:0/task:1 timed out", during="collective", timeouts=timeouts
    )
    assert "did not take part in a collective within 0 s (KERAS_DIST_COLLECTIVE_TIMEOUT)" in str(collective)


def test_timeouts_defaults_and_overrides():
    assert _resolve.timeouts_from_environment({}) == {
        "startup_timeout_seconds": 300.0,
        "heartbeat_timeout_seconds": 30.0,
        "collective_timeout_seconds": 0.0,
    }
    assert (
        _resolve.timeouts_from_environment({"KERAS_DIST_COLLECTIVE_TIMEOUT": "60"})["collective_timeout_seconds"]
        == 60.0
    )


@pytest.mark.parametrize(
    "name, value, match",
    [
        (
            "KERAS_DIST_STARTUP_TIMEOUT",
            "ten",
            r"must be a number of seconds > 0\. Received: KERAS_DIST_STARTUP_TIMEOUT='ten'",
        ),
        ("KERAS_DIST_STARTUP_TIMEOUT", "0", "> 0"),
        ("KERAS_DIST_HEARTBEAT_TIMEOUT", "0.5", "> 0"),
        ("KERAS_DIST_COLLECTIVE_TIMEOUT", "-1", ">= 0"),
        ("KERAS_DIST_COLLECTIVE_TIMEOUT", "nan", ">= 0"),
        ("KERAS_DIST_STARTUP_TIMEOUT", "inf", "> 0"),
    ],
)
def test_bad_timeouts_are_refused(name, value, match):
    with pytest.raises(ValueError, match=match):
        _resolve.timeouts_from_environment({name: value})


SCRIPT = ["python", "train.py"]


def test_join_at_import_skips_local_cli_and_opt_out():
    two = {"TF_CONFIG": _tf_config(TWO_WORKERS, {"type": "worker", "index": 0})}
    assert _resolve.join_cluster_at_import(SCRIPT, {}) is None
    assert _resolve.join_cluster_at_import(["python", "/usr/bin/keras-dist", "env"], two) is None
    assert _resolve.join_cluster_at_import(["python", "-m", "keras_dist.cli", "env"], two) is None
    assert _resolve.join_cluster_at_import(SCRIPT, {**two, "KERAS_DIST_JOIN_AT_IMPORT": "0"}) is None
    single = {"TF_CONFIG": _tf_config({"worker": ["a:1"]}, {"type": "worker", "index": 0})}
    assert _resolve.join_cluster_at_import(SCRIPT, single) is None


@pytest.mark.parametrize(
    "orig_argv, expected",
    [
        (["python", "-m", "keras_dist.cli", "launch"], True),
        (["python", "-u", "-mkeras_dist.cli", "env"], True),
        (["python", "-X", "importtime", "-W", "ignore", "-m", "keras_dist.cli", "env"], True),
        (["/venv/bin/python", "/venv/bin/keras-dist", "launch"], True),
        (["python", "-m", "mypackage.train"], False),  # keras_dist imported by mypackage/__init__.py
        (["python", "train.py", "-m", "keras_dist.cli"], False),
        (["python", "-c", "import keras_dist"], False),
    ],
)
def test_keras_dist_command_is_recognised_from_the_interpreter_command_line(orig_argv, expected):
    from keras_dist._process import is_keras_dist_command

    assert is_keras_dist_command(orig_argv) is expected


def test_join_at_import_validates_before_starting_anything():
    with pytest.raises(ValueError, match="Invalid TF_CONFIG"):
        _resolve.join_cluster_at_import(SCRIPT, {"TF_CONFIG": "{bad"})
    with pytest.raises(ValueError, match="KERAS_DIST_HEARTBEAT_TIMEOUT"):
        _resolve.join_cluster_at_import(SCRIPT, {"KERAS_DIST_HEARTBEAT_TIMEOUT": "x"})
