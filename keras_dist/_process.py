"""Process helpers without TensorFlow: whether this is the `keras-dist` command; stopping worker groups."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from keras_dist._env import RESTART_COUNT_ENV as RESTART_COUNT_ENV  # Set by `keras-dist launch`; re-exported.

CLI_MODULE = "keras_dist.cli"
RESTART_EXIT_STATUS = 75  # EX_TEMPFAIL (sysexits.h): a worker saved its state and asks to be started again.


def is_keras_dist_command(orig_argv: Sequence[str] | None = None) -> bool:
    """Returns whether the process was started as `keras-dist ...` or `python -m keras_dist.cli ...`.

    Args:
        orig_argv: List of strings, the interpreter's original command line.
            Defaults to `sys.orig_argv`.

    Example:
    >>> is_keras_dist_command(["python", "-m", "keras_dist.cli", "launch"])
    True
    >>> is_keras_dist_command(["python", "-m", "mypackage.train"])
    False
    """
    argv = list(sys.orig_argv if orig_argv is None else orig_argv)
    if len(argv) > 1 and os.path.basename(argv[1]) == "keras-dist":  # python .../bin/keras-dist
        return True
    if argv and os.path.basename(argv[0]) == "keras-dist":
        return True
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("-m"):
            module = arg[2:] or (argv[i + 1] if i + 1 < len(argv) else "")
            return module in (CLI_MODULE, "keras_dist")
        if not arg.startswith("-") or arg == "-c":
            return False  # a script or -c: the interpreter's own options end here
        i += 2 if arg in _OPTIONS_WITH_VALUE else 1
    return False


_OPTIONS_WITH_VALUE = ("-X", "-W", "--check-hash-based-pycs")


_GROUP_POLL_SECONDS = 0.05


class Process(Protocol):
    """What the helpers below need of a process: `subprocess.Popen`, or `keras_dist._zygote.ZygoteProcess`."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def signal_process_groups(processes: Iterable[Process], signum: int) -> None:
    """Sends `signum` to the process group of each process (each started with `start_new_session=True`).

    A group whose every member has exited is skipped silently.

    Args:
        processes: `subprocess.Popen` (or `ZygoteProcess`) objects, each the leader of its own group.
        signum: Integer, a signal number such as `signal.SIGTERM`.
    """
    for process in processes:
        try:
            os.killpg(process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # The whole group has exited already.


def stop_process_groups(
    processes: Iterable[Process],
    grace_period: float,
    *,
    signum: int = signal.SIGTERM,
    on_overdue: Callable[[Process], None] | None = None,
) -> None:
    """Sends `signum` to each process's group, waits for the groups, SIGKILLs what is left, reaps the leaders.

    The wait covers each whole group, not only its leader: a process a worker
    left behind (such as the reporter of `keras_dist._runtime.multi_worker`'s
    startup watchdog, which writes the worker's error just after the worker
    exits) gets up to `grace_period` seconds to finish, also when the worker
    itself had already exited. Zombies do not count as members (Linux).

    Args:
        processes: `subprocess.Popen` (or `ZygoteProcess`) objects, each
            started with `start_new_session=True` (its own process group).
        grace_period: Float >= 0, seconds from `signum` to SIGKILL.
        signum: Integer, the first signal. Defaults to SIGTERM.
        on_overdue: Called with each process whose leader was still running
            at the end of the grace period, before the SIGKILL (the launcher
            says so on stderr). Defaults to none.
    """
    processes = list(processes)
    signal_process_groups(processes, signum)
    deadline = time.monotonic() + grace_period
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            if on_overdue is not None:
                on_overdue(process)
    while time.monotonic() < deadline and any(_group_has_live_members(p.pid) for p in processes):
        time.sleep(_GROUP_POLL_SECONDS)
    signal_process_groups(processes, signal.SIGKILL)  # Also reaches children a worker left behind.
    for process in processes:
        process.wait()


def _group_has_live_members(pgid):
    """Whether process group `pgid` has a member that is not a zombie (orphaned zombies wait for init)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True  # No /proc (macOS): a zombie member counts until the grace period ends.
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat:
                fields = stat.read().rpartition(")")[2].split()
        except OSError:
            continue  # Exited meanwhile.
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False
