"""Base layer: start Python workers from a process that has imported TensorFlow once (a test harness's zygote).

Owns: the zygote server (this file run as a script by `start_server`), which
imports the modules every worker imports (TensorFlow and Keras, about 8 CPU
seconds a process on a small machine), listens on a Unix socket, and forks one
child per request, each a fresh program: its own session, standard streams,
environment, working directory, `sys.argv`, `sys.path`, reseeded random
generators, and the interpreter's normal exit (atexit handlers, non-daemon
threads, flushed streams); and the client, `spawn`, which finds or starts the
server for a worker's environment in a directory, asks it for the worker, and
returns a `ZygoteProcess` (what `subprocess.Popen` offers the launcher and the
test runners: `pid`, `poll`, `wait`, `returncode`). Must not: import TensorFlow
or Keras in the client (the launcher runs without them), or import the keras_dist
package in the server (its import applies the first worker's variables); serve a
request whose environment differs from the server's in a variable that may be
read at import (`read_at_import`: such an environment gets a server of its own,
as does each worker slot, for a hash seed of its own).

Who uses it: the test suite. `tests/conftest.py` sets `KERAS_DIST_ZYGOTE` to a
directory for a session that may run multi-worker tests; then
`keras_dist.testing.run_workers` and `keras-dist launch` (`cli/_worker_group.py`)
start their workers through it, and the session stops the servers at its end
(they also exit with it when it is killed: `set_owner`). Nothing else sets the
variable, so a user's launch always starts its workers with `subprocess.Popen`.

Why not `multiprocessing`'s forkserver: it runs a pickled Python function, not a
script; only the process that started it can use it (here the launcher, a
separate process, must); it serves one environment; and its children leave with
`os._exit` after the function, so a worker's atexit handlers and non-daemon
threads would not run as they do in `python script.py`.

What happens on each worker: nothing is exchanged between workers. A worker
started here differs from one started by `subprocess.Popen` in that its parent
is the server, not the caller (the caller learns its exit status from the
server; a worker that signals `os.getppid()` reaches the server, so a test that
does so starts its workers as new interpreters), and in that the preloaded
modules are already in `sys.modules` when its script starts.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import typing
from collections.abc import Mapping, Sequence

__all__ = ["ZygoteProcess", "read_at_import", "serve", "spawn", "set_owner", "start_server", "stop_servers"]

# Modules the server imports before it forks: what every worker imports first.
DEFAULT_PRELOAD = ("tensorflow", "keras")
# Variables that TensorFlow, Keras, NumPy, their libraries or the interpreter may read while the preload is
# imported: a request must carry the server's values. Others (PATH, PWD, PYTEST_CURRENT_TEST, ...) may differ.
_READ_AT_IMPORT = (
    "TF_",
    "KERAS_",
    "XLA_",
    "CUDA_",
    "NVIDIA_",
    "TPU_",
    "OMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "GOTO_",
    "LD_",
    "PYTHON",
    "HOME",
    "LANG",
    "LC_",
    "TMPDIR",
)
# Of those, read after the preload (by keras_dist, which is not preloaded; by TensorFlow's cluster resolver
# when the strategy is made; by the child, which sets up its streams and sys.path again): may differ.
_READ_LATER = ("TF_CONFIG", "PYTHONUNBUFFERED", "PYTHONPATH")
_MAX_MESSAGE = 1 << 17  # Bytes: a request is one datagram (the environment, about 5 KB, and the command).
_REQUEST_SECONDS = 60.0  # The first request waits for the server's preload (about 8 s on 2 cores).
_START_SECONDS = 10.0  # For a new server's socket to appear.
_IDLE_EXIT_SECONDS = 1800.0  # A server left behind (no owner set, its client killed) exits after this long idle.
_OWNER_FILE = "owner.pid"
# A worker's exit status when its server exited first (no one can learn it then): EX_SOFTWARE (sysexits.h).
UNKNOWN_STATUS = 70
_POLL_SECONDS = 0.05
_HASH_SEED = "PYTHONHASHSEED"


def read_at_import(name: str) -> bool:
    """Whether a request's variable `name` must equal the server's (it may be read while the preload is imported).

    Compared: the variables of TensorFlow, Keras, XLA, CUDA, OpenMP, MKL,
    OpenBLAS, the dynamic loader and the interpreter, and `HOME`, `LANG`,
    `LC_*`, `TMPDIR`; not compared: `TF_CONFIG` (read when the strategy is made),
    every `KERAS_DIST_*` variable (keras_dist is imported by the child),
    `PYTHONUNBUFFERED` and `PYTHONPATH` (the child applies them), and anything
    else (`PATH`, `PYTEST_CURRENT_TEST`, ...).

    Example:
    >>> read_at_import("TF_ENABLE_ONEDNN_OPTS"), read_at_import("TF_CONFIG"), read_at_import("KERAS_DIST_QUIET")
    (True, False, False)
    """
    from keras_dist._env import PREFIX  # Here, not above: the server runs this file without the package.

    if name in _READ_LATER or name.startswith(PREFIX):
        return False
    return name.startswith(_READ_AT_IMPORT)


def _import_env(env: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if read_at_import(name)}


# ------------------------------------------------------------------ client


class ZygoteProcess:
    """A worker started by a zygote server: the part of `subprocess.Popen` the launcher and tests use.

    Attributes:
        args: List of strings, the command line the worker runs as.
        pid: Integer, the worker's process id (also its session and process group id).
        returncode: Integer or `None`: as `Popen.returncode` (`-N` when killed by signal N),
            `None` while it runs.
        stdout: A file object the caller may set (the read end of the worker's output), or `None`.
    """

    def __init__(self, connection: _Connection, args: list[str], pid: int):
        self._connection = connection
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self.stdout: typing.IO[bytes] | None = None

    def poll(self) -> int | None:
        """Returns the exit status if the worker has exited (and records it), else `None`.

        If the server has exited (it reaps its workers and reports their statuses), a worker
        that is gone counts as exited with status `UNKNOWN_STATUS`, and stderr says so.
        """
        if self.returncode is None:
            try:
                self._connection.read_statuses()
            except (OSError, ConnectionError, ValueError):
                pass
            self.returncode = self._connection.statuses.get(self.pid)
            if self.returncode is None and self._connection.closed and not _alive(self.pid):
                self.returncode = UNKNOWN_STATUS
                sys.stderr.write(
                    f"keras_dist._zygote: the zygote server exited before worker {self.pid}; its exit status is "
                    f"unknown (reported as {UNKNOWN_STATUS}). Its log: {self._connection.path}.log\n"
                )
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the worker to exit; returns its exit status.

        Raises:
            subprocess.TimeoutExpired: `timeout` seconds passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(_POLL_SECONDS)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, signum: int) -> None:
        """Sends `signum` to the worker, if it is still running."""
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """Sends SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """Sends SIGKILL."""
        self.send_signal(signal.SIGKILL)


class _Connection:
    """One client's connection to a server: requests, and the exit statuses of the workers it started."""

    def __init__(self, path: str):
        self._lock = threading.Lock()
        self.path = path
        self.closed = False
        self.statuses: dict[int, int] = {}
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.settimeout(_REQUEST_SECONDS)
        self._sock.connect(path)

    def request(self, message: dict, fds: Sequence[int]) -> dict:
        with self._lock:
            socket.send_fds(self._sock, [json.dumps(message).encode()], list(fds))
            while True:
                reply = self._next_message(block=True)
                if reply is not None and "exited" not in reply:
                    return reply

    def close(self) -> None:
        self.closed = True
        self._sock.close()

    def read_statuses(self) -> None:
        with self._lock:
            while self._next_message(block=False) is not None:
                pass

    def _next_message(self, block: bool) -> dict | None:
        if not block and not select.select([self._sock], [], [], 0)[0]:
            return None
        try:
            data = self._sock.recv(_MAX_MESSAGE)
        except OSError:
            data = b""
        if not data:
            self.closed = True
            raise ConnectionError(f"The zygote server at {self.path} closed the connection.")
        message = json.loads(data)
        if "exited" in message:
            self.statuses[message["exited"]] = message["status"]
        return message


_connections: dict[str, _Connection] = {}
# Why each request `spawn` sent (a directory set) came back without a worker, in order: what a test names when a
# worker it expected forked started as a new process.
fallbacks: list[str] = []
_connections_lock = threading.Lock()


def _parse_command(command: Sequence[str]) -> dict | None:
    """`[python, ("-u"), script | -m module, args...]` as a request's program, or `None` for any other form."""
    if not command:
        return None
    rest = list(command[1:])
    unbuffered = False
    if rest[:1] == ["-u"]:
        unbuffered, rest = True, rest[1:]
    if rest[:1] == ["-m"] and len(rest) >= 2:
        return {"module": rest[1], "args": rest[2:], "unbuffered": unbuffered}
    if rest and not rest[0].startswith("-"):
        return {"script": rest[0], "args": rest[1:], "unbuffered": unbuffered}
    return None


def spawn(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    stdin: int,
    stdout: int,
    stderr: int,
    cwd: str | os.PathLike[str] | None = None,
    directory: str | None = None,
    slot: int = 0,
) -> ZygoteProcess | None:
    """Starts `command` forked from a zygote server in `directory`; `None` where none can run it.

    Each environment (its variables that are `read_at_import`, and the
    interpreter) gets its own server, started by the first request that needs
    it and kept until `directory` is removed: that request waits for the
    server's import (about 8 s on 2 cores, as a new interpreter would), later
    ones do not. The worker starts in its own session (as
    `Popen(start_new_session=True)`), with the given file descriptors as its
    standard streams (the caller may close its copies afterwards).

    Args:
        command: List of strings: `[sys.executable, script, *args]`, optionally
            with `-u` after the interpreter, or `-m module` instead of a script.
        env: Mapping of strings, the worker's whole environment.
        stdin, stdout, stderr: Integer file descriptors of the worker's streams.
        cwd: The worker's working directory. Defaults to this process's.
        directory: String, the servers' directory. Defaults to `$KERAS_DIST_ZYGOTE`.
        slot: Integer >= 0, the worker's place among those started together
            (its task index). Each slot has a server of its own, with its own
            hash seed, so that workers started together iterate sets and dicts
            of strings in different orders, as new interpreters would (a hash
            seed is fixed when an interpreter starts; children of one server
            share it). Defaults to 0.

    Returns:
        `ZygoteProcess`, or `None` (start the worker with `subprocess.Popen`)
        when no directory is set or it is gone, the command has another form
        or another interpreter, or the server cannot be reached or refuses
        (why, for those two: appended to `fallbacks`).
    """
    from keras_dist._env import ZYGOTE_ENV

    directory = directory or os.environ.get(ZYGOTE_ENV)
    program = _parse_command(command)
    if not directory or program is None or os.path.realpath(command[0]) != os.path.realpath(sys.executable):
        return None
    import_env = _import_env(env)
    try:
        socket_path = _server_for(directory, env, import_env, slot)
        with _connections_lock:
            connection = _connections.get(socket_path)
            if connection is None:
                connection = _connections[socket_path] = _Connection(socket_path)
        reply = connection.request(
            {
                **program,
                "env": dict(env),
                "import_env": import_env,
                "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            },
            [stdin, stdout, stderr],
        )
    except (OSError, ConnectionError, ValueError) as error:
        fallbacks.append(f"slot {slot}: {type(error).__name__}: {error}")
        with _connections_lock:
            for path in [path for path in _connections if path.startswith(directory)]:
                # Closed, so that the server drops a request it reads later (`_hung_up`): the caller starts
                # this worker itself. The next request connects again.
                _connections.pop(path).close()
        return None
    if "pid" not in reply:
        fallbacks.append(f"slot {slot}: refused: {reply.get('refused')}")
        return None
    return ZygoteProcess(connection, list(command), reply["pid"])


def _server_for(directory: str, env: Mapping[str, str], import_env: Mapping[str, str], slot: int) -> str:
    """The socket of `directory`'s server for `import_env`, started if there is none yet.

    Raises:
        OSError: `directory` is gone, or the server's socket did not appear in time.
    """
    key = hashlib.sha256(json.dumps([sys.executable, sorted(import_env.items()), slot]).encode()).hexdigest()[:16]
    socket_path = os.path.join(directory, f"{key}.socket")
    if not os.path.exists(socket_path):
        try:  # The first client to create the pid file starts the server; the others wait for its socket.
            fd = os.open(f"{socket_path}.pid", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass
        else:
            server_env = {name: value for name, value in env.items() if name != "TF_CONFIG"}
            if _HASH_SEED not in server_env:  # A seed of its own, as a new interpreter draws one.
                server_env[_HASH_SEED] = str(int.from_bytes(os.urandom(4), "little"))
            server = start_server(socket_path, server_env, import_env=import_env)
            os.write(fd, str(server.pid).encode())
            os.close(fd)
        deadline = time.monotonic() + _START_SECONDS
        while not os.path.exists(socket_path):
            if time.monotonic() >= deadline:
                raise OSError(f"No zygote server socket at {socket_path} after {_START_SECONDS:g} s.")
            time.sleep(_POLL_SECONDS)
    return socket_path


def stop_servers(directory: str) -> None:
    """Stops every server `spawn` started in `directory` (SIGTERM, SIGKILL after 10 s) and removes it."""
    import glob
    import shutil

    pids = []
    for pid_file in glob.glob(os.path.join(directory, "*.socket.pid")):
        try:
            with open(pid_file) as f:
                pids.append(int(f.read()))
        except (OSError, ValueError):
            continue
    shutil.rmtree(directory, ignore_errors=True)  # A server also exits when its socket is gone.
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(_POLL_SECONDS)
    _signal_all(pids, signal.SIGKILL)
    for pid in pids:
        try:
            os.waitpid(pid, 0)  # A server this process started: reap it.
        except ChildProcessError:
            pass  # Started by another process (a launcher): init reaps it.


def _signal_all(pids: Sequence[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def set_owner(directory: str, pid: int | None = None) -> None:
    """Makes the servers of `directory` exit when process `pid` (default: this one) has exited.

    A test session sets itself: its servers are then gone with it, even when it is killed.
    """
    with open(os.path.join(directory, _OWNER_FILE), "w") as f:
        f.write(str(os.getpid() if pid is None else pid))


def _owner(directory: str) -> int | None:
    try:
        with open(os.path.join(directory, _OWNER_FILE)) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)  # Our child (pytest started it): reap it.
        if waited:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True


# ------------------------------------------------------------------ server


def start_server(
    socket_path: str,
    env: Mapping[str, str],
    preload: Sequence[str] = DEFAULT_PRELOAD,
    *,
    import_env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """Starts a zygote server as a subprocess; returns it (stop it with `terminate()`).

    It listens on `socket_path` at once and serves requests once the preload
    modules are imported; until then `spawn` waits (up to a minute, then it
    returns `None`). Requests must carry `env` in every variable that is
    `read_at_import`.

    Args:
        socket_path: String, a path for its Unix socket (at most about 100 bytes).
        env: Mapping of strings, the server's environment: the base environment
            of the workers it will start.
        preload: Module names to import before forking. Defaults to TensorFlow
            and Keras.
        import_env: The variables requests must carry (see `read_at_import`).
            Defaults to those of `env` (`spawn` passes the worker's, without
            the hash seed it drew for the server).
    """
    # The file, not `-m keras_dist._zygote`: importing the package would import TensorFlow and apply
    # keras_dist's variables in the server, before any worker's environment is known.
    with open(f"{socket_path}.log", "ab") as log:  # What the server itself prints (TensorFlow's import, errors).
        return subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                socket_path,
                ",".join(preload),
                json.dumps(dict(_import_env(env) if import_env is None else import_env)),
            ],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )


def serve(socket_path: str, preload: Sequence[str], import_env: Mapping[str, str]) -> dict | None:
    """The server's loop. Returns only in a forked child, with the request it is to run.

    Args:
        socket_path: String, where to listen.
        preload: Module names to import first.
        import_env: Dict of strings, the variables a request's `import_env` must equal.
    """
    import importlib

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # Bound and listening under another name, then renamed: clients take the path's existence to mean a connect
    # succeeds, and one that came between bind and listen was refused (its worker silently not forked).
    binding = os.path.join(os.path.dirname(socket_path), f"{os.getpid()}.binding")
    listener.bind(binding)
    listener.listen(64)  # Clients may connect and send once it is renamed: their requests wait for the preload.
    os.rename(binding, socket_path)
    for name in preload:
        importlib.import_module(name)
    base_path = list(sys.path[1:])
    clients: set[socket.socket] = set()
    requesters: dict[int, socket.socket] = {}  # Each worker's pid: the client that asked for it.
    last_request = time.monotonic()
    owner = _owner(os.path.dirname(socket_path))
    while (
        os.path.exists(socket_path)
        and (owner is None or _alive(owner))
        and time.monotonic() - last_request < _IDLE_EXIT_SECONDS
    ):
        readable, _, _ = select.select([listener, *clients], [], [], _POLL_SECONDS)
        for sock in readable:
            last_request = time.monotonic()
            if sock is listener:
                conn, _ = listener.accept()
                clients.add(conn)
                continue
            try:
                data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
            except OSError:
                data, fds = b"", []
            if not data:
                clients.discard(sock)
                sock.close()
                continue
            request = json.loads(data)
            if _hung_up(sock):  # The client gave up waiting (the preload was slow) and started it itself.
                for fd in fds:
                    os.close(fd)
                continue
            refusal = _refusal(request, import_env, fds)
            if refusal:
                for fd in fds:
                    os.close(fd)
                _send(sock, {"refused": refusal})
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                for client in clients:
                    client.close()
                _become_worker(request, fds, base_path)
                return request
            for fd in fds:
                os.close(fd)
            requesters[pid] = sock
            _send(sock, {"pid": pid})
        while requesters:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            requester = requesters.pop(pid, None)
            if requester is not None and requester in clients:
                _send(requester, {"exited": pid, "status": os.waitstatus_to_exitcode(status)})
    return None  # The directory was removed, its owner exited, or nobody asked for a long time: exit.


def _hung_up(sock: socket.socket) -> bool:
    """Whether the peer of `sock` has closed its end (requests it sent before are still readable)."""
    poller = select.poll()
    poller.register(sock, select.POLLHUP | getattr(select, "POLLRDHUP", 0))
    return any(events & (select.POLLHUP | getattr(select, "POLLRDHUP", 0)) for _, events in poller.poll(0))


def _refusal(request: dict, import_env: Mapping[str, str], fds: Sequence[int]) -> str:
    if len(fds) != 3:
        return f"expected 3 file descriptors (stdin, stdout, stderr), received {len(fds)}"
    differing = sorted(set(import_env.items()) ^ set(request["import_env"].items()))
    if differing:
        return f"the environment differs in variables read at import: {sorted({name for name, _ in differing})}"
    return ""


def _send(sock: socket.socket, message: dict) -> None:
    try:
        sock.send(json.dumps(message).encode())
    except OSError:
        pass  # The client left; its workers' statuses have no reader.


def _become_worker(request: dict, fds: Sequence[int], base_path: Sequence[str]) -> None:
    """In the forked child: the state `python [-u] script|-m module args` would start with.

    `base_path` is the server's `sys.path` without its first entry and its own `PYTHONPATH`.
    """
    import random

    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    unbuffered = request["unbuffered"] or bool(request["env"].get("PYTHONUNBUFFERED"))
    # Encodings and error handlers as the interpreter chose them for the server: its LANG and LC_* are the worker's.
    encoding, errors = sys.stdout.encoding, (sys.stdin.errors, sys.stdout.errors, sys.stderr.errors)
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding, errors[0])
    sys.stdout = _text_stream(1, encoding, unbuffered, line_buffering=os.isatty(1), errors=errors[1])
    sys.stderr = _text_stream(2, encoding, unbuffered, line_buffering=True, errors=errors[2])
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr  # type: ignore[misc]
    program = request.get("script") or request["module"]
    sys.argv = [program, *request["args"]]
    sys.orig_argv = [
        sys.executable,
        *(["-u"] if request["unbuffered"] else []),
        *([program] if "script" in request else ["-m", program]),
        *request["args"],
    ]
    first = os.path.dirname(os.path.realpath(program)) if "script" in request else os.getcwd()
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *base_path]
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "multiprocessing.process" in sys.modules:  # Set when it was imported: the server's, not the worker's.
        process = sys.modules["multiprocessing.process"]
        process.ORIGINAL_DIR = os.getcwd()  # type: ignore[attr-defined]
        process.current_process().authkey = os.urandom(32)


def _text_stream(
    fd: int, encoding: str, unbuffered: bool, *, line_buffering: bool, errors: str | None
) -> io.TextIOWrapper:
    """A text stream on `fd` as the interpreter makes `sys.stdout`/`sys.stderr` (`-u`: no binary buffer)."""
    raw = io.FileIO(fd, "w", closefd=False)
    buffer: typing.BinaryIO = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(
        buffer,
        encoding=encoding,
        errors=errors,
        line_buffering=line_buffering and not unbuffered,
        write_through=unbuffered,
    )


def _main(argv: Sequence[str]) -> None:
    import runpy

    # Run as a file, Python put this package's directory first on sys.path: no worker should see it.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    server_pythonpath = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    sys.path[:] = ["", *(p for p in sys.path if p not in server_pythonpath)]  # [0]: the worker's own first entry
    socket_path, preload = argv[0], [name for name in argv[1].split(",") if name]
    request = serve(socket_path, preload, json.loads(argv[2]))
    if request is None:
        return
    if "script" in request:
        _run_script(request["script"])
    else:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def _run_script(path: str) -> None:
    """Runs the file at `path` as `python path` runs it: a new `__main__`, `__file__` absolute, argv as given.

    (`runpy.run_path` would set `sys.argv[0]` and `__file__` to the path as passed, and keep its own frames
    and the server's `__main__` around the script.)
    """
    import builtins
    import importlib.machinery
    import types

    filename = os.path.abspath(path)
    try:
        with io.open_code(filename) as f:
            source = f.read()
    except OSError as e:  # As the interpreter says it, with its status.
        sys.stderr.write(f"{sys.executable}: can't open file {filename!r}: [Errno {e.errno}] {e.strerror}\n")
        sys.exit(2)
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=filename,
        __cached__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", filename),
        __spec__=None,
        __builtins__=builtins,
    )
    sys.modules["__main__"] = main
    exec(compile(source, filename, "exec", dont_inherit=True), main.__dict__)


if __name__ == "__main__":
    _main(sys.argv[1:])
