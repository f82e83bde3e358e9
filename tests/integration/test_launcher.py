"""`keras-dist launch` end to end, with tiny worker scripts that do not import TensorFlow.

Each test runs the launcher as `python -m keras_dist.cli launch ...` and checks
output prefixes, exit status, signal forwarding and that no worker outlives it.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from keras_dist.cli.launch import find_free_ports
from keras_dist.testing import clean_env, run_launcher

pytestmark = pytest.mark.multi_worker

LAUNCHER = [sys.executable, "-m", "keras_dist.cli", "launch"]
# New interpreters, as a user's launch starts them: the launcher's own tests keep that path covered on
# workers (the rest of the tier forks its workers from the session's zygote servers, tests/conftest.py).
ENV = clean_env(TF_CPP_MIN_LOG_LEVEL="3", KERAS_DIST_QUIET="1", KERAS_DIST_ZYGOTE=None)

# Shared by the worker scripts: who am I, and a helper to wait for a file.
PREAMBLE = """
import json, os, signal, sys, time
TASK_ID = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
DIR = sys.argv[1]

def write(name, text=""):
    with open(os.path.join(DIR, name + ".tmp"), "w") as f:
        f.write(str(text))
    os.replace(os.path.join(DIR, name + ".tmp"), os.path.join(DIR, name))

def wait_for(name, timeout=30):
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(DIR, name)):
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {name}")
        time.sleep(0.05)
"""


def _script(tmp_path, body):
    path = tmp_path / "worker.py"
    path.write_text(PREAMBLE + body)
    return str(path)


def _run(options, script_and_args, timeout=60):
    return run_launcher([*options, *script_and_args], env=ENV, timeout=timeout)


def _assert_gone(pid):
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _wait_for_files(paths, timeout):
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(path) for path in paths):
        assert time.monotonic() < deadline, f"timed out waiting for {paths}"
        time.sleep(0.05)


@pytest.mark.timeout(90)
def test_two_workers_get_their_tf_config_and_prefixed_output(tmp_path):
    script = _script(
        tmp_path,
        """
config = json.loads(os.environ["TF_CONFIG"])
print(json.dumps({"task": config["task"], "cluster": config["cluster"],
                  "cpu_replicas": os.environ.get("KERAS_DIST_CPU_REPLICAS"), "argv": sys.argv[2:]}))
print("to stderr", file=sys.stderr)
sys.stdout.write("last line without newline")
""",
    )
    result = _run(["--num-workers", "2", "--cpu-replicas", "3"], [script, str(tmp_path), "--epochs", "3"])
    assert result.returncode == 0, result.stdout + result.stderr
    reports = []
    for task_id in (0, 1):
        lines = result.worker_lines(task_id)
        assert sorted(lines[1:]) == ["last line without newline", "to stderr"], result.stdout
        reports.append(json.loads(lines[0]))
    assert [report["task"] for report in reports] == [{"type": "worker", "index": i} for i in (0, 1)]
    assert all(report["cpu_replicas"] == "3" and report["argv"] == ["--epochs", "3"] for report in reports)
    workers = reports[0]["cluster"]["worker"]
    assert reports[1]["cluster"]["worker"] == workers
    assert len(set(workers)) == 2 and all(address.startswith("127.0.0.1:") for address in workers)


@pytest.mark.timeout(90)
def test_module_mode_runs_python_dash_m(tmp_path):
    (tmp_path / "my_trainer.py").write_text("import os; print('module', os.environ.get('KERAS_DIST_CPU_REPLICAS'))\n")
    result = run_launcher(["--num-workers", "1", "-m", "my_trainer"], env=ENV, cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.worker_lines(0) == ["module None"]


@pytest.mark.timeout(90)
def test_failing_worker_stops_the_others_and_sets_the_exit_status(tmp_path):
    script = _script(
        tmp_path,
        """
if TASK_ID == 0:
    write("pid0", os.getpid())
    time.sleep(70)  # Longer than _run's 60 s timeout: only the launcher can end it in time.
else:
    wait_for("pid0")
    sys.exit(3)
""",
    )
    result = _run([], [script, str(tmp_path)])
    assert result.returncode == 3, result.stdout + result.stderr
    assert "keras-dist launch: worker 1 exited with status 3; stopping the other workers." in result.stderr
    _assert_gone(int((tmp_path / "pid0").read_text()))


@pytest.mark.timeout(90)
def test_worker_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path):
    script = _script(
        tmp_path,
        """
if TASK_ID == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    write("pid0", os.getpid())
    time.sleep(60)
else:
    wait_for("pid0")
    os.kill(os.getpid(), signal.SIGKILL)
""",
    )
    result = _run(["--grace-period", "2"], [script, str(tmp_path)])
    assert result.returncode == 137, result.stdout + result.stderr
    assert "worker 1 was killed by SIGKILL; stopping the other workers." in result.stderr
    assert "worker 0 did not exit within 2 s; sending SIGKILL." in result.stderr
    _assert_gone(int((tmp_path / "pid0").read_text()))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_signal_to_launcher_reaches_every_worker(tmp_path, signum, status):
    script = _script(
        tmp_path,
        f"""
def on_signal(received, frame):
    write(f"got{{TASK_ID}}", signal.Signals(received).name)
    sys.exit(0)

signal.signal({int(signum)}, on_signal)
write(f"pid{{TASK_ID}}", os.getpid())
time.sleep(60)
""",
    )
    launcher = subprocess.Popen(
        [*LAUNCHER, "--num-workers", "2", script, str(tmp_path)],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_files([tmp_path / "pid0", tmp_path / "pid1"], timeout=40)
        launcher.send_signal(signum)
        stdout, stderr = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.terminate()  # Lets the launcher stop its workers.
            launcher.communicate(timeout=30)
    assert launcher.returncode == status, stdout + stderr
    assert f"received {signum.name}; forwarding it to the workers." in stderr
    for task_id in (0, 1):
        assert (tmp_path / f"got{task_id}").read_text() == signum.name
        _assert_gone(int((tmp_path / f"pid{task_id}").read_text()))


@pytest.mark.timeout(90)
def test_cluster_mode_starts_only_the_given_task(tmp_path):
    script = _script(
        tmp_path,
        """
print(os.environ["TF_CONFIG"])
""",
    )
    workers = [f"127.0.0.1:{port}" for port in find_free_ports(2)]
    result = _run(["--workers", ",".join(workers), "--task-index", "1"], [script, str(tmp_path)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.worker_lines(0) == []
    (line,) = result.worker_lines(1)
    assert json.loads(line) == {"cluster": {"worker": workers}, "task": {"type": "worker", "index": 1}}


@pytest.mark.timeout(120)
def test_elastic_launch_drops_a_slot_that_keeps_failing_and_goes_on(tmp_path):
    # Slot 1 fails at every start; slot 2 fails once. Each start records (attempt, slot, task, workers).
    script = _script(
        tmp_path,
        """
slot, attempt = os.environ["KERAS_DIST_WORKER_SLOT"], os.environ["KERAS_DIST_RESTART_COUNT"]
workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
write(f"start-{attempt}-{slot}", f"{TASK_ID} {workers}")
if slot == "1" or (slot == "2" and attempt == "0"):
    sys.exit(3)
""",
    )
    result = _run(["--num-workers", "3", "--max-restarts", "1", "--min-workers", "2"], [script, str(tmp_path)])
    assert result.returncode == 0, result.stdout + result.stderr
    starts = {p.name: p.read_text() for p in tmp_path.glob("start-*")}
    # Whether slot 1 or 2 is blamed for attempt 0 (both fail at once), slot 1's second failure drops it,
    # and the last attempt runs slots 0 and 2 as workers 0 and 1 of 2.
    last = max(int(name.split("-")[1]) for name in starts)
    assert {n: t for n, t in starts.items() if n.startswith(f"start-{last}-")} == {
        f"start-{last}-0": "0 2",
        f"start-{last}-2": "1 2",
    }, (starts, result.stderr)
    assert "worker slot 1 failed 2 times (its 1 restart is used up): continuing with 2 workers instead of 3" in (
        result.stderr
    )
    assert "(slots 0, 2 as workers 0-1; --min-workers 2)" in result.stderr


@pytest.mark.timeout(120)
def test_elastic_launch_stops_below_min_workers(tmp_path):
    script = _script(
        tmp_path,
        """
workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
if os.environ["KERAS_DIST_WORKER_SLOT"] == "1":
    sys.exit(3)
if workers == 1:
    sys.exit(5)
wait_for("never", timeout=50)
""",
    )
    # --min-workers equal to the count: the fixed policy (one restart in all), then slot 1's status.
    result = _run(["--num-workers", "2", "--max-restarts", "1", "--min-workers", "2"], [script, str(tmp_path)])
    assert result.returncode == 3, result.stdout + result.stderr
    assert result.stderr.count("restarting all workers (restart 1 of 1)") == 1
    result = _run(["--num-workers", "2", "--max-restarts", "0", "--min-workers", "1"], [script, str(tmp_path)])
    assert result.returncode == 5, result.stdout + result.stderr
    assert "worker slot 1 failed 1 time (its 0 restarts are used up): continuing with 1 worker instead of 2" in (
        result.stderr
    )
    assert "worker slot 0 failed 1 time (its 0 restarts are used up), and 0 workers would remain, fewer than" in (
        result.stderr
    )
