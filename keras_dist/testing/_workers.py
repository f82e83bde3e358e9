"""Worker processes for tests: a clean environment, several workers on loopback, the launcher.

Owns: `clean_env` (the environment a test's subprocess starts from),
`run_workers` (one process per worker with the launcher's own TF_CONFIG
builders, each worker's exit status and output, a timeout) and `run_launcher`
(`keras-dist launch` as a subprocess, with a timeout). Every process they start
is gone when they return, also after a timeout or an exception.
Must not: import TensorFlow or Keras (a worker runner works without them).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence

from keras_dist import _env, _zygote
from keras_dist._process import stop_process_groups
from keras_dist.cli.launch import build_cluster_spec, build_worker_env, find_free_ports

__all__ = ["LauncherResult", "WorkerResult", "WorkersResult", "clean_env", "run_launcher", "run_workers"]

_POLL_SECONDS = 0.05
_SESSION_PREFIX = _env.PREFIX
_DEFAULTS = {"TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPP_MIN_LOG_LEVEL": "2"}
# Kept: which compat fixes this stack runs (the CI of a stack outside their verified ranges sets it), and the
# test session's directory of zygote servers (keras_dist._zygote: workers forked from a process that imported
# TensorFlow).
_PASSED_THROUGH = (_env.FORCE_FIXES_ENV, _env.ZYGOTE_ENV)


def clean_env(base: Mapping[str, str] | None = None, /, **overrides: str | None) -> dict[str, str]:
    """Returns an environment for a test's subprocess, free of this session's cluster settings.

    Drops `TF_CONFIG` and every `KERAS_DIST_*` variable (CPU replicas, timeouts,
    threads, quiet, disabled fixes, restart count, ...) except `KERAS_DIST_FORCE_FIXES`
    (which compat fixes the installed Keras runs, so that workers run the same) and
    `KERAS_DIST_ZYGOTE` (the test session's zygote servers, `keras_dist._zygote`), then sets
    `TF_ENABLE_ONEDNN_OPTS=0` (oneDNN's kernels round differently at different
    batch sizes, so one device and N replicas would differ by about 1e-3) and
    `TF_CPP_MIN_LOG_LEVEL=2`, then applies `overrides`.

    Args:
        base: Mapping of strings to start from; it is not modified. Defaults to
            `os.environ`.
        **overrides: Variables to set (strings), or `None` to remove one, e.g.
            `KERAS_DIST_QUIET="1"`, `TF_CPP_MIN_LOG_LEVEL="3"`.

    Returns:
        New dict of strings.

    Raises:
        TypeError: An override is neither a string nor `None`.

    Example:
    >>> env = clean_env({"TF_CONFIG": "{}", "KERAS_DIST_CPU_REPLICAS": "2", "HOME": "/h"}, KERAS_DIST_QUIET="1")
    >>> sorted(env.items())  # doctest: +NORMALIZE_WHITESPACE
    [('HOME', '/h'), ('KERAS_DIST_QUIET', '1'), ('TF_CPP_MIN_LOG_LEVEL', '2'), ('TF_ENABLE_ONEDNN_OPTS', '0')]
    """
    base = os.environ if base is None else base
    env = {
        k: v
        for k, v in base.items()
        if k != "TF_CONFIG" and (not k.startswith(_SESSION_PREFIX) or k in _PASSED_THROUGH)
    }
    env.update(_DEFAULTS)
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        elif isinstance(value, str):
            env[name] = value
        else:
            raise TypeError(
                f"Environment overrides must be strings, or None to remove the variable. Received: "
                f"{name}={value!r} of type {type(value).__name__}. Fix: pass {name}={str(value)!r}."
            )
    return env


@dataclasses.dataclass(frozen=True)
class WorkerResult:
    """How one worker of `run_workers` ended.

    Attributes:
        task_id: Integer, the worker's index in the cluster.
        returncode: Integer, as `subprocess.Popen.returncode`: the exit status,
            or `-N` when the worker was killed by signal N (also when
            `run_workers` stopped it).
        output: String, the worker's stdout and stderr, interleaved.
        timed_out: Bool, whether the worker was still running at the timeout.
        stopped: Bool, whether `run_workers` stopped it (timeout, or another
            worker failed with `stop_on_failure=True`).
    """

    task_id: int
    returncode: int
    output: str
    timed_out: bool = False
    stopped: bool = False


@dataclasses.dataclass(frozen=True)
class WorkersResult:
    """What `run_workers` returns: one `WorkerResult` per started worker, in task order.

    Attributes:
        workers: Tuple of `WorkerResult`.
        timed_out: Bool, whether the timeout was reached with a worker still running.
    """

    workers: tuple[WorkerResult, ...]
    timed_out: bool

    @property
    def returncodes(self) -> dict[int, int]:
        """Dict from task_id to `returncode`."""
        return {w.task_id: w.returncode for w in self.workers}

    @property
    def ok(self) -> bool:
        """Whether every worker exited with status 0 before the timeout."""
        return not self.timed_out and all(w.returncode == 0 for w in self.workers)

    def __getitem__(self, task_id: int) -> WorkerResult:
        for worker in self.workers:
            if worker.task_id == task_id:
                return worker
        raise KeyError(f"No worker with task_id={task_id}; started: {[w.task_id for w in self.workers]}.")

    def describe(self, max_chars: int = 3000) -> str:
        """Each worker's status and the last `max_chars` characters of its output, for assertion messages."""
        parts = []
        for w in self.workers:
            how = " (timed out)" if w.timed_out else " (stopped)" if w.stopped else ""
            parts.append(f"--- worker {w.task_id}: returncode {w.returncode}{how}\n{w.output[-max_chars:]}")
        return "\n".join(parts)


def run_workers(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    num_workers: int = 2,
    task_ids: Iterable[int] | None = None,
    cpu_replicas: int | None = None,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    stop_on_failure: bool = True,
    grace_period: float = 5.0,
    cwd: str | os.PathLike[str] | None = None,
) -> WorkersResult:
    """Runs `python script *args` once per worker of a loopback cluster; returns how each ended.

    Each worker gets the environment `keras-dist launch` would give it
    (`keras_dist.cli.launch.build_worker_env`: its own `TF_CONFIG` on free
    127.0.0.1 ports, `PYTHONUNBUFFERED=1`, `KERAS_DIST_CPU_REPLICAS`), and runs in
    its own session. Where the environment has `KERAS_DIST_ZYGOTE` (the test
    suite sets it: `keras_dist._zygote`), the workers are forked from a server
    that imported TensorFlow and Keras once for their environment, instead of
    each starting a new interpreter (about 8 CPU seconds each less). Unlike
    the launcher, this keeps each worker's exit status and output apart, and
    can leave the survivors running when one fails (`stop_on_failure=False`),
    for fault-injection tests. When it returns, every
    worker and every process a worker started is gone: after the timeout or on
    stopping, each worker's process group gets SIGTERM, then SIGKILL after
    `grace_period` seconds.

    Args:
        script: Path of the Python script each worker runs.
        args: Strings passed to the script, the same for every worker.
        num_workers: Integer >= 1, the number of tasks in the cluster. Defaults to 2.
        task_ids: The tasks to start (e.g. `[0]` to leave worker 1 missing).
            Defaults to all of them.
        cpu_replicas: Integer >= 1, simulated CPU replicas per worker, or
            `None` (default, not set).
        timeout: Float > 0, seconds for all workers together. Defaults to 120.
        env: Mapping of strings, the workers' base environment (their cluster
            variables are added to it). Defaults to `clean_env()`.
        stop_on_failure: Bool. `True` (default): stop the others as soon as one
            worker exits with a nonzero status, as `keras-dist launch` does.
            `False`: wait for every worker (until the timeout).
        grace_period: Float >= 0, seconds between SIGTERM and SIGKILL when
            stopping workers. Defaults to 5.
        cwd: Working directory of the workers. Defaults to this process's.

    Returns:
        `WorkersResult`: a `WorkerResult` per started worker, in task order.
        A timeout does not raise: see `timed_out`, or assert `result.ok`.

    Raises:
        ValueError: `num_workers`, `task_ids` or `cpu_replicas` are out of
            range, or `timeout` is not > 0 (before any process starts).

    Example:
    >>> import pathlib, tempfile
    >>> script = pathlib.Path(tempfile.mkdtemp()) / "hello.py"
    >>> _ = script.write_text("import json, os; print(json.loads(os.environ['TF_CONFIG'])['task']['index'])")
    >>> result = run_workers(script, num_workers=2, timeout=60)
    >>> result.returncodes, [w.output.strip() for w in result.workers]
    ({0: 0, 1: 0}, ['0', '1'])
    """
    if not timeout > 0:
        raise ValueError(f"`timeout` must be a number of seconds > 0. Received: timeout={timeout!r}. Fix: pass 120.")
    cluster_spec = build_cluster_spec(num_workers=num_workers, ports=find_free_ports(num_workers))
    task_ids = list(range(num_workers)) if task_ids is None else sorted(task_ids)
    base_env = clean_env() if env is None else env
    envs = {
        i: build_worker_env(base_env, cluster_spec=cluster_spec, task_id=i, cpu_replicas=cpu_replicas) for i in task_ids
    }
    command = [sys.executable, os.fspath(script), *args]
    processes: dict[int, subprocess.Popen | _zygote.ZygoteProcess] = {}
    logs = {}
    timed_out, stopped = set(), set()
    try:
        for i in task_ids:
            logs[i] = tempfile.TemporaryFile()
            with open(os.devnull, "rb") as devnull:
                forked = _zygote.spawn(
                    command,
                    env=envs[i],
                    cwd=cwd,
                    stdin=devnull.fileno(),
                    stdout=logs[i].fileno(),
                    stderr=logs[i].fileno(),
                    directory=base_env.get(_env.ZYGOTE_ENV),
                    slot=i,
                )
            processes[i] = forked or subprocess.Popen(
                command,
                env=envs[i],
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=logs[i],
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            codes = {i: p.poll() for i, p in processes.items()}
            running = {i for i, code in codes.items() if code is None}
            if not running:
                break
            if stop_on_failure and any(code not in (None, 0) for code in codes.values()):
                stopped |= running
                break
            if time.monotonic() >= deadline:
                timed_out |= running
                stopped |= running
                break
            time.sleep(_POLL_SECONDS)
    finally:
        stop_process_groups(processes.values(), grace_period)
        outputs = {}
        for i, log in logs.items():
            log.seek(0)
            outputs[i] = log.read().decode("utf-8", errors="replace")
            log.close()
    return WorkersResult(
        workers=tuple(
            WorkerResult(
                task_id=i,
                returncode=processes[i].returncode,  # type: ignore[arg-type]  # every one was reaped above
                output=outputs[i],
                timed_out=i in timed_out,
                stopped=i in stopped,
            )
            for i in task_ids
        ),
        timed_out=bool(timed_out),
    )


@dataclasses.dataclass(frozen=True)
class LauncherResult:
    """What `run_launcher` returns.

    Attributes:
        args: List of strings, the command that ran.
        returncode: Integer, the launcher's exit status (see `keras_dist.cli.launch`).
        stdout: String: the workers' output, each line prefixed `[worker:<task_id>] `.
        stderr: String: the launcher's own messages (and the timeout's, if any).
        timed_out: Bool, whether the launcher had to be stopped at the timeout.
    """

    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False

    def worker_lines(self, task_id: int) -> list[str]:
        """Lines of `stdout` from worker `task_id`, without their `[worker:<task_id>] ` prefix."""
        prefix = f"[worker:{task_id}] "
        return [line[len(prefix) :] for line in self.stdout.splitlines() if line.startswith(prefix)]


def run_launcher(
    launch_args: Sequence[str],
    *,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    grace_period: float = 30.0,
) -> LauncherResult:
    """Runs `python -m keras_dist.cli launch *launch_args` (the `keras-dist launch` command).

    At the timeout the launcher gets SIGTERM, which it forwards to its workers
    (stopping them within its own `--grace-period`); after `grace_period` more
    seconds it gets SIGKILL. Unlike `subprocess.run`, whose timeout SIGKILLs the
    launcher and leaves its workers running, this leaves no worker behind.

    Args:
        launch_args: Strings after `launch`, e.g.
            `["--num-workers", "2", "train.py", "--epochs", "1"]`.
        timeout: Float > 0, seconds. Defaults to 120.
        env: Mapping of strings, the launcher's environment (the workers
            inherit it). Defaults to `clean_env()`.
        cwd: Working directory of the launcher. Defaults to this process's.
        grace_period: Float >= 0, seconds the launcher has to stop after the
            timeout's SIGTERM. Defaults to 30.

    Returns:
        `LauncherResult` (`returncode`, `stdout`, `stderr`, `timed_out`).
        A timeout does not raise: `timed_out` is set, and `returncode` is the
        launcher's (143 after SIGTERM).

    Raises:
        ValueError: `timeout` is not > 0.
    """
    if not timeout > 0:
        raise ValueError(f"`timeout` must be a number of seconds > 0. Received: timeout={timeout!r}. Fix: pass 120.")
    command = [sys.executable, "-m", "keras_dist.cli", "launch", *launch_args]
    launcher = subprocess.Popen(
        command,
        env=dict(clean_env() if env is None else env),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    timed_out = False
    try:
        stdout, stderr = launcher.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        launcher.terminate()  # The launcher forwards SIGTERM to its workers and waits for them.
        try:
            stdout, stderr = launcher.communicate(timeout=grace_period)
        except subprocess.TimeoutExpired:
            launcher.kill()
            stdout, stderr = launcher.communicate()
        stderr += f"\nkeras_dist.testing.run_launcher: timed out after {timeout:g} s; the launcher was stopped.\n"
    finally:
        if launcher.poll() is None:  # An exception (e.g. KeyboardInterrupt) while waiting.
            launcher.terminate()
            try:
                launcher.wait(timeout=grace_period)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()
    return LauncherResult(command, launcher.returncode, stdout, stderr, timed_out)
