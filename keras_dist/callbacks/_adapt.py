"""Makes standard Keras callbacks safe on several workers, inside `DistributedModel.fit`.

On W workers Keras runs every callback on every worker. Writes go through
`DistributedModel.save` / `save_weights` (chief only, atomic, then every worker
continues); callbacks that only write logs run on the chief; `BackupAndRestore`
reads on every worker and writes on the chief; and a stop requested on any
worker stops every worker at the same boundary.
"""

import keras

from keras_dist import _compat
from keras_dist._runtime import backup_and_restore as keras_backup
from keras_dist._runtime import keras_internals as ki
from keras_dist.callbacks import _resume as resume
from keras_dist.callbacks import _timeline as timeline
from keras_dist.strategy import _plan

# Callbacks whose only effect is files or console output: run on the chief alone.
_CHIEF_ONLY = (keras.callbacks.CSVLogger, keras.callbacks.TensorBoard, keras.callbacks.ProgbarLogger)

# Callbacks that never set `stop_training` on their own worker alone: their decisions read the
# logs, which are reduced over all workers, so every worker decides alike.
_DECIDE_ON_REDUCED_LOGS = (
    keras.callbacks.History,
    keras.callbacks.ModelCheckpoint,
    keras.callbacks.BackupAndRestore,
    keras.callbacks.CSVLogger,
    keras.callbacks.TensorBoard,
    keras.callbacks.ProgbarLogger,
    keras.callbacks.TerminateOnNaN,
    keras.callbacks.EarlyStopping,
    keras.callbacks.ReduceLROnPlateau,
    keras.callbacks.LearningRateScheduler,
)


def adapt_callbacks(callbacks, model, agreement, resume_point=None):
    """Returns the callbacks `fit` should run on this worker.

    Args:
        callbacks: The user's list of `keras.callbacks.Callback` (or `None`).
        model: The `DistributedModel`.
        agreement: Its `WorkerAgreement`.
        resume_point: The `ResumePoint` of this `fit` (steps of the first
            epoch a `BackupAndRestore` backup had done), or `None`.

    Returns:
        A new list: log-only callbacks dropped on non-chief workers,
        `BackupAndRestore` made resumable mid-epoch and chief-writing, a
        `Timeline` when `KERAS_DIST_TIMELINE` asks for one and there is
        none, and an `AgreeOnStop` last. With one worker and no `BackupAndRestore`,
        the same callbacks (a copy) and `AgreeOnStop`, which then only
        reads this worker's flag.
    """
    callbacks = list(callbacks or [])
    is_chief = _plan.is_chief(model.distribute_strategy)
    adapted = []
    for callback in callbacks:
        if agreement.multi_worker and isinstance(callback, _CHIEF_ONLY) and not is_chief:
            continue
        adapted.append(callback)
    backups = resume.backups_in(adapted)
    for backup in backups:
        resume.make_resumable(backup, agreement, resume_point or resume.ResumePoint(0))
    if timeline.timeline_in(adapted) is None and timeline.from_environment() is not None:
        adapted.append(timeline.from_environment())
    stops_alone = agreement.multi_worker and any(_may_stop_alone(c) for c in adapted)
    adapted.append(AgreeOnStop(agreement, every_batch=bool(stops_alone or backups), backups=backups))
    if _compat.is_active("exhausted_input_iteration_count"):
        adapted.insert(0, ExactIterationCount())  # First: callbacks that save at epoch end see the exact count.
    return adapted


class ExactIterationCount(keras.callbacks.Callback):
    """Sets `optimizer.iterations` back to the steps an epoch ran, when the input ran out (compat fix).

    See docs/compat.md, `exhausted_input_iteration_count`. Counts the raw
    counter of the innermost optimizer (micro-batches under accumulation).
    Only with `steps_per_execution=1`, where Keras' last call of an epoch
    is a plain `get_next` that can fail after the increment ran, and only
    for an epoch that ran fewer steps than it expects (its length unknown,
    or a resumed epoch that skipped the steps done). Never sets the counter
    below what it read after the epoch's first step that moved it, plus one
    step's increments for each step after that one.
    """

    def on_epoch_begin(self, epoch, logs=None):
        self._last, self._steps, self._per_step, self._counted_steps = self._count(), 0, None, 0

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1
        if self._per_step is None:
            # A step may apply the optimizer more than once (keras.io's image captioning: once per caption), so
            # the counter's increments per step are read, after the epoch's first step that moved it (a new-user
            # probe: a step with two `apply_gradients` ended at 14 iterations instead of 28). A step a
            # `LossScaleOptimizer` skips for an inf or NaN gradient does not move it: read from the epoch's
            # first step, that 0 set the counter back to the epoch's start at its end (another probe:
            # 0 iterations instead of 18, Adam's bias correction restarting each epoch, weights 0.25 off).
            count = self._count()
            if count > self._last:
                self._per_step = count - self._last
            self._last, self._counted_steps = count, self._steps

    def on_epoch_end(self, epoch, logs=None):
        if (getattr(self.model, "steps_per_execution", 1) or 1) != 1 or self._per_step is None:
            return
        total = (self.params or {}).get("steps")
        if total is not None and self._steps >= total:
            # Every step the epoch expects ran: its end was not found by running out, no extra call ran (a probe:
            # a `LossScaleOptimizer` applied twice per step, one apply skipped, was set back to 14 from 26).
            return
        # At most what the counter read last plus the steps after it, each moving it as the one read did.
        expected = self._last + (self._steps - self._counted_steps) * self._per_step
        if self._count() > expected:
            ki.raw_iterations(self.model.optimizer).assign(expected)

    def _count(self):
        return int(keras.ops.convert_to_numpy(ki.raw_iterations(self.model.optimizer)))


def _may_stop_alone(callback):
    if isinstance(callback, _DECIDE_ON_REDUCED_LOGS):
        return False
    batch_hooks = ("on_train_batch_end", "on_batch_end", "on_train_batch_begin", "on_batch_begin")
    return any(getattr(type(callback), hook) is not getattr(keras.callbacks.Callback, hook) for hook in batch_hooks)


class AgreeOnStop(keras.callbacks.Callback):
    """Stops every worker when a callback on any worker set `model.stop_training`, or on SIGTERM.

    Runs last on every worker: at train begin, at each epoch begin and end (and each batch end when a
    callback that may decide alone is present: one that is not a standard
    Keras callback reading reduced logs and overrides a batch hook; or when
    a `BackupAndRestore` makes the run resumable) the workers all-reduce
    their `stop_training` flags and whether SIGTERM arrived. Without it, a
    worker that stops alone leaves the others waiting in the next step's
    collective. After SIGTERM on any worker, every worker saves one backup
    at that same step and stops; `DistributedModel.fit` then exits with
    `RESTART_EXIT_STATUS`.

    Args:
        agreement: The model's `WorkerAgreement`.
        every_batch: Also agree after every training batch (one small
            all-reduce per batch under several workers) when this worker, or
            any other (agreed at `on_train_begin`), asks for it.
        backups: The `BackupAndRestore` callbacks made resumable.
    """

    def __init__(self, agreement, every_batch, backups=()):
        super().__init__()
        self.agreement = agreement
        self.every_batch = every_batch
        self.backups = list(backups)
        self.preempted = False
        self._steps_this_epoch = 0

    def on_train_begin(self, logs=None):
        # Workers may hold different callbacks (e.g. one added only `if keras_dist.task_id() == 1`);
        # the per-batch all-reduce must run on all of them or none. A stop set by a callback's
        # on_train_begin is agreed in the same all-reduce.
        self.every_batch, stop = self.agreement.any_of([self.every_batch, bool(self.model.stop_training)])
        self.model.stop_training = stop

    def on_epoch_begin(self, epoch, logs=None):
        self._steps_this_epoch = 0
        # Keras acts on a stop set in on_epoch_begin after the epoch's first batch: agree on it now.
        self.model.stop_training = self.agreement.any(bool(self.model.stop_training))

    def on_train_batch_end(self, batch, logs=None):
        self._steps_this_epoch = batch + 1  # Keras passes the last step's index (steps_per_execution).
        if self.every_batch:
            self._agree()

    def on_epoch_end(self, epoch, logs=None):
        if not self.preempted:
            self._agree()

    def _agree(self):
        stop, preempt = self.agreement.any_of([bool(self.model.stop_training), resume.PREEMPTION.requested])
        if preempt and self.backups and not self.preempted:
            self.preempted = True
            for backup in self.backups:
                keras_backup.save_for_preemption(backup, self._steps_this_epoch)
            stop = True
        self.model.stop_training = stop
