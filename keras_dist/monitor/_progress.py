"""What this worker is doing now: the phase it is in, the steps it finished, how long steps take.

Owns: one `Progress` per process, written by the hooks around `fit`/`evaluate`/
`predict` (keras_dist._model.monitoring: the step functions, each callback,
saving, the workers' agreement) and read by the stall watchdog
(`keras_dist.monitor._stall`) and the step timeline (`keras_dist.monitor._timeline`).
Must not: import TensorFlow or Keras, or cost more than a few attribute writes
per phase on the training path (the watchdog is on by default).

What happens on each worker: every worker records its own phases; the watchdog
publishes them to the other workers (nothing here is exchanged).

Example:
>>> progress = Progress()
>>> with progress.phase("step", "train step 1", collective=True):
...     progress.current().describe()
'train step 1 (fit: forward, backward, all-reduce, apply)'
>>> progress.step_finished(0.25)
>>> progress.steps_finished, progress.median_step_seconds()
(1, 0.25)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import statistics
import threading
import time
from collections.abc import Callable, Iterator

# What each kind of phase waits in, for the messages ("the collective the others wait in").
_WHAT = {
    "script": "the script, outside fit/evaluate/predict",
    "fit": "Keras' loop, between steps",
    "evaluate": "Keras' loop, between steps",
    "predict": "Keras' loop, between steps",
    "step": "fit: forward, backward, all-reduce, apply",
    "test_step": "evaluate: forward, metric all-reduce",
    "predict_step": "predict: forward",
    "callback": "a callback",
    "saving": "saving",
    "agreement": "the workers' agreement all-reduce",
}
_SELF_DESCRIBED = ("script", "agreement")


@dataclasses.dataclass(frozen=True)
class Phase:
    """One thing a worker is doing.

    Attributes:
        kind: String, one of `"script"`, `"fit"`, `"evaluate"`, `"predict"`,
            `"step"` (a train step function: input, forward, backward,
            all-reduce, apply), `"test_step"`, `"predict_step"`, `"callback"`,
            `"saving"`, `"agreement"`.
        detail: String, e.g. `"train step 13"` or `"MyCallback.on_epoch_end"`.
        collective: Boolean, the phase may wait for the other workers in a
            TensorFlow collective: a step function, the agreement, and
            `fit`/`evaluate`/`predict` between steps (Keras' loop all-reduces
            metric results there).
        since: Float, `time.time()` when the phase began (seconds).
        since_monotonic: Float, `time.monotonic()` when the phase began.
    """

    kind: str
    detail: str
    collective: bool
    since: float
    since_monotonic: float

    def describe(self) -> str:
        """Returns e.g. `"train step 13 (fit: forward, backward, all-reduce, apply)"`."""
        what = _WHAT.get(self.kind, self.kind)
        return self.detail if self.kind in _SELF_DESCRIBED else f"{self.detail} ({what})"


class Progress:
    """The phases of this process (a stack: `fit` > `step` or `callback` ...) and its finished train steps.

    Thread-safe for one writer (the main thread) and any number of readers.

    Attributes:
        steps_finished: Integer, train steps finished by this process (all
            `fit` calls; `steps_per_execution` steps per step-function call).
        epoch: Integer, the epoch `fit` is in (0-based), or -1 outside `fit`.
    """

    def __init__(self, *, clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic):
        self._clock, self._monotonic = clock, monotonic
        self._stack: list[Phase] = [
            Phase("script", "the script, outside fit/evaluate/predict", False, clock(), monotonic())
        ]
        self._durations: collections.deque[float] = collections.deque(maxlen=200)
        self._listeners: list[Callable[[Phase, float], None]] = []
        self._lock = threading.Lock()
        self.steps_finished = 0
        self.epoch = -1
        self._changed = monotonic()

    def seconds_in_current(self, now_monotonic: float | None = None) -> float:
        """Returns the seconds since the innermost phase last changed (a phase began or ended)."""
        return (self._monotonic() if now_monotonic is None else now_monotonic) - self._changed

    def current(self) -> Phase:
        """Returns the innermost phase now."""
        return self._stack[-1]

    def stack(self) -> tuple[Phase, ...]:
        """Returns the phases now, outermost first."""
        with self._lock:
            return tuple(self._stack)

    def enter(self, kind: str, detail: str, *, collective: bool = False) -> Phase:
        """Begins a phase; returns it (pass it to `leave`)."""
        phase = Phase(kind, detail, collective, self._clock(), self._monotonic())
        with self._lock:
            self._stack.append(phase)
            self._changed = phase.since_monotonic
        return phase

    def leave(self, phase: Phase) -> None:
        """Ends `phase` (and any phase begun inside it that was not ended, e.g. after an exception)."""
        end = self._monotonic()
        with self._lock:
            if phase in self._stack:
                del self._stack[self._stack.index(phase) :]
            self._changed = end
            listeners = list(self._listeners)
        for listener in listeners:
            listener(phase, end)

    @contextlib.contextmanager
    def phase(self, kind: str, detail: str, *, collective: bool = False) -> Iterator[Phase]:
        """Context manager: `enter` on entry, `leave` on exit (also on an exception)."""
        phase = self.enter(kind, detail, collective=collective)
        try:
            yield phase
        finally:
            self.leave(phase)

    def step_finished(self, seconds: float, steps: int = 1) -> None:
        """Records that `steps` train steps finished, taking `seconds` in all (wall time of the call)."""
        self.steps_finished += steps
        self._durations.append(seconds / max(steps, 1))

    def median_step_seconds(self) -> float | None:
        """Returns the median wall time of the last 200 train steps, in seconds (`None` before the first)."""
        durations = list(self._durations)
        return statistics.median(durations) if durations else None

    def add_listener(self, listener: Callable[[Phase, float], None]) -> Callable[[], None]:
        """Calls `listener(phase, end_monotonic)` when a phase ends; returns a function that removes it."""
        with self._lock:
            self._listeners.append(listener)

        def remove() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return remove


PROGRESS = Progress()
"""This process's `Progress` (the hooks in keras_dist._model.monitoring write it)."""
