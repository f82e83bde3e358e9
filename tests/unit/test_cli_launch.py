"""`keras-dist launch` without processes: cluster spec, TF_CONFIG, env, argument errors."""

import argparse
import json
import os
import re

import pytest

from keras_dist.cli import main
from keras_dist.cli.launch import (
    build_cluster_spec,
    build_tf_config,
    build_worker_env,
    exit_status_message,
    find_free_ports,
    launch_command_parser,
    launcher_exit_status,
    parse_worker_addresses,
)

SPEC_2 = {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}


def test_find_free_ports_returns_distinct_ports():
    ports = find_free_ports(4)
    assert len(set(ports)) == 4
    assert all(1 <= port <= 65535 for port in ports)


def test_find_free_ports_rejects_zero():
    with pytest.raises(ValueError, match=r"`num_ports` must be an integer >= 1. Received: num_ports=0"):
        find_free_ports(0)


def test_build_cluster_spec_from_ports():
    assert build_cluster_spec(num_workers=2, ports=[2222, 2223]) == SPEC_2
    assert build_cluster_spec(ports=[2222, 2223]) == SPEC_2


def test_build_cluster_spec_from_addresses():
    assert build_cluster_spec(addresses=["a:1", "b:2"]) == {"worker": ["a:1", "b:2"]}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_workers=2), r"needs either `ports`.*Received: num_workers=2, ports=None"),
        (dict(ports=[1], addresses=["a:1"]), r"needs either `ports`"),
        (dict(num_workers=1, addresses=["a:1"]), r"needs either `ports`"),
        (dict(num_workers=0, ports=[]), r"`num_workers` must be an integer >= 1. Received: num_workers=0"),
        (dict(num_workers=3, ports=[1, 2]), r"one port per worker. Received: num_workers=3, ports=\[1, 2\]"),
        (dict(ports=[2222, 2222]), r"must be distinct.*duplicates=\['127.0.0.1:2222'\]"),
        (dict(ports=[70000]), r"port from 1 to 65535. Received: address='127.0.0.1:70000'"),
        (dict(addresses=[]), r"At least one worker address is needed"),
    ],
)
def test_build_cluster_spec_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_cluster_spec(**kwargs)


def test_build_tf_config_is_tf_json():
    config = json.loads(build_tf_config(SPEC_2, "worker", 1))
    assert config == {"cluster": SPEC_2, "task": {"type": "worker", "index": 1}}


@pytest.mark.parametrize(
    "task_type, task_id, match",
    [
        ("chief", 0, r"`task_type` must be a job of the cluster spec. Received: task_type='chief', jobs=\['worker'\]"),
        ("worker", 2, r"`task_id` must be an integer from 0 to 1 .*Received: task_id=2"),
        ("worker", -1, r"Received: task_id=-1"),
        ("worker", True, r"Received: task_id=True"),
    ],
)
def test_build_tf_config_errors(task_type, task_id, match):
    with pytest.raises(ValueError, match=match):
        build_tf_config(SPEC_2, task_type, task_id)


def test_build_worker_env_replaces_inherited_settings():
    base_env = {"PATH": "/bin", "TF_CONFIG": "stale", "KERAS_DIST_CPU_REPLICAS": "8"}
    env = build_worker_env(base_env, cluster_spec=SPEC_2, task_id=1)
    assert json.loads(env["TF_CONFIG"])["task"] == {"type": "worker", "index": 1}
    assert "KERAS_DIST_CPU_REPLICAS" not in env
    assert env["PATH"] == "/bin" and env["PYTHONUNBUFFERED"] == "1"
    assert "KERAS_DIST_STARTUP_TIMEOUT" not in env and "KERAS_DIST_COLLECTIVE_TIMEOUT" not in env
    assert base_env["TF_CONFIG"] == "stale"  # The base is not modified.


def test_build_worker_env_passes_keras_dist_settings():
    env = build_worker_env(
        {}, cluster_spec=SPEC_2, task_id=0, cpu_replicas=3, startup_timeout=30, collective_timeout=2.5
    )
    assert env["KERAS_DIST_CPU_REPLICAS"] == "3"
    assert float(env["KERAS_DIST_STARTUP_TIMEOUT"]) == 30.0
    assert float(env["KERAS_DIST_COLLECTIVE_TIMEOUT"]) == 2.5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cpu_replicas=0), r"`cpu_replicas` must be an integer >= 1. Received: cpu_replicas=0"),
        (
            dict(startup_timeout=0),
            r"`startup_timeout` must be a finite number of seconds > 0. Received: startup_timeout=0",
        ),
        (dict(collective_timeout=float("inf")), r"Received: collective_timeout=inf"),
        (dict(task_id=2), r"Received: task_id=2"),
    ],
)
def test_build_worker_env_errors(kwargs, match):
    kwargs = {"task_id": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        build_worker_env({}, cluster_spec=SPEC_2, **kwargs)


def test_parse_worker_addresses():
    assert parse_worker_addresses(" 10.0.0.1:2222 ,host-b:65535") == ["10.0.0.1:2222", "host-b:65535"]
    assert parse_worker_addresses("[::1]:2222") == ["[::1]:2222"]


@pytest.mark.parametrize(
    "text, match",
    [
        ("host-a", r"must be `host:port`.*Received: address='host-a'. Fix:"),
        (":2222", r"Received: address=':2222'"),
        ("a:0", r"Received: address='a:0'"),
        ("a:65536", r"Received: address='a:65536'"),
        ("a:x", r"Received: address='a:x'"),
        ("a:1,", r"Received: address=''"),
        ("a:1,b:2,a:1", r"must be distinct.*duplicates=\['a:1'\]"),
    ],
)
def test_parse_worker_addresses_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_worker_addresses(text)


@pytest.mark.parametrize(
    "returncode, message, status",
    [
        (0, "worker 0 exited with status 0", 0),
        (3, "worker 0 exited with status 3", 3),
        (-9, "worker 0 was killed by SIGKILL", 137),
        (-15, "worker 0 was killed by SIGTERM", 143),
        (-200, "worker 0 was killed by signal 200", 328),
    ],
)
def test_exit_status_message_and_launcher_status(returncode, message, status):
    assert exit_status_message(0, returncode) == message
    assert launcher_exit_status(returncode) == status


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("pass\n")
    return str(path)


@pytest.mark.parametrize(
    "options, match",
    [
        (["--num-workers", "0"], r"`--num-workers` must be an integer >= 1. Received: --num-workers=0"),
        (["--workers", "a:1,b:2"], r"`--task-index` is required with `--workers`.*Fix: pass --task-index 0"),
        (["--workers", "a:1,b:2", "--task-index", "2"], r"must be from 0 to 1.*Received: --task-index=2"),
        (["--workers", "a:1,b:2", "--task-index", "-1"], r"Received: --task-index=-1"),
        (["--workers", "a:1", "--num-workers", "2", "--task-index", "0"], r"Pass either `--workers`.*not both"),
        (["--workers", "a:1,a:1", "--task-index", "0"], r"must be distinct"),
        (["--task-index", "0"], r"`--task-index` only applies with `--workers`"),
        (["--cpu-replicas", "0"], r"Received: --cpu-replicas=0"),
        (["--startup-timeout", "-1"], r"Received: --startup-timeout=-1.0"),
        (["--collective-timeout", "nan"], r"Received: --collective-timeout=nan"),
        (["--grace-period", "-1"], r"`--grace-period` must be a finite number of seconds >= 0"),
        (["--num-workers", "two"], r"argument --num-workers: invalid int value: 'two'"),
        (
            ["--num-workers", "2", "--min-workers", "3"],
            r"`--min-workers` must be from 1 to the number of workers \(2\)",
        ),
        (["--min-workers", "0"], r"Received: --min-workers=0"),
        (["--workers", "a:1,b:2", "--task-index", "0", "--min-workers", "1"], r"applies to a local launch"),
    ],
)
def test_launch_argument_errors_exit_2_before_starting(options, match, script, capsys):
    with pytest.raises(SystemExit) as exc_info:
        main(["launch", *options, script])
    assert exc_info.value.code == 2
    err = capsys.readouterr().err  # argparse writes the message to stderr.
    assert "keras-dist launch: error:" in err
    assert re.search(match, err), err


def test_launch_rejects_missing_script(capsys):
    with pytest.raises(SystemExit) as exc_info:
        main(["launch", os.path.join("no", "such", "train.py")])
    assert exc_info.value.code == 2
    assert "The script to launch must be an existing file" in capsys.readouterr().err


def test_launch_requires_a_subcommand_and_a_script(capsys):
    for argv in ([], ["launch"]):
        with pytest.raises(SystemExit) as exc_info:
            main(argv)
        assert exc_info.value.code == 2
    assert "required" in capsys.readouterr().err


def test_script_arguments_pass_through_untouched():
    parser = argparse.ArgumentParser()
    launch_command_parser(parser.add_subparsers())
    args = parser.parse_args(["launch", "-m", "pkg.train", "--num-workers", "5", "-h", "--", "x"])
    assert args.module and args.script == "pkg.train"
    assert args.num_workers is None
    assert args.script_args == ["--num-workers", "5", "-h", "--", "x"]
