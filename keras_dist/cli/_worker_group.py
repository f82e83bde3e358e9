"""Worker processes of `keras-dist launch`: start, relay output, stop together.

Owns: the processes `launch_command` starts, the `[worker:<task_id>]` prefix on
their output, forwarding SIGINT and SIGTERM to them, and reaping every one of
them (no zombies, no orphans), also when the launcher raises.
Must not: import TensorFlow or Keras, or build TF_CONFIG (see `launch.py`).

Each worker runs in its own session, so it is also its own process group;
signals go to the whole group, which reaches the worker's children too. Under the
test suite (`KERAS_DIST_ZYGOTE` set), workers are forked from its zygote servers
(`keras_dist._zygote`) instead; a user's launch never sets it.
"""

import os
import signal
import subprocess
import sys
import threading
import time

from keras_dist._env import ZYGOTE_ENV
from keras_dist._process import RESTART_EXIT_STATUS, signal_process_groups, stop_process_groups
from keras_dist._zygote import spawn

_POLL_SECONDS = 0.1
_READER_JOIN_SECONDS = 5.0


def exit_status_message(task_id, returncode):
    """Describes how worker `task_id` ended, for the launcher's stderr.

    Args:
        task_id: Integer, the worker's index.
        returncode: Integer, `Popen.returncode`; `-N` means killed by signal N.

    Returns:
        String without a final period.

    Example:
    >>> exit_status_message(1, 3)
    'worker 1 exited with status 3'
    >>> exit_status_message(0, -9)
    'worker 0 was killed by SIGKILL'
    """
    if returncode < 0:
        return f"worker {task_id} was killed by {_signal_name(-returncode)}"
    return f"worker {task_id} exited with status {returncode}"


def launcher_exit_status(returncode):
    """Maps a worker's `Popen.returncode` to the launcher's exit status.

    Args:
        returncode: Integer, `Popen.returncode`; `-N` means killed by signal N.

    Returns:
        Integer: `returncode` itself when >= 0, else 128 + N.

    Example:
    >>> launcher_exit_status(3), launcher_exit_status(-9)
    (3, 137)
    """
    return 128 - returncode if returncode < 0 else returncode


class WorkerGroup:
    """Starts worker processes, relays their output, and stops them together.

    Args:
        grace_period: Float >= 0, in seconds: how long `run` waits after
            SIGTERM (or a forwarded SIGINT) before it sends SIGKILL.
    """

    def __init__(self, grace_period):
        self._grace_period = grace_period
        self._lock = threading.Lock()
        self._processes = {}
        self._readers = []
        self._signal = None
        self._stopping = False
        self.received_signal = None
        self.failed_task_id = None

    def run(self, command, envs):
        """Starts one worker per `envs` item and waits for all of them.

        Installs SIGINT and SIGTERM handlers for the duration (main thread only)
        and restores the previous ones before returning.

        Args:
            command: List of strings, the worker's command line (same for all).
            envs: Dict from task_id (integer) to that worker's environment.

        Returns:
            Integer exit status; see `keras_dist.cli.launch`.
        """
        previous_handlers = self._install_signal_handlers()
        try:
            for task_id, env in envs.items():
                self._start(task_id, command, env)
            return self._supervise()
        finally:
            if any(proc.poll() is None for proc in self._processes.values()):
                self._stop_all(signal.SIGTERM)
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)
            for reader in self._readers:
                reader.join(_READER_JOIN_SECONDS)

    def _start(self, task_id, command, env):
        proc = self._fork_from_zygote(command, env, task_id)
        if proc is None:
            proc = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._processes[task_id] = proc
        reader = threading.Thread(
            target=self._relay_output, args=(task_id, proc.stdout), name=f"keras-dist-worker-{task_id}", daemon=True
        )
        reader.start()
        self._readers.append(reader)

    @staticmethod
    def _fork_from_zygote(command, env, task_id):
        """The worker forked by a zygote server of the test suite (`KERAS_DIST_ZYGOTE`), or `None` (users: always)."""
        if not env.get(ZYGOTE_ENV):
            return None
        read_end, write_end = os.pipe()
        with open(os.devnull, "rb") as devnull:
            proc = spawn(
                command,
                env=env,
                stdin=devnull.fileno(),
                stdout=write_end,
                stderr=write_end,
                directory=env[ZYGOTE_ENV],
                slot=task_id,
            )
        os.close(write_end)
        if proc is None:
            os.close(read_end)
            return None
        proc.stdout = os.fdopen(read_end, "rb")
        return proc

    def _supervise(self):
        while True:
            if self._signal is not None:
                received = signal.Signals(self._signal)
                self.received_signal = received
                self._say(f"received {received.name}; forwarding it to the workers.")
                self._stop_all(received)
                if any(proc.returncode == RESTART_EXIT_STATUS for proc in self._processes.values()):
                    self._say(
                        f"the workers saved their state; exiting with status {RESTART_EXIT_STATUS} (restart to resume)."
                    )
                    return RESTART_EXIT_STATUS
                return 128 + received
            returncodes = {task_id: proc.poll() for task_id, proc in self._processes.items()}
            failed = [(task_id, code) for task_id, code in returncodes.items() if code not in (None, 0)]
            if failed:
                task_id, returncode = failed[0]
                self.failed_task_id = task_id
                others_running = None in returncodes.values()
                suffix = "; stopping the other workers." if others_running else "."
                self._say(exit_status_message(task_id, returncode) + suffix)
                self._stop_all(signal.SIGTERM)
                return launcher_exit_status(returncode)
            if all(code == 0 for code in returncodes.values()):
                return 0
            time.sleep(_POLL_SECONDS)

    def _stop_all(self, signum):
        """Sends `signum` to every worker group, waits the grace period, then SIGKILLs and reaps all."""
        self._stopping = True
        task_ids = {proc.pid: task_id for task_id, proc in self._processes.items()}

        def overdue(proc):
            self._say(f"worker {task_ids[proc.pid]} did not exit within {self._grace_period:g} s; sending SIGKILL.")

        stop_process_groups(self._processes.values(), self._grace_period, signum=signum, on_overdue=overdue)

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {signum: signal.signal(signum, self._on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}

    def _on_signal(self, signum, frame):
        del frame
        if self._stopping:  # A signal while already stopping: skip the grace period.
            signal_process_groups(self._processes.values(), signal.SIGKILL)
        if self._signal is None:
            self._signal = signum

    def _relay_output(self, task_id, pipe):
        prefix = f"[worker:{task_id}] "
        with pipe:
            for raw_line in pipe:
                line = raw_line.decode("utf-8", errors="replace")
                self._write(sys.stdout, prefix + (line if line.endswith("\n") else line + "\n"))

    def _say(self, message):
        self._write(sys.stderr, f"keras-dist launch: {message}\n")

    def _write(self, stream, text):
        with self._lock:
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):
                pass  # Launcher output closed; keep draining so workers never block.


def _signal_name(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
