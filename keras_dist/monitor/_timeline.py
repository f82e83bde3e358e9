"""The step timeline: this worker's phases as Chrome trace events, and the straggler report.

Owns: `TimelineRecorder`, which listens to this process's phases
(`keras_dist.monitor._progress.PROGRESS`) while one `fit` runs and turns each
phase that ends into a trace event; each train step's in-graph timestamps
(`keras_dist._runtime.step_marks`) into the phases inside the step
(`step_phases`); the Chrome trace JSON object (`chrome_trace`); what one worker
reports at the end of `fit` (`WorkerSummary`), how the chief gathers those
(`gather_summaries`, on TensorFlow's coordination service) and the chief's table
(`straggler_report`).
Must not: change the step when the timeline is off (nothing here runs then),
write files (the callback does, atomically), or run a collective.

What happens on each worker: every worker records its own phases and writes its
own file (`keras_dist.callbacks.Timeline`); at the end of `fit` every worker
publishes its `WorkerSummary` and the chief prints the table of all of them.

Clocks: every time here is wall-clock time in seconds since the Unix epoch
(`time.time()`, the clock `tf.timestamp()` reads); trace events carry
microseconds.

Example:
>>> phases = step_phases(10.0, 10.5, [10.1, 10.3, 10.35, 10.4])
>>> [(name, round(end - begin, 2)) for name, begin, end in phases]
[('input', 0.1), ('forward/backward', 0.2), ('all-reduce', 0.05), ('apply', 0.05), ('outputs', 0.1)]
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Sequence

from keras_dist import errors
from keras_dist.monitor._progress import PROGRESS, Phase, Progress

# The phases inside a train step, each ending at one of the step's timestamps (`step_marks.NAMES`), then the rest.
STEP_PHASES = ("input", "forward/backward", "all-reduce", "apply")
LAST_STEP_PHASE = "outputs"
ALL_REDUCE = "all-reduce"
_CATEGORIES = {
    "input": "input",
    "forward/backward": "compute",
    "all-reduce": "collective",
    "apply": "apply",
    "outputs": "outputs",
}
_KIND_CATEGORIES = {
    "fit": "fit",
    "evaluate": "evaluate",
    "predict": "predict",
    "step": "step",
    "test_step": "evaluate",
    "predict_step": "predict",
    "callback": "callback",
    "saving": "saving",
    "agreement": "collective",
}
MAIN_TID, EPOCHS_TID = 1, 2
MAX_EVENTS = 1_000_000  # About 100 MB of JSON (and 150 MB in memory); beyond it events are counted, not kept.
STRAGGLER_THRESHOLD = 0.2


def step_phases(begin, end, marks):
    """Returns the phases inside one train step, from its timestamps.

    Args:
        begin: Float, when the call of the train function began (seconds).
        end: Float, when it returned (seconds).
        marks: Sequence of 4 floats (`step_marks.NAMES`: batch available,
            gradients computed, gradients all-reduced, applied; seconds) or
            `None`. NaN, or a value outside `[begin, end]` (left from an
            earlier step), is a boundary this step did not take.

    Returns:
        List of `(name, begin, end)` tuples covering `[begin, end]` in order:
        `"input"`, `"forward/backward"`, `"all-reduce"`, `"apply"`,
        `"outputs"`; a boundary not taken merges its two phases
        (`"all-reduce + apply"` under gradient accumulation). Empty when no
        boundary was taken.
    """
    if marks is None:
        return []
    phases, start, pending = [], begin, []
    for name, mark in zip(STEP_PHASES, marks):
        pending.append(name)
        if mark is None or math.isnan(mark) or not begin <= mark <= end:
            continue
        mark = max(mark, start)
        phases.append((" + ".join(pending), start, mark))
        start, pending = mark, []
    if not phases:
        return []
    phases.append((" + ".join([*pending, LAST_STEP_PHASE]), start, end))
    return phases


def latest_marks(values):
    """Returns, per boundary, the time the last local replica passed it (the max over replicas; NaN if one did not).

    Args:
        values: Array-like `(num_local_replicas, 4)` of floats (`StepMarksBuffer.read()`).

    Returns:
        List of 4 floats.
    """
    rows = [list(map(float, row)) for row in values]
    return [math.nan if any(math.isnan(v) for v in column) else max(column) for column in zip(*rows)]


@dataclasses.dataclass(frozen=True)
class WorkerSummary:
    """What one worker measured in one `fit` with the timeline on.

    Attributes:
        task: String, e.g. `"worker:1"`.
        steps: Integer, train steps (calls of the train function times
            `steps_per_execution`).
        median_step_seconds: Float, the median wall time of one step (of
            one call divided by `steps_per_execution`; `None` without one).
        median_own_seconds: Float, the median of each call's wall time minus
            its all-reduce phase: the worker's own work (input, forward,
            backward, apply); `None` where the all-reduce was not measured.
        collective_seconds: Float, the time spent in the gradient all-reduce
            (where measured) and in the workers' agreement between steps.
        total_seconds: Float, the wall time of `fit`.
    """

    task: str
    steps: int
    median_step_seconds: float | None
    median_own_seconds: float | None
    collective_seconds: float
    total_seconds: float

    @property
    def collective_share(self) -> float:
        """Float in [0, 1], `collective_seconds / total_seconds` (0 when `total_seconds` is 0)."""
        return self.collective_seconds / self.total_seconds if self.total_seconds > 0 else 0.0

    def to_json(self) -> str:
        """Returns the summary as a JSON string (for the coordination store)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSummary:
        """Returns the summary that `to_json` wrote."""
        return cls(**json.loads(text))


class TimelineRecorder:
    """Collects this worker's phases as trace events while one `fit` runs.

    Args:
        task: String, this worker's task name (`"worker:0"`).
        read_marks: `None`, or a callable returning the last train step's
            timestamps per local replica (`StepMarksBuffer.read`); called once
            after each call of the train function.
        steps_per_call: Integer, train steps per call of the train function
            (`steps_per_execution`): the summary counts each call as that
            many steps of equal length.
        progress: The `Progress` to listen to (default: this process's).
        clock: Callable returning the wall time in seconds (for tests).
    """

    def __init__(
        self,
        task: str,
        read_marks: Callable[[], Sequence[Sequence[float]]] | None = None,
        *,
        steps_per_call: int = 1,
        progress: Progress = PROGRESS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.task, self.read_marks, self.steps_per_call = task, read_marks, max(1, int(steps_per_call))
        self._events: list[tuple] = []  # (name, category, ts, dur, tid, args): tuples are a third of dicts.
        self.dropped = 0
        self.step_seconds: list[float] = []
        self.own_seconds: list[float] = []
        self.collective_seconds = 0.0
        self._progress, self._clock = progress, clock
        self._remove: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._epoch_begin: tuple[int, float] | None = None
        self.began: float | None = None
        self.ended: float | None = None

    def start(self) -> None:
        """Starts listening (call once, before `fit`'s own phase begins)."""
        self.began = self._clock()
        self._remove = self._progress.add_listener(self._phase_ended)

    def stop(self) -> None:
        """Stops listening; `summary` and `trace` then describe the whole `fit`."""
        if self._remove is not None:
            self._remove()
            self._remove = None
        self.ended = self._clock()

    def epoch_began(self, epoch: int) -> None:
        """Notes that epoch `epoch` (0-based) began now."""
        self._epoch_begin = (epoch, self._clock())

    def epoch_ended(self, epoch: int) -> None:
        """Adds an event for epoch `epoch` (on its own track), from `epoch_began` to now."""
        if self._epoch_begin is not None and self._epoch_begin[0] == epoch:
            self._add(f"epoch {epoch + 1}", "epoch", self._epoch_begin[1], self._clock(), EPOCHS_TID, {"epoch": epoch})
        self._epoch_begin = None

    def _phase_ended(self, phase: Phase, end_monotonic: float) -> None:
        begin = phase.since
        end = begin + max(0.0, end_monotonic - phase.since_monotonic)
        args: dict[str, object] = {"detail": phase.detail}
        if phase.kind == "step":
            args["epoch"] = self._progress.epoch
            self._step_ended(begin, end)
        self._add(_event_name(phase), _KIND_CATEGORIES.get(phase.kind, phase.kind), begin, end, MAIN_TID, args)
        if phase.kind == "agreement":
            self.collective_seconds += end - begin

    def _step_ended(self, begin, end):
        phases = step_phases(begin, end, latest_marks(self.read_marks()) if self.read_marks is not None else None)
        waited = sum(e - b for name, b, e in phases if name == ALL_REDUCE)
        self.step_seconds.append((end - begin) / self.steps_per_call)
        if any(name == ALL_REDUCE for name, _, _ in phases):  # Only with one step per call.
            self.own_seconds.append(end - begin - waited)
        self.collective_seconds += waited
        for name, b, e in phases:  # A merged phase ("all-reduce + apply") takes its last part's category.
            self._add(name, _CATEGORIES[name.split(" + ")[-1]], b, e, MAIN_TID, {})

    def _add(self, name, category, begin, end, tid, args):
        with self._lock:
            if len(self._events) >= MAX_EVENTS:
                if not self.dropped:
                    warnings.warn(
                        f"keras-dist timeline: more than {MAX_EVENTS} events in one fit; later events are not "
                        "kept (the step times of the report still count them). Fix: a shorter fit per timeline, "
                        "e.g. fewer epochs or steps_per_epoch.",
                        errors.KerasDistWarning,
                        stacklevel=2,
                    )
                self.dropped += 1
                return
            ts = round(begin * 1e6)
            # Integer microseconds, the end rounded alike: an event inside another stays inside it.
            self._events.append((name, category, ts, max(0, round(end * 1e6) - ts), tid, args))

    def summary(self) -> WorkerSummary:
        """Returns this worker's `WorkerSummary` of the `fit` recorded."""
        ended = self.ended if self.ended is not None else self._clock()
        all_measured = bool(self.step_seconds) and len(self.own_seconds) == len(self.step_seconds)
        return WorkerSummary(
            task=self.task,
            steps=len(self.step_seconds) * self.steps_per_call,
            median_step_seconds=statistics.median(self.step_seconds) if self.step_seconds else None,
            median_own_seconds=statistics.median(self.own_seconds) if all_measured else None,
            collective_seconds=self.collective_seconds,
            total_seconds=max(0.0, ended - (self.began if self.began is not None else ended)),
        )

    def trace(self, pid: int) -> dict:
        """Returns the Chrome trace of the events recorded (see `chrome_trace`), under process id `pid`."""
        with self._lock:
            recorded = list(self._events)
        events = [
            {"name": n, "cat": c, "ph": "X", "ts": ts, "dur": dur, "tid": tid, "args": args}
            for n, c, ts, dur, tid, args in recorded
        ]
        return chrome_trace(events, pid=pid, process_name=self.task, dropped=self.dropped)


def _event_name(phase):
    if phase.kind in ("step", "callback"):
        return phase.detail  # "train step 13", "ModelCheckpoint.on_epoch_end"
    return phase.kind  # "fit", "test_step", "saving", "agreement" (their detail in args)


def chrome_trace(events: Sequence[dict], *, pid: int, process_name: str, dropped: int = 0) -> dict:
    """Returns a Chrome trace (the JSON object `chrome://tracing` and Perfetto open) of one worker's events.

    Args:
        events: Complete events (`"ph": "X"`) with `name`, `cat`, `ts` and
            `dur` (microseconds since the Unix epoch), `tid` and `args`.
        pid: Integer, the worker's process id in the trace (its index among
            the cluster's tasks, chief first), so that the files of several
            workers load together.
        process_name: String, the worker's task name (`"worker:1"`).
        dropped: Integer, events not kept (recorded in the metadata).

    Returns:
        Dict `{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}`:
        metadata events naming the process and its tracks, then the events
        sorted by start time (an enclosing event before the events inside it).
    """
    ordered = sorted(events, key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    metadata = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process_name}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": MAIN_TID, "args": {"name": "phases"}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": EPOCHS_TID, "args": {"name": "epochs"}},
    ]
    return {
        "traceEvents": metadata + [{**event, "pid": pid} for event in ordered],
        "displayTimeUnit": "ms",
        "otherData": {"task": process_name, "dropped_events": dropped},
    }


def straggler_report(
    summaries: Sequence[WorkerSummary], *, threshold: float = STRAGGLER_THRESHOLD, missing: Sequence[str] = ()
) -> str:
    """Returns the chief's table of every worker's step times, naming the slowest worker when it is much slower.

    In synchronous training every worker's step lasts as long as the slowest
    worker's: the fast ones wait for it in the gradient all-reduce. So the
    workers are compared by their own work per step (the step minus its
    all-reduce phase) where every worker measured it, else by the whole step.

    Args:
        summaries: One `WorkerSummary` per worker that reported, chief first.
        threshold: Float, the slowest worker is named when its median is more
            than `1 + threshold` times the fastest's. Defaults to 0.2 (20%).
        missing: Task names of the workers whose summary did not arrive.

    Returns:
        A string of several lines (no trailing newline).

    Example:
    >>> fast = WorkerSummary("worker:0", 10, 0.100, 0.060, 4.0, 10.0)
    >>> slow = WorkerSummary("worker:1", 10, 0.101, 0.090, 0.5, 10.0)
    >>> print(straggler_report([fast, slow]).splitlines()[-1])
    worker:1 is the slowest: its median step (own work, without waiting in collectives) is 50% longer than the fastest's (worker:0).
    """
    header = f"{'worker':<12}{'steps':>7}{'median step (ms)':>18}{'own work (ms)':>15}{'collective wait (%)':>21}"
    lines = ["keras-dist timeline: step times per worker in this fit", header]
    for s in summaries:
        step = "-" if s.median_step_seconds is None else f"{s.median_step_seconds * 1e3:.2f}"
        own = "-" if s.median_own_seconds is None else f"{s.median_own_seconds * 1e3:.2f}"
        lines.append(f"{s.task:<12}{s.steps:>7}{step:>18}{own:>15}{s.collective_share * 100:>21.1f}")
    for task in missing:
        lines.append(f"{task:<12}  (no report: it did not publish its numbers in time)")
    comparable = [s for s in summaries if s.median_step_seconds is not None]
    by_own = bool(comparable) and all(s.median_own_seconds is not None for s in comparable)
    if not by_own and comparable:
        lines.append(
            "(own work not measured: the all-reduce inside the step was not timed, see docs/timeline.md; "
            "comparing whole steps)"
        )
    if len(comparable) < 2:
        return "\n".join(lines)
    key = (lambda s: s.median_own_seconds) if by_own else (lambda s: s.median_step_seconds)
    slowest, fastest = max(comparable, key=key), min(comparable, key=key)
    if key(fastest) > 0 and key(slowest) > (1 + threshold) * key(fastest):
        what = "median step (own work, without waiting in collectives)" if by_own else "median step"
        longer = round((key(slowest) / key(fastest) - 1) * 100)
        lines.append(
            f"{slowest.task} is the slowest: its {what} is {longer}% longer than the fastest's ({fastest.task})."
        )
    return "\n".join(lines)


def gather_summaries(
    own: WorkerSummary,
    tasks: Sequence[str],
    *,
    is_chief: bool,
    key_prefix: str,
    put: Callable[[str, str], None],
    get: Callable[[str, float], str | None],
    timeout_seconds: float = 30.0,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[list[WorkerSummary], list[str]] | None:
    """Publishes this worker's summary; on the chief, returns every worker's.

    Not a collective: each non-chief worker writes its summary under
    `key_prefix + task` and returns; the chief reads the others' keys,
    waiting up to `timeout_seconds` in all (a worker that never publishes,
    e.g. one without the timeline on, delays the report, never hangs it).

    Args:
        own: This worker's `WorkerSummary`.
        tasks: Task names of every worker, chief first (`own.task` among them).
        is_chief: Boolean, this worker prints the report.
        key_prefix: String, unique to this `fit` in the cluster.
        put: Callable `(key, value)` writing the store.
        get: Callable `(key, timeout_seconds)` returning the value, or `None`
            when it was not set within the timeout.
        timeout_seconds: Float, the chief's wait for all the others, in seconds.
        clock: Monotonic clock in seconds (for tests).

    Returns:
        On the chief, `(summaries, missing)`: the summaries in `tasks`' order
        and the task names that did not arrive; elsewhere `None`.
    """
    if not is_chief:
        put(key_prefix + own.task, own.to_json())
        return None
    deadline = clock() + timeout_seconds
    summaries, missing = [], []
    for task in tasks:
        if task == own.task:
            summaries.append(own)
            continue
        text = get(key_prefix + task, max(0.001, deadline - clock()))
        if text is None:
            missing.append(task)
        else:
            summaries.append(WorkerSummary.from_json(text))
    return summaries, missing
