"""SIGTERM must stop a worker that joined a cluster (TensorFlow's preemption notifier swallows it)."""

import signal
import subprocess
import sys
import time

import pytest
from helpers import MW_WORKER, multi_worker_env

pytestmark = [pytest.mark.compat, pytest.mark.multi_worker]

GRACE_PERIOD = 15


def _launcher_output_after_sigterm(tmp_path, disabled_fixes):
    """Starts 2 training workers, sends SIGTERM to the launcher, returns its output."""
    env = multi_worker_env(disabled_fixes)
    command = [
        sys.executable,
        "-m",
        "keras_dist.cli",
        "launch",
        "--num-workers",
        "2",
        "--grace-period",
        str(GRACE_PERIOD),
        MW_WORKER,
        str(tmp_path),
        "--die-at-batch",
        "-1",
        "--die-task-id",
        "0",  # trains for 1000 epochs, never dies
    ]
    launcher = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        training = set()
        deadline = time.monotonic() + 90
        while len(training) < 2 and time.monotonic() < deadline:
            line = launcher.stdout.readline()
            if "] training worker:" in line:
                training.add(line.split()[0])
        assert len(training) == 2, "workers did not start training"
        time.sleep(2)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=GRACE_PERIOD + 30) == 143
        return launcher.stdout.read()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


@pytest.mark.timeout(120)
def test_without_fix_workers_ignore_sigterm_until_sigkill(tmp_path):
    output = _launcher_output_after_sigterm(tmp_path, "sigterm_default_action")
    assert f"did not exit within {GRACE_PERIOD} s; sending SIGKILL" in output, output[-2000:]


@pytest.mark.timeout(120)
def test_with_fix_sigterm_stops_workers(tmp_path):
    output = _launcher_output_after_sigterm(tmp_path, "")
    assert "sending SIGKILL" not in output, output[-2000:]
