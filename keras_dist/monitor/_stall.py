"""The stall watchdog: when a live worker does not reach the next collective, every worker fails naming it.

Owns: one daemon thread per worker process (started by the first `fit`/
`evaluate`/`predict` under several workers, `ensure_started`), which

1. publishes this worker's phase (`keras_dist.monitor._progress`) to TensorFlow's
   coordination service key-value store every poll interval (a second thread:
   the store's writes have no timeout), with a counter that a frozen process
   stops advancing;
2. once this worker has spent a quarter of the bound in one phase, reads the
   other workers' records;
3. at half the bound in a collective that some worker did not reach (it is in
   a callback, saving, its own code, another collective, or frozen), warns;
4. at the bound, writes one verdict into the store (the first worker to do so
   wins). Every worker reads it, aborts its collectives (so the waiting ones
   wake with an error) and raises `keras_dist.errors.WorkerStalledError` with
   the verdict's message; a worker stuck in Python code gets it in its main
   thread (a signal), and one that does not leave its call within the grace
   period writes it and exits with status 1.

The bound is `max(KERAS_DIST_STALL_TIMEOUT, 20 x the median step time)`
(default 60 s; 0 turns the watchdog off). A slow worker that keeps finishing
steps is never flagged: the others wait for it at most one of its steps. When
every worker waits in the same collective, nobody is behind: the watchdog does
not fail the run (TensorFlow's heartbeats catch a dead peer).

Must not: run a service of its own (the store is the coordination service's),
or add work to the training step (it only reads `Progress`).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Mapping

from keras_dist import _env, errors
from keras_dist._runtime import coordination
from keras_dist.monitor._progress import PROGRESS, Progress

DEFAULT_STALL_TIMEOUT_SECONDS = 60.0
STEP_TIME_FACTOR = 20.0
_PREFIX = "keras_dist/stall/"
_VERDICT_KEY = _PREFIX + "verdict"
_GRACE_SECONDS = 10.0
_SIGNAL = signal.SIGUSR2


def stall_timeout_from_environment(environ: Mapping[str, str] | None = None) -> float:
    """Returns `KERAS_DIST_STALL_TIMEOUT` in seconds (default 60; 0 = off).

    Raises:
        ValueError: The variable is not a number >= 0.
    """
    environ = os.environ if environ is None else environ
    raw = environ.get(_env.STALL_TIMEOUT_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_STALL_TIMEOUT_SECONDS
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"`{_env.STALL_TIMEOUT_ENV}` must be a number of seconds >= 0 (0 turns the stall watchdog off). "
            f"Received: {_env.STALL_TIMEOUT_ENV}={raw!r}. Fix: set it to e.g. 60, or unset it."
        )
    return value


def bound_seconds(floor_seconds: float, median_step_seconds: float | None) -> float:
    """Returns the stall bound: `max(floor_seconds, 20 x median_step_seconds)`, in seconds.

    >>> bound_seconds(60, 0.1), bound_seconds(60, 5.0), bound_seconds(60, None)
    (60, 100.0, 60)
    """
    return max(floor_seconds, STEP_TIME_FACTOR * (median_step_seconds or 0.0))


@dataclasses.dataclass(frozen=True)
class Record:
    """What one worker published about itself (JSON in the coordination store).

    Attributes:
        task: String, e.g. `"worker:1"`.
        beat: Integer, incremented at each publication (a frozen process stops it).
        kind: String, the phase's kind (`keras_dist.monitor._progress.Phase.kind`).
        what: String, the phase described for a person.
        collective: Boolean, the phase waits for the others in a collective.
        age: Float, seconds since the worker's phase last changed, when it published.
        outer: String, the outermost call (`"fit"`, `"evaluate"`, `"predict"`, `"script"`).
        steps: Integer, train steps the worker finished.
        epoch: Integer, the epoch of `fit` (-1 outside).
        median: Float or None, the worker's median step time in seconds.
    """

    task: str
    beat: int
    kind: str
    what: str
    collective: bool
    age: float
    outer: str
    steps: int
    epoch: int
    median: float | None

    @classmethod
    def of(cls, task: str, beat: int, progress: Progress, now_monotonic: float) -> Record:
        """Returns this worker's record now."""
        stack = progress.stack()
        phase = stack[-1]
        outer = stack[1].kind if len(stack) > 1 else "script"
        return cls(
            task=task,
            beat=beat,
            kind=phase.kind,
            what=phase.describe(),
            collective=phase.collective,
            age=round(progress.seconds_in_current(now_monotonic), 3),
            outer=outer,
            steps=progress.steps_finished,
            epoch=progress.epoch,
            median=progress.median_step_seconds(),
        )

    def position(self) -> tuple[str, str]:
        """The collective this worker waits in, comparable across workers."""
        return (self.outer, self.what)

    def where(self) -> str:
        """E.g. `"train step 13 (fit: forward, ...)"`, with `" inside evaluate"` when the call is not named."""
        return self.what if self.outer in self.what or self.outer == "script" else f"{self.what} inside {self.outer}"

    def last_finished(self) -> str:
        """E.g. `"last finished train step 12 (epoch 1)"`."""
        epoch = f" (epoch {self.epoch})" if self.epoch >= 0 else ""
        return f"last finished train step {self.steps}{epoch}" if self.steps else "finished no train step yet"


def _record_from_json(text: str | None) -> Record | None:
    if not text:
        return None
    try:
        return Record(**json.loads(text))
    except (TypeError, ValueError):
        return None


def describe_stall(
    me: Record,
    records: Mapping[str, Record | None],
    silent_seconds: Mapping[str, float],
    *,
    bound: float,
    floor: float,
    frozen_after: float,
) -> tuple[list[str], str] | None:
    """Returns `(stuck workers, facts)` when `me`, waiting in a collective, waits for workers that did not reach it.

    A worker is behind when it is frozen (no new record for `frozen_after`
    seconds), outside any collective (a callback, saving, its own code), or in
    another collective than most workers (on a tie, the side outside `fit`
    is behind, e.g. an `evaluate` only the chief calls; when that does not
    decide, every worker is named).

    Args:
        me: This worker's `Record` (in a collective phase).
        records: Task name -> the other workers' last `Record` (`None`: never read).
        silent_seconds: Task name -> seconds since that worker's record last changed, as seen here.
        bound: Float, the stall bound in seconds.
        floor: Float, `KERAS_DIST_STALL_TIMEOUT` in seconds.
        frozen_after: Float, seconds without a new record after which a worker counts as frozen.

    Returns:
        `None` when no worker is behind (every worker waits in the same
        collective, or progresses); else the stuck task names (sorted) and a
        sentence of facts naming each, what it last finished and what it is
        doing, and the collective the others wait in.

    >>> me = Record("worker:0", 3, "step", "train step 13 (fit: ...)", True, 40.0, "fit", 12, 1, 0.1)
    >>> peer = Record("worker:1", 9, "callback", "Slow.on_train_batch_end (a callback)", False, 41.0, "fit", 12, 1, 0.1)
    >>> stuck, facts = describe_stall(me, {"worker:1": peer}, {"worker:1": 0.5}, bound=60, floor=60, frozen_after=15)
    >>> stuck, facts.split(" and ")[0]
    (['worker:1'], 'worker:1 has been in Slow.on_train_batch_end (a callback) for 41 s')
    """
    stuck, parts, waiting = [], [], {me.task: me}
    for task, record in sorted(records.items()):
        silent = silent_seconds.get(task, 0.0)
        if silent >= frozen_after and not (record is not None and record.kind == "exited"):
            stuck.append(task)
            parts.append(
                f"{task} has published no progress for {silent:.0f} s (frozen, or not started)"
                if record is None
                else f"{task} is frozen: its process has not answered for {silent:.0f} s (stopped, e.g. SIGSTOP, "
                f"or swapping); when last heard from, it {record.last_finished()} and was in {record.what}"
            )
        elif record is None or record.kind == "exited":
            continue  # An exited worker is TensorFlow's to report (its connection closes).
        elif not record.collective:
            stuck.append(task)
            parts.append(f"{task} has been in {record.what} for {record.age:.0f} s and {record.last_finished()}")
        else:
            waiting[task] = record
    groups: dict[tuple[str, str], list[str]] = {}
    for task, record in waiting.items():
        groups.setdefault(record.position(), []).append(task)
    majority = _majority(groups)
    if len(groups) > 1:
        for position, tasks in sorted(groups.items()):
            if position == majority:
                continue
            for task in tasks:
                record = waiting[task]
                stuck.append(task)
                parts.append(
                    f"{task} waits in {record.where()}, which "
                    + ("the others did not reach" if majority else "is not where the others wait")
                    + f", for {record.age:.0f} s and {record.last_finished()}"
                )
    if not stuck:
        return None
    others = sorted(groups.get(majority, [])) if majority else []
    bound_text = (
        f"{bound:.0f} s (the larger of {_env.STALL_TIMEOUT_ENV}={floor:g} s and {STEP_TIME_FACTOR:g} x the median "
        f"step time {me.median or 0.0:.3g} s)"
    )
    if others:
        first = waiting[others[0]]
        tail = (
            f"{', '.join(others)} {'waits' if len(others) == 1 else 'wait'} for "
            f"{'it' if len(stuck) == 1 else 'them'} in {first.where()} since {first.age:.0f} s; "
            f"{first.last_finished()}"
        )
    else:
        tail = "the workers wait in different collectives: they do not run the same steps and calls"
    return sorted(stuck), f"{'; '.join(parts)}. {tail}. Bound: {bound_text}"


def _majority(groups):
    """The position most waiting workers are in; on a tie, the one inside `fit`; `None` if that does not decide."""
    if not groups:
        return None
    most = max(len(tasks) for tasks in groups.values())
    candidates = [position for position, tasks in groups.items() if len(tasks) == most]
    if len(candidates) > 1:
        candidates = [position for position in candidates if position[0] == "fit"]
    return candidates[0] if len(candidates) == 1 else None


class Watchdog:
    """The stall watchdog of this worker (see the module docstring).

    Args:
        task: String, this worker's task name (`"worker:0"`).
        peers: Mapping task name -> `"host:port"` of the other workers.
        floor_seconds: Float > 0, `KERAS_DIST_STALL_TIMEOUT`.
        progress: The `Progress` to publish (this process's by default).
    """

    def __init__(self, task: str, peers: Mapping[str, str], floor_seconds: float, progress: Progress = PROGRESS):
        self.task, self.peers, self.floor, self.progress = task, dict(peers), floor_seconds, progress
        self.interval = min(5.0, max(0.5, floor_seconds / 10.0))
        # Under load a publisher thread can miss a few intervals: frozen means silent for half the bound.
        self.frozen_after = max(5.0 * self.interval, floor_seconds / 2.0)
        self.verdict: dict | None = None
        self._beat = 0
        self._seen: dict[str, tuple[int, float]] = {}
        self._records: dict[str, Record | None] = {}
        self._warned: tuple | None = None
        self._stop = threading.Event()
        self._main = threading.main_thread()
        self._signal_installed = False

    def start(self) -> None:
        """Starts the publishing and watching threads (daemons), and publishes `exited` when the process ends."""
        self._install_signal_handler()
        atexit.register(self._publish_exit)
        threading.Thread(target=self._publish_loop, name="keras-dist-stall-publish", daemon=True).start()
        threading.Thread(target=self._watch_loop, name="keras-dist-stall-watch", daemon=True).start()

    def stop(self) -> None:
        """Stops both threads (within one poll interval)."""
        self._stop.set()

    # ---------------------------------------------------------------- threads
    def _publish_loop(self) -> None:
        while not self._stop.is_set() and self.verdict is None:
            self._beat += 1
            record = Record.of(self.task, self._beat, self.progress, time.monotonic())
            try:
                coordination.put(_PREFIX + "progress/" + self.task, json.dumps(dataclasses.asdict(record)))
            except Exception:  # noqa: BLE001 (the cluster is going down: TensorFlow's own error says why)
                return
            self._stop.wait(self.interval)

    def _publish_exit(self) -> None:
        """Tells the others this process ends (a worker that finished is not frozen; TensorFlow reports it)."""
        self._stop.set()
        record = dataclasses.replace(
            Record.of(self.task, self._beat + 1, self.progress, time.monotonic()), kind="exited"
        )

        def publish() -> None:
            try:
                coordination.put(_PREFIX + "progress/" + self.task, json.dumps(dataclasses.asdict(record)))
            except Exception:  # noqa: BLE001 (the cluster may be gone already)
                pass

        thread = threading.Thread(target=publish, daemon=True)
        thread.start()
        thread.join(timeout=2.0)  # A leader that is gone or frozen must not hold up this process's exit.

    def _watch_loop(self) -> None:
        while not self._stop.is_set():
            try:
                verdict = coordination.get(_VERDICT_KEY, self.interval)
            except Exception:  # noqa: BLE001 (the cluster is going down)
                return
            if verdict:
                self._act(json.loads(verdict))
                return
            try:
                self._check()
            except Exception as e:  # noqa: BLE001 (a watchdog must never break training)
                warnings.warn(f"keras-dist's stall watchdog stopped: {e!r}", errors.KerasDistWarning, stacklevel=1)
                return

    # ---------------------------------------------------------------- checks
    def _check(self) -> None:
        now = time.monotonic()
        me = Record.of(self.task, self._beat, self.progress, now)
        bound = bound_seconds(self.floor, self.progress.median_step_seconds())
        if me.age < bound / 4 or me.kind == "script" and not me.collective:
            self._seen.clear()  # A new phase: what was read about the others is stale.
            self._records.clear()
            return
        self._read_peers(now)
        silent = {task: now - self._seen[task][1] for task in self.peers if task in self._seen}
        if not me.collective:
            self._warn_if_others_wait(me, bound, silent)
            return
        found = describe_stall(me, self._records, silent, bound=bound, floor=self.floor, frozen_after=self.frozen_after)
        if found is None:
            return
        stuck, facts = found
        if me.age >= bound:
            message = (
                f"keras-dist stall watchdog: {facts}. Expected: every worker reaches each collective within the "
                f"bound. Fix: make every worker run the same steps and calls (no `if keras_dist.is_chief():` "
                f"around fit/evaluate/predict/save), keep slow work out of callbacks or run it on every worker, "
                f"or raise {_env.STALL_TIMEOUT_ENV} (0 turns the watchdog off). See docs/troubleshooting.md#stall."
            )
            coordination.insert_once(_VERDICT_KEY, json.dumps({"message": message, "stalled": stuck, "by": self.task}))
        elif me.age >= bound / 2 and self._warned != (tuple(stuck), me.what):
            self._warned = (tuple(stuck), me.what)
            self._warn(f"keras-dist stall watchdog: {facts}. At {bound:.0f} s every worker fails with this error.")

    def _warn_if_others_wait(self, me: Record, bound: float, silent: Mapping[str, float]) -> None:
        """On a worker in its own code: warns when the others wait for it (the same facts, seen from here)."""
        waiting = [
            r
            for t, r in sorted(self._records.items())
            if r is not None and r.collective and silent.get(t, 0) < self.frozen_after
        ]
        if me.age < bound / 2 or not waiting or self._warned == (me.what,):
            return
        self._warned = (me.what,)
        names = ", ".join(r.task for r in waiting)
        self._warn(
            f"keras-dist stall watchdog: {self.task} (this worker) has been in {me.what} for {me.age:.0f} s and "
            f"{me.last_finished()}; {names} {'waits' if len(waiting) == 1 else 'wait'} for it in {waiting[0].what}. "
            f"At {bound:.0f} s every worker fails naming {self.task}."
        )

    def _read_peers(self, now: float) -> None:
        for task in self.peers:
            record = _record_from_json(coordination.get(_PREFIX + "progress/" + task, min(1.0, self.interval)))
            if record is not None:
                self._records[task] = record
                if task not in self._seen or self._seen[task][0] != record.beat:
                    self._seen[task] = (record.beat, now)
            else:
                self._records.setdefault(task, None)
                self._seen.setdefault(task, (-1, now))

    def _warn(self, message: str) -> None:
        print(f"[{self.task}] WARNING: {message}", file=sys.stderr, flush=True)

    # ---------------------------------------------------------------- the verdict
    def _act(self, verdict: dict) -> None:
        self.verdict = verdict
        _VERDICTS.append(verdict)
        print(f"[{self.task}] {verdict['message']}", file=sys.stderr, flush=True)
        coordination.abort_collectives(verdict["message"])
        if not self.progress.current().collective and self._signal_installed and self._main.ident is not None:
            signal.pthread_kill(self._main.ident, _SIGNAL)  # Wakes a main thread stuck in Python code (a sleep).
        stack = self.progress.stack()
        call = stack[1] if len(stack) > 1 else None  # The fit/evaluate/predict call the verdict came in.
        deadline = time.monotonic() + _GRACE_SECONDS
        while time.monotonic() < deadline:
            if call is None or call not in self.progress.stack() or not self._main.is_alive():
                return
            time.sleep(0.2)
        # Still inside that call (e.g. in C code that ignores signals): do not hang.
        print(f"[{self.task}] keras_dist.errors.WorkerStalledError: {verdict['message']}", file=sys.stderr, flush=True)
        os._exit(1)

    def _install_signal_handler(self) -> None:
        if threading.current_thread() is not self._main or signal.getsignal(_SIGNAL) is not signal.SIG_DFL:
            return

        def raise_stalled(signum, frame):
            raise_if_stalled()

        signal.signal(_SIGNAL, raise_stalled)
        self._signal_installed = True


_VERDICTS: list[dict] = []
_WATCHDOG: list[Watchdog] = []
_LOCK = threading.Lock()


def raise_if_stalled(cause: BaseException | None = None) -> None:
    """Raises `WorkerStalledError` with the verdict's message when the watchdog reached one in this process.

    Raises:
        keras_dist.errors.WorkerStalledError: A verdict was reached.
    """
    if _VERDICTS:
        verdict = _VERDICTS[0]
        raise errors.WorkerStalledError(verdict["message"], verdict["stalled"]) from cause


def ensure_started(task: str, peers: Mapping[str, str], environ: Mapping[str, str] | None = None) -> Watchdog | None:
    """Starts this process's watchdog once (several workers only); returns it, or `None` when it is off.

    Args:
        task: String, this worker's task name.
        peers: Mapping task name -> address of the other workers.
        environ: Mapping of environment variables (defaults to `os.environ`).

    Raises:
        ValueError: `KERAS_DIST_STALL_TIMEOUT` is not a number >= 0.
    """
    floor = stall_timeout_from_environment(environ)
    with _LOCK:
        if _WATCHDOG:
            return _WATCHDOG[0]
        if floor == 0 or not peers or not coordination.available():
            return None
        watchdog = Watchdog(task, peers, floor)
        watchdog.start()
        _WATCHDOG.append(watchdog)
        return watchdog
