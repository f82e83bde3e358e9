"""SIGTERM must stop a worker that joined a cluster (TensorFlow's preemption notifier swallows it)."""

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.compat, pytest.mark.multi_worker]

WORKER = os.path.join(os.path.dirname(__file__), os.pardir, "integration", "mw_worker.py")
GRACE_PERIOD = 15


def _seconds_to_stop_after_sigterm(tmp_path, disabled_fixes):
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "KERAS_DIST_CPU_REPLICAS")},
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "KERAS_DIST_QUIET": "1",
        "KERAS_DIST_DISABLE_FIXES": disabled_fixes,
    }
    command = [
        sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", "2",
        "--grace-period", str(GRACE_PERIOD), WORKER, str(tmp_path),
        "--die-at-batch", "-1", "--die-task-id", "0",  # trains for 1000 epochs, never dies
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
        start = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=GRACE_PERIOD + 30) == 143
        return time.monotonic() - start, launcher.stdout.read()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


@pytest.mark.timeout(120)
def test_without_fix_workers_ignore_sigterm_until_sigkill(tmp_path):
    seconds, output = _seconds_to_stop_after_sigterm(tmp_path, "sigterm_default_action")
    assert seconds >= GRACE_PERIOD, output[-2000:]


@pytest.mark.timeout(120)
def test_with_fix_sigterm_stops_workers_at_once(tmp_path):
    seconds, output = _seconds_to_stop_after_sigterm(tmp_path, "")
    assert seconds < GRACE_PERIOD / 2, output[-2000:]
