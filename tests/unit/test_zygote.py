"""keras_dist._zygote: a worker forked from a server that imported TensorFlow starts as `python script.py` would.

The multi-worker tier forks its workers this way (tests/conftest.py); these tests compare a forked worker with
a new interpreter running the same script, field by field. The runners' own tests run both ways
(tests/unit/test_testing_helpers.py, the `worker_start` fixture).
"""

import glob
import json
import os
import signal
import socket
import sys
import tempfile
import textwrap
import threading
import time

import pytest
from _support import zygote_servers

from keras_dist import _env, _zygote
from keras_dist.testing import clean_env, run_launcher, run_workers

PROBE = """
import atexit, json, os, sys, threading, time
preloaded = "tensorflow" in sys.modules
import numpy as np
import multiprocessing.process as mp_process
out = os.path.join(sys.argv[1], "worker-%d" % json.loads(os.environ["TF_CONFIG"])["task"]["index"])
state = {
    "preloaded": preloaded,
    "keras_dist_imported": "keras_dist" in sys.modules,
    "argv": sys.argv,
    "path0": os.path.relpath(sys.path[0], os.getcwd()),
    "file": [os.path.isabs(__file__), os.path.relpath(__file__, os.getcwd())],
    "stdio": [[s.encoding, s.errors, s.line_buffering] for s in (sys.stdin, sys.stdout, sys.stderr)],
    "pythonpath_entry": os.environ["EXTRA_DIR"] in sys.path,
    "cwd": os.getcwd(),
    "name": __name__,
    "own_session": os.getsid(0) == os.getpid(),
    "process_group": os.getpgid(0) == os.getpid(),
    "cpu_replicas": os.environ.get("KERAS_DIST_CPU_REPLICAS"),
    "stdin": sys.stdin.read(),
    "numpy_draw": int(np.random.randint(1 << 30)),
    "str_hash": hash("kernel"),
    "multiprocessing": [
        os.path.relpath(mp_process.ORIGINAL_DIR, os.getcwd()), mp_process.current_process().authkey.hex()
    ],
}
def at_exit():
    with open(out + ".atexit", "w") as f:
        f.write("ran")
atexit.register(at_exit)
def late():
    time.sleep(0.3)
    with open(out + ".thread", "w") as f:
        f.write("joined")
threading.Thread(target=late).start()
with open(out + ".json", "w") as f:
    json.dump(state, f)
print("to stdout")
print("to stderr", file=sys.stderr)
"""


@pytest.fixture(scope="module")
def zygote_directory():
    with zygote_servers() as directory:
        yield directory


def _run_probe(tmp_path, env):
    script = tmp_path / "scripts" / "probe.py"
    script.parent.mkdir(parents=True)
    script.write_text(PROBE)
    extra = tmp_path / "extra"
    extra.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    env = {**env, "EXTRA_DIR": str(extra), "PYTHONPATH": str(extra)}
    relative = os.path.relpath(script, tmp_path)  # As `python scripts/probe.py` from tmp_path.
    result = run_workers(relative, [str(out), "an argument"], cpu_replicas=2, env=env, cwd=tmp_path, timeout=90)
    assert result.ok, result.describe()
    states = [json.loads((out / f"worker-{i}.json").read_text()) for i in range(2)]
    for i in range(2):
        assert (out / f"worker-{i}.atexit").read_text() == "ran"  # the interpreter's exit ran its handlers
        assert (out / f"worker-{i}.thread").read_text() == "joined"  # and waited for its non-daemon thread
    return result, states


@pytest.mark.timeout(60)
def test_the_socket_appears_only_once_a_connect_succeeds(monkeypatch):
    """A client that finds the server's socket connects at once (before: refused between bind and listen).

    The server then served that worker as a new process instead, unseen: the first test here failed in CI so.
    """
    listen = socket.socket.listen

    def slow_listen(self, *args):  # Widens the window between bind and listen that a loaded machine opens.
        time.sleep(0.5)
        return listen(self, *args)

    monkeypatch.setattr(socket.socket, "listen", slow_listen)
    directory = tempfile.mkdtemp(prefix="kd-zygote-")  # Short: a socket path has at most about 100 bytes.
    path = os.path.join(directory, "server.socket")
    server = threading.Thread(target=_zygote.serve, args=(path, [], {}), daemon=True)
    server.start()
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.001)
        client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            client.connect(path)
        finally:
            client.close()
    finally:
        for name in os.listdir(directory):
            os.remove(os.path.join(directory, name))  # The server exits when its socket is gone.
        os.rmdir(directory)
        server.join(10)
    assert not server.is_alive()


@pytest.mark.timeout(120)
def test_a_forked_worker_starts_as_a_new_interpreter_would(tmp_path, zygote_directory):
    fresh, fresh_states = _run_probe(tmp_path / "fresh", clean_env())
    forked, forked_states = _run_probe(tmp_path / "forked", clean_env(**{_env.ZYGOTE_ENV: zygote_directory}))
    assert [s["preloaded"] for s in fresh_states] == [False, False]
    forked_ok = [s["preloaded"] for s in forked_states] == [True, True]
    assert forked_ok, f"the workers were not forked from the server: {_zygote.fallbacks}"
    for fresh_state, forked_state, i in zip(fresh_states, forked_states, range(2)):
        assert forked_state["argv"] == ["scripts/probe.py", str(tmp_path / "forked" / "out"), "an argument"]
        assert forked_state["cwd"] == str(tmp_path / "forked")
        same = ("keras_dist_imported", "pythonpath_entry", "name", "own_session", "process_group", "path0", "file")
        for name in (*same, "stdio"):
            assert forked_state[name] == fresh_state[name], (name, i)
        assert forked_state["cpu_replicas"] == "2" and forked_state["stdin"] == ""
    assert forked_states[0]["numpy_draw"] != forked_states[1]["numpy_draw"]  # each child reseeded
    for states in (fresh_states, forked_states):  # a hash seed per worker: sets of strings iterate differently
        assert states[0]["str_hash"] != states[1]["str_hash"]
        assert [s["multiprocessing"][0] for s in states] == [".", "."]  # where `spawn` children start
        assert states[0]["multiprocessing"][1] != states[1]["multiprocessing"][1]  # authkey
    for result in (fresh, forked):
        assert [w.output for w in result.workers] == ["to stdout\nto stderr\n"] * 2


EXITS = """
import os, signal, sys
how = sys.argv[1]
if how == "exception":
    raise RuntimeError("raised by the worker")
if how == "exit":
    sys.exit(3)
if how == "signal":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("how", "status"), [("exception", 1), ("exit", 3), ("signal", -signal.SIGKILL), ("end", 0), ("missing", 2)]
)
def test_a_forked_worker_exits_with_the_status_a_new_interpreter_would(tmp_path, zygote_directory, how, status):
    script = tmp_path / "exits.py"
    if how != "missing":
        script.write_text(EXITS)
    result = run_workers(script, [how], num_workers=1, env=clean_env(**{_env.ZYGOTE_ENV: zygote_directory}), timeout=60)
    assert result[0].returncode == status, result.describe()
    if how == "exception":
        assert "RuntimeError: raised by the worker" in result[0].output
        assert result[0].output.startswith("Traceback (most recent call last):")
    if how == "missing":
        assert f"can't open file '{script}': [Errno 2] No such file or directory" in result[0].output


@pytest.mark.timeout(120)
def test_each_environment_read_at_import_gets_a_server_of_its_own(tmp_path, zygote_directory):
    script = tmp_path / "level.py"
    script.write_text("import os, sys; print(os.environ['TF_CPP_MIN_LOG_LEVEL'], 'tensorflow' in sys.modules)")
    before = set(glob.glob(os.path.join(zygote_directory, "*.socket")))
    outputs = []
    for level in ("1", "3", "3"):
        env = clean_env(TF_CPP_MIN_LOG_LEVEL=level, **{_env.ZYGOTE_ENV: zygote_directory})
        result = run_workers(script, num_workers=1, env=env, timeout=60)
        assert result.ok, result.describe()
        outputs.append(result[0].output)
    assert outputs == ["1 True\n", "3 True\n", "3 True\n"]
    assert len(set(glob.glob(os.path.join(zygote_directory, "*.socket"))) - before) == 2
    assert not _zygote.read_at_import("KERAS_DIST_CPU_REPLICAS") and not _zygote.read_at_import("TF_CONFIG")
    assert _zygote.read_at_import("TF_CPP_MIN_LOG_LEVEL") and _zygote.read_at_import("OMP_NUM_THREADS")


@pytest.mark.timeout(120)
def test_the_launcher_relays_forked_workers_and_reports_their_status(tmp_path, zygote_directory):
    script = tmp_path / "launched.py"
    script.write_text(
        textwrap.dedent("""
        import json, os, sys
        task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        print("worker", task, "tensorflow" in sys.modules)
        sys.exit(4 if task == 1 else 0)
        """)
    )
    result = run_launcher(
        ["--num-workers", "2", str(script)], env=clean_env(**{_env.ZYGOTE_ENV: zygote_directory}), timeout=90
    )
    assert result.returncode == 4, result.stderr
    assert result.worker_lines(0) == ["worker 0 True"] and result.worker_lines(1) == ["worker 1 True"]
    assert "worker 1 exited with status 4" in result.stderr


@pytest.mark.timeout(90)
def test_a_command_or_interpreter_the_server_cannot_run_starts_as_a_new_process(tmp_path, zygote_directory):
    read, write = os.pipe()
    try:
        for command in ([sys.executable, "-c", "pass"], ["/bin/true"], [sys.executable, "-X", "dev", "x.py"]):
            assert (
                _zygote.spawn(
                    command, env=clean_env(), stdin=read, stdout=write, stderr=write, directory=zygote_directory
                )
                is None
            )
        assert _zygote.spawn([sys.executable, "x.py"], env=clean_env(), stdin=read, stdout=write, stderr=write) is None
    finally:
        os.close(read)
        os.close(write)


@pytest.mark.timeout(90)
def test_stop_servers_ends_every_server_and_removes_the_directory(tmp_path):
    with zygote_servers() as directory:
        script = tmp_path / "nothing.py"
        script.write_text("")
        assert run_workers(script, num_workers=1, env=clean_env(**{_env.ZYGOTE_ENV: directory}), timeout=60).ok
        pids = [int(open(path).read()) for path in glob.glob(os.path.join(directory, "*.socket.pid"))]
        assert len(pids) == 1
        _zygote.stop_servers(directory)
        assert not os.path.exists(directory)
        for pid in pids:
            assert not os.path.exists(f"/proc/{pid}"), open(f"/proc/{pid}/stat").read()


@pytest.mark.timeout(120)
def test_a_worker_whose_server_died_ends_with_a_status_that_says_so(tmp_path, capsys):
    with zygote_servers() as directory:
        script = tmp_path / "kills_its_server.py"
        script.write_text(
            textwrap.dedent(f"""
            import glob, os, signal, time
            (pid_file,) = glob.glob(os.path.join({directory!r}, "*.socket.pid"))
            os.kill(int(open(pid_file).read()), signal.SIGKILL)
            time.sleep(1)
            """)
        )
        result = run_workers(script, num_workers=1, env=clean_env(**{_env.ZYGOTE_ENV: directory}), timeout=60)
        assert result[0].returncode == _zygote.UNKNOWN_STATUS and not result[0].timed_out, result.describe()
        assert "the zygote server exited before worker" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_request_its_client_gave_up_on_is_not_started(tmp_path, monkeypatch):
    """A client that stops waiting for a slow preload starts the worker itself; the server must not too."""
    with zygote_servers() as directory:
        script = tmp_path / "count.py"
        script.write_text("import os, sys; open(os.path.join(sys.argv[1], str(os.getpid())), 'w').close()")
        out = tmp_path / "out"
        out.mkdir()
        env = clean_env(**{_env.ZYGOTE_ENV: directory})
        monkeypatch.setattr(_zygote, "_REQUEST_SECONDS", 1.0)  # the server's import takes longer
        assert run_workers(script, [str(out)], num_workers=1, env=env, timeout=60).ok
        monkeypatch.setattr(_zygote, "_REQUEST_SECONDS", 60.0)
        assert run_workers(script, [str(out)], num_workers=1, env=env, timeout=60).ok  # served once imported
        assert len(os.listdir(out)) == 2
