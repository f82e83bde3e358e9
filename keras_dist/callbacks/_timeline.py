"""`Timeline`: a Chrome-trace timeline of each worker's `fit`, and the chief's straggler report."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

from keras_dist import _env, errors
from keras_dist._runtime import coordination
from keras_dist.callbacks._coordination import atomic_path
from keras_dist.monitor import _timeline
from keras_dist.strategy import _plan

GATHER_TIMEOUT_SECONDS = 30.0
_FITS = itertools.count()  # Per process: every worker counts its fits with a timeline alike.


class Timeline(keras.callbacks.Callback):
    """Records each worker's `fit` as a step timeline, and prints which worker is slowest at the end.

    Each worker writes `<directory>/timeline-<task_type>-<task_id>.json`, a
    Chrome trace (open it in `chrome://tracing` or https://ui.perfetto.dev;
    the files of several workers load together, one process per worker). It
    holds one event per phase: `fit`, each train step (`"train step 13"`)
    and, inside it, `input` (from the call of the train function until this
    worker's batch is on every local replica), `forward/backward`,
    `all-reduce` (from the last gradient until the summed gradients are
    back: what the workers wait for each other), `apply` and `outputs`
    (metrics, returning the logs); each callback hook by class and method
    (`"ModelCheckpoint.on_epoch_end"`), `saving`, the workers' `agreement`
    between steps, validation (`evaluate`, `test_step`), and the epochs on a
    track of their own. The boundaries inside a step are timestamps taken in
    the step's graph on every local replica; each is the time the last of
    them passed it. They are recorded with keras-dist's own `train_step`, or
    a `train_step` of your own whose gradients keras-dist weights (the
    default `custom_step_losses="mean"`), under several replicas and
    `steps_per_execution=1`; otherwise the step is one event. The file is
    written atomically at the end of `fit`, also when `fit` fails.

    With `report=True`, at the end of `fit` the chief prints each worker's
    number of steps, median step time, median own work per step (the step
    without its all-reduce phase) and the share of `fit`'s time spent
    waiting in collectives (the gradient all-reduce and the agreement), and
    names the slowest worker when its median own work is more than 20%
    longer than the fastest's (see `keras_dist.monitor._timeline.straggler_report`).

    `KERAS_DIST_TIMELINE=<directory>` adds a `Timeline(directory)` to every
    `DistributedModel.fit` that has none (on every worker: set it where you
    start them, e.g. before `keras-dist launch`).

    Cost: with no `Timeline` the train step is unchanged (no op is added).
    With one, each step takes 4 timestamps per replica and the host reads
    them after each step (a few tens of microseconds), and the first `fit`
    with (or again without) it traces the train function anew.

    Args:
        directory: String or `os.PathLike` (a local path or any
            `tf.io.gfile` file system), where each worker writes its file;
            created if missing. `None`: no file, the report only.
        report: Boolean, the chief prints the report at the end of each
            `fit`. Defaults to `True`.

    Raises:
        ValueError: `directory` is `None` and `report` is `False` (nothing to do).

    Distributed behavior:
        Runs on every worker (each writes its own file). The report is not a
        collective: each worker publishes its numbers in TensorFlow's
        coordination service and the chief waits for them up to 30 s in
        all; a worker that never publishes (no timeline on it) is listed as
        missing.

    Example:
    >>> import keras_dist
    >>> timeline = keras_dist.callbacks.Timeline("/tmp/timeline")
    >>> timeline.filename("worker", 1)
    'timeline-worker-1.json'
    """

    def __init__(self, directory: str | os.PathLike | None = None, *, report: bool = True) -> None:
        super().__init__()
        if directory is None and not report:
            raise ValueError(
                "Timeline needs a `directory` to write to, or `report=True`. Received: directory=None, "
                "report=False. Fix: pass a directory, e.g. Timeline('timeline/'), or leave report=True."
            )
        self.directory = None if directory is None else os.fspath(directory)
        self.report = bool(report)
        self.path: str | None = None
        self.report_text: str | None = None
        self.recorder: _timeline.TimelineRecorder | None = None
        self._recording = False

    @staticmethod
    def filename(task_type: str, task_id: int) -> str:
        """Returns the name of a worker's file, `timeline-<task_type>-<task_id>.json`."""
        return f"timeline-{task_type}-{task_id}.json"

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if not self._recording:
            warnings.warn(
                "keras_dist.callbacks.Timeline records the `fit` of a `keras_dist.DistributedModel` only; this "
                "`fit` is not recorded. Fix: train a DistributedModel (or `keras_dist.distribute(model)`).",
                errors.KerasDistWarning,
                stacklevel=2,
            )

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self._recording and self.recorder is not None:
            self.recorder.epoch_began(epoch)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self._recording and self.recorder is not None:
            self.recorder.epoch_ended(epoch)

    @contextlib.contextmanager
    def recording(self, model: keras.Model, read_marks: Any = None) -> Iterator[_timeline.TimelineRecorder]:
        """Records `model`'s phases while the block (one `fit`) runs; then writes the file and the report.

        `DistributedModel.fit` enters it around Keras' `fit`. On an exception
        the file is written (with what was recorded) and no report is made.

        Args:
            model: The `DistributedModel` being trained.
            read_marks: `None`, or a callable returning the last step's
                timestamps per local replica (`StepMarksBuffer.read`).

        Yields:
            The `TimelineRecorder` of this `fit`.
        """
        info = _plan.cluster_info_of(model.distribute_strategy)
        tasks = list(info.addresses()) or [info.task_name]
        fit_index = next(_FITS)
        steps_per_call = getattr(model, "steps_per_execution", 1) or 1
        recorder = _timeline.TimelineRecorder(info.task_name, read_marks, steps_per_call=steps_per_call)
        self.recorder, self._recording = recorder, True
        recorder.start()
        failed = True
        try:
            yield recorder
            failed = False
        finally:
            recorder.stop()
            self._recording = False
            self._finish(recorder, info, tasks, fit_index, failed)

    def _finish(self, recorder, info, tasks, fit_index, failed):
        if self.directory is not None:
            try:
                self.path = self._write(recorder, info, tasks)
            except Exception as e:  # noqa: BLE001 (while `fit` fails: its own error is the one to see)
                if not failed:
                    raise
                warnings.warn(f"keras-dist timeline: could not write the file: {e}", errors.KerasDistWarning, 2)
        if self.report and not failed:
            self.report_text = self._report(recorder, info, tasks, fit_index)

    def _write(self, recorder, info, tasks):
        tf.io.gfile.makedirs(self.directory)
        path = os.path.join(self.directory, self.filename(info.task_type, info.task_id))
        trace = recorder.trace(pid=tasks.index(info.task_name) if info.task_name in tasks else 0)
        with atomic_path(path) as temporary, tf.io.gfile.GFile(temporary, "w") as f:
            json.dump(trace, f)
        return path

    def _report(self, recorder, info, tasks, fit_index):
        own = recorder.summary()
        if len(tasks) > 1 and coordination.available():
            gathered = _timeline.gather_summaries(
                own,
                tasks,
                is_chief=info.is_chief,
                key_prefix=f"keras_dist/timeline/{fit_index}/",
                put=_put_in_background,
                get=coordination.get,
                timeout_seconds=GATHER_TIMEOUT_SECONDS,
            )
        else:
            gathered = ([own], [])
        if gathered is None:  # Not the chief: published.
            return None
        text = _timeline.straggler_report(gathered[0], missing=gathered[1])
        print(text, flush=True)
        return text


def _put_in_background(key, value):
    """`coordination.put`, given 10 s (the store's writes have no timeout; a frozen chief would block them)."""
    thread = threading.Thread(target=coordination.put, args=(key, value), daemon=True, name="keras-dist-timeline")
    thread.start()
    thread.join(10.0)


def timeline_in(callbacks: Sequence[keras.callbacks.Callback] | None) -> Timeline | None:
    """Returns the first `Timeline` among `callbacks`, or `None`."""
    return next((c for c in callbacks or () if isinstance(c, Timeline)), None)


def from_environment(environ: Any = None) -> Timeline | None:
    """Returns `Timeline(KERAS_DIST_TIMELINE)` when that variable is set and not empty, else `None`."""
    directory = (os.environ if environ is None else environ).get(_env.TIMELINE_ENV, "").strip()
    return Timeline(directory) if directory else None
