"""The cluster a launch builds: free loopback ports, the cluster spec, each worker's TF_CONFIG and environment.

Owns: pure functions from the launcher's arguments to a cluster spec and one
environment per worker (`keras_dist.cli.launch` and `keras_dist.testing.run_workers`
use them). Must not: import TensorFlow or Keras, or start processes.
"""

import json
import math
import socket

from keras_dist._env import (
    COLLECTIVE_TIMEOUT_ENV,
    CPU_REPLICAS_ENV,
    HEARTBEAT_TIMEOUT_ENV,
    STALL_TIMEOUT_ENV,
    STARTUP_TIMEOUT_ENV,
    WORKER_SLOT_ENV,
)
from keras_dist.cli._threads import INTER_OP_THREADS_ENV, INTRA_OP_THREADS_ENV, check_threads

LOOPBACK = "127.0.0.1"
DEFAULT_NUM_WORKERS = 2
_INHERITED_ENV_TO_DROP = ("TF_CONFIG", CPU_REPLICAS_ENV, WORKER_SLOT_ENV)


def find_free_ports(num_ports, host=LOOPBACK):
    """Returns `num_ports` distinct TCP ports that are free on `host` now.

    Binds port 0 on `num_ports` IPv4 sockets at once, so the OS hands out
    distinct ports, then closes them. Another process could take a port before a
    worker binds it; a worker then fails at startup and the launcher stops all.

    Args:
        num_ports: Integer >= 1, how many ports.
        host: String, the IPv4 address to bind. Defaults to `"127.0.0.1"`.

    Returns:
        List of `num_ports` distinct integers.

    Raises:
        ValueError: `num_ports` is not an integer >= 1.

    Example:
    >>> ports = find_free_ports(3)
    >>> len(set(ports))
    3
    """
    check_positive_int("num_ports", num_ports, fix="pass num_ports=1 or more.")
    sockets = []
    try:
        for _ in range(num_ports):
            sockets.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sockets[-1].bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def build_cluster_spec(*, num_workers=None, ports=None, addresses=None):
    """Returns a TF cluster spec with one `worker` task per address.

    Pass `ports` for local workers on 127.0.0.1 (with `num_workers` to check the
    count), or `addresses` (`host:port` strings, in task order) for a real cluster.

    Args:
        num_workers: Integer >= 1, the number of local workers. Defaults to
            `len(ports)`.
        ports: List of integers, one free port per local worker.
        addresses: List of `host:port` strings; excludes `num_workers` and `ports`.

    Returns:
        Dict `{"worker": [address, ...]}`, as TF_CONFIG's `cluster` expects.

    Raises:
        ValueError: Both or neither of `ports` and `addresses` are given, the
            count does not match `num_workers`, or an address or port is
            malformed or repeated.

    Example:
    >>> build_cluster_spec(num_workers=2, ports=[2222, 2223])
    {'worker': ['127.0.0.1:2222', '127.0.0.1:2223']}
    >>> build_cluster_spec(addresses=["host-a:2222", "host-b:2222"])
    {'worker': ['host-a:2222', 'host-b:2222']}
    """
    if (addresses is None) == (ports is None) or (addresses is not None and num_workers is not None):
        raise ValueError(
            "`build_cluster_spec` needs either `ports` (local workers, optionally with "
            "`num_workers`) or `addresses` (a real cluster). Received: "
            f"num_workers={num_workers!r}, ports={ports!r}, addresses={addresses!r}. "
            "Fix: pass ports=find_free_ports(num_workers), or addresses only."
        )
    if addresses is None:
        ports = list(ports)
        num_workers = len(ports) if num_workers is None else num_workers
        check_positive_int("num_workers", num_workers, fix="pass num_workers=1 or more.")
        if len(ports) != num_workers:
            raise ValueError(
                "`ports` must hold one port per worker. Received: "
                f"num_workers={num_workers}, ports={ports!r}. Fix: pass "
                "ports=find_free_ports(num_workers)."
            )
        addresses = [f"{LOOPBACK}:{port}" for port in ports]
    return {"worker": check_addresses(list(addresses))}


def build_tf_config(cluster_spec, task_type, task_id):
    """Returns the TF_CONFIG JSON string for one task of `cluster_spec`.

    Args:
        cluster_spec: Dict from job name to list of `host:port` strings.
        task_type: String, a job name in `cluster_spec`, e.g. `"worker"`.
        task_id: Integer, the task's index within its job.

    Returns:
        String, JSON `{"cluster": ..., "task": {"type": ..., "index": ...}}`.

    Raises:
        ValueError: `task_type` is not a job of `cluster_spec`, or `task_id`
            is out of range.

    Example:
    >>> build_tf_config({"worker": ["127.0.0.1:2222"]}, "worker", 0)
    '{"cluster": {"worker": ["127.0.0.1:2222"]}, "task": {"type": "worker", "index": 0}}'
    """
    tasks = cluster_spec.get(task_type) or []
    if not tasks:
        raise ValueError(
            "`task_type` must be a job of the cluster spec. Received: "
            f"task_type={task_type!r}, jobs={sorted(cluster_spec)}. Fix: pass one of the jobs."
        )
    if isinstance(task_id, bool) or not isinstance(task_id, int) or not 0 <= task_id < len(tasks):
        raise ValueError(
            f"`task_id` must be an integer from 0 to {len(tasks) - 1} (the job has "
            f"{len(tasks)} tasks). Received: task_id={task_id!r}. Fix: pass an index in range."
        )
    return json.dumps({"cluster": cluster_spec, "task": {"type": task_type, "index": task_id}})


def build_worker_env(
    base_env,
    *,
    cluster_spec,
    task_id,
    cpu_replicas=None,
    startup_timeout=None,
    heartbeat_timeout=None,
    collective_timeout=None,
    threads_per_worker=None,
    stall_timeout=None,
):
    """Returns the environment of worker `task_id`: a copy of `base_env` plus its settings.

    Inherited `TF_CONFIG` and `KERAS_DIST_CPU_REPLICAS` are dropped first, so a
    stale value from the launcher's shell never reaches a worker.

    Args:
        base_env: Mapping of strings, usually `os.environ`; it is not modified.
        cluster_spec: Dict `{"worker": [address, ...]}`.
        task_id: Integer, the worker's index in `cluster_spec["worker"]`.
        cpu_replicas: Integer >= 1, simulated CPU replicas per worker
            (`KERAS_DIST_CPU_REPLICAS`). Defaults to `None` (not set).
        startup_timeout: Float > 0, in seconds (`KERAS_DIST_STARTUP_TIMEOUT`).
            Defaults to `None` (not set).
        heartbeat_timeout: Float > 0, in seconds (`KERAS_DIST_HEARTBEAT_TIMEOUT`).
            Defaults to `None` (not set).
        collective_timeout: Float > 0, in seconds (`KERAS_DIST_COLLECTIVE_TIMEOUT`).
            Defaults to `None` (not set).
        stall_timeout: Float >= 0, in seconds (`KERAS_DIST_STALL_TIMEOUT`; 0 turns
            the stall watchdog off). Defaults to `None` (not set: 60 s).
        threads_per_worker: Integer >= 0, the size of TensorFlow's intra-op
            and inter-op thread pools in this worker (`KERAS_DIST_INTRA_OP_THREADS`
            and `KERAS_DIST_INTER_OP_THREADS`, applied by `import keras_dist`);
            0 removes both variables (TensorFlow's defaults). Defaults to `None`
            (the variables are left as `base_env` has them).

    Returns:
        New dict of strings with `TF_CONFIG`, `PYTHONUNBUFFERED=1` and the
        `KERAS_DIST_*` variables that were given.

    Raises:
        ValueError: `task_id` is out of range, `cpu_replicas` < 1, a timeout
            <= 0, or `threads_per_worker` < 0.

    Example:
    >>> env = build_worker_env({"TF_CONFIG": "stale"}, cluster_spec={"worker": ["127.0.0.1:2222"]},
    ...                        task_id=0, cpu_replicas=2)
    >>> json.loads(env["TF_CONFIG"])["task"], env["KERAS_DIST_CPU_REPLICAS"], env["PYTHONUNBUFFERED"]
    ({'type': 'worker', 'index': 0}, '2', '1')
    """
    env = {name: value for name, value in base_env.items() if name not in _INHERITED_ENV_TO_DROP}
    env["TF_CONFIG"] = build_tf_config(cluster_spec, "worker", task_id)
    env["PYTHONUNBUFFERED"] = "1"
    if cpu_replicas is not None:
        check_positive_int("cpu_replicas", cpu_replicas, fix="pass cpu_replicas=1 or more, or None.")
        env[CPU_REPLICAS_ENV] = str(cpu_replicas)
    for name, env_name, seconds in (
        ("startup_timeout", STARTUP_TIMEOUT_ENV, startup_timeout),
        ("heartbeat_timeout", HEARTBEAT_TIMEOUT_ENV, heartbeat_timeout),
        ("collective_timeout", COLLECTIVE_TIMEOUT_ENV, collective_timeout),
    ):
        if seconds is not None:
            check_seconds(name, seconds)
            env[env_name] = repr(float(seconds))
    if stall_timeout is not None:
        check_seconds("stall_timeout", stall_timeout, allow_zero=True)
        env[STALL_TIMEOUT_ENV] = repr(float(stall_timeout))
    if threads_per_worker is not None:
        check_threads("threads_per_worker", threads_per_worker)
        for name in (INTRA_OP_THREADS_ENV, INTER_OP_THREADS_ENV):
            env.pop(name, None)
            if threads_per_worker:
                env[name] = str(threads_per_worker)
    return env


def parse_worker_addresses(text):
    """Parses `--workers`: comma-separated `host:port` addresses, in task order.

    Args:
        text: String such as `"10.0.0.1:2222,10.0.0.2:2222"`; spaces around
            entries are ignored.

    Returns:
        List of `host:port` strings, one per worker.

    Raises:
        ValueError: An entry is empty, has no host, has a port that is not an
            integer from 1 to 65535, or repeats another entry.

    Example:
    >>> parse_worker_addresses("10.0.0.1:2222, 10.0.0.2:2222")
    ['10.0.0.1:2222', '10.0.0.2:2222']
    """
    return check_addresses([entry.strip() for entry in text.split(",")])


def check_positive_int(name, value, *, fix):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}. Fix: {fix}")


def check_seconds(name, seconds, *, allow_zero=False):
    valid = isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and math.isfinite(seconds)
    if not valid or seconds < 0 or (seconds == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(
            f"`{name}` must be a finite number of seconds {bound}. Received: {name}={seconds!r}. "
            "Fix: pass a value such as 60."
        )


def check_addresses(addresses):
    if not addresses:
        raise ValueError("At least one worker address is needed. Received: addresses=[]. Fix: pass host:port.")
    for address in addresses:
        host, _, port = str(address).rpartition(":")
        if not host or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
            raise ValueError(
                "Each worker address must be `host:port` with an integer port from 1 to 65535. "
                f"Received: address={address!r}. Fix: write it like `10.0.0.1:2222`."
            )
    duplicates = sorted({address for address in addresses if addresses.count(address) > 1})
    if duplicates:
        raise ValueError(
            "Worker addresses must be distinct: each one is a separate worker. "
            f"Received: duplicates={duplicates} in addresses={addresses}. Fix: give each worker its own port."
        )
    return addresses
