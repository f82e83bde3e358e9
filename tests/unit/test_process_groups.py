"""Stopping worker process groups: what a worker leaves behind still gets to write (CI, oldest stack)."""

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from keras_dist._process import _group_has_live_members, stop_process_groups
from keras_dist.cli.launch import find_free_ports

# A worker that starts a helper in its own group and exits at once; the helper ignores SIGTERM and
# writes a line 0.5 s after the worker is gone (the startup watchdog's reporter does the same).
_WORKER = textwrap.dedent(
    """
    import subprocess, sys
    helper = '''
    import signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("helper started", flush=True)
    time.sleep(float(sys.argv[2]))
    open(sys.argv[1], "w").write("written after the worker exited")
    '''
    subprocess.Popen([sys.executable, "-c", helper, sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE).stdout.readline()
    """
)


def _start_worker(path, helper_seconds):
    worker = subprocess.Popen([sys.executable, "-c", _WORKER, str(path), str(helper_seconds)], start_new_session=True)
    worker.wait(timeout=60)
    return worker


@pytest.mark.timeout(60)
def test_stop_waits_for_what_an_exited_worker_left_behind(tmp_path):
    written = tmp_path / "late.txt"
    worker = _start_worker(written, 0.5)
    stop_process_groups([worker], grace_period=20)
    assert written.read_text() == "written after the worker exited"


@pytest.mark.timeout(60)
def test_stop_kills_what_is_left_after_the_grace_period(tmp_path):
    written = tmp_path / "never.txt"
    worker = _start_worker(written, 3600)
    stop_process_groups([worker], grace_period=0.5)
    time.sleep(0.5)
    assert not _group_has_live_members(worker.pid)  # The helper is gone (at most a zombie is left).
    assert not written.exists()


@pytest.mark.timeout(120)
def test_startup_reporter_writes_its_error_after_sigterm():
    from keras_dist._runtime.multi_worker import _REPORT_SCRIPT

    (port,) = find_free_ports(1)
    peers = {"worker:0": f"127.0.0.1:{port}"}
    reporter = subprocess.Popen(
        [sys.executable, "-c", _REPORT_SCRIPT, json.dumps(["worker:1", peers, 5, "KERAS_DIST_STARTUP_TIMEOUT"])],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    _wait_until_ignored(reporter.pid, signal.SIGTERM)
    reporter.send_signal(signal.SIGTERM)  # As when the launcher stops the group of a worker that just exited.
    _, stderr = reporter.communicate(b"Timeout (0:00:06)!\nThread 0x1 (most recent call first):\n", timeout=60)
    assert reporter.returncode == 0
    assert (
        f"WorkerUnavailableError: [worker:1] worker:0 (127.0.0.1:{port}) did not join the cluster within 5 s "
        "(KERAS_DIST_STARTUP_TIMEOUT)" in stderr.decode()
    )


def _wait_until_ignored(pid, signum, timeout=60.0):
    """Waits until process `pid` ignores `signum` (Linux: the SigIgn mask of /proc/PID/status)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as status:
            ignored = int(next(line for line in status if line.startswith("SigIgn:")).split()[1], 16)
        if ignored & (1 << (signum - 1)):
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} did not ignore signal {signum} within {timeout:g} s")
