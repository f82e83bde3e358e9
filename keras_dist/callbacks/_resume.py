"""Resume after failure: mid-epoch backups, agreed saves on SIGTERM, and the "restart me" exit status.

Keras' `BackupAndRestore` restores the epoch only: a backup taken in the middle
of an epoch replays that epoch from its start, on weights that already include
part of it (more steps than an uninterrupted run). keras-dist records how many
steps of the epoch were done, skips those batches of the input when it
resumes, and on SIGTERM (a scheduler's preemption notice) has every worker
agree to save once at the same step, then exit with `RESTART_EXIT_STATUS`.
"""

import contextlib
import json
import signal
import threading
import warnings

import keras
import tensorflow as tf

from keras_dist import errors
from keras_dist._process import RESTART_EXIT_STATUS as RESTART_EXIT_STATUS  # noqa: E402 (75, EX_TEMPFAIL; re-exported)
from keras_dist._runtime import backup_and_restore as keras_backup
from keras_dist._runtime import distribute_dataset as runtime_distribute_dataset
from keras_dist.strategy import _plan

STEPS_KEY = "keras_dist_steps_done_in_epoch"
_RAN_OUT_OF_DATA = "Your input ran out of data"


class _Preemption:
    """Whether this process received SIGTERM while `fit` ran (set from the signal handler)."""

    def __init__(self):
        self.requested = False


PREEMPTION = _Preemption()


@contextlib.contextmanager
def catching_sigterm():
    """While the block runs, SIGTERM only sets `PREEMPTION.requested` (main thread only; else a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum, frame):
        del signum, frame
        PREEMPTION.requested = True

    PREEMPTION.requested = False
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def backups_in(callbacks):
    """Returns the `keras.callbacks.BackupAndRestore` instances in `callbacks`."""
    return [c for c in callbacks or [] if isinstance(c, keras.callbacks.BackupAndRestore)]


def steps_done_in_epoch(backup):
    """Returns how many steps of its epoch the last backup of `backup` had done (0 at an epoch end)."""
    path = keras_backup.metadata_path(backup)
    if not tf.io.gfile.exists(path):
        return 0
    with tf.io.gfile.GFile(path) as f:
        try:
            return int(json.loads(f.read()).get(STEPS_KEY, 0))
        except (ValueError, TypeError):
            return 0


class ResumePoint:
    """Steps of the first epoch a backup had done, and how many of them the input could skip.

    Attributes:
        steps: Integer, steps done in the epoch when the backup was taken.
        skipped: Integer, batches actually skipped (`steps`, or 0 when the
            input's length is unknown or infinite, or `steps_per_epoch` is
            set: the epoch is then replayed from its start, as Keras does);
            `None` until `fit` distributes its training input.
    """

    def __init__(self, steps):
        self.steps = steps
        self.skipped = None if steps else 0


def epoch_length_is_known(x, steps_per_epoch=None):
    """True when Keras knows `fit`'s epoch length from `x` itself, so skipping batches shortens the epoch.

    Args:
        x: `fit`'s `x`: arrays (or a dict/list of them), a `tf.data.Dataset`,
            a `keras.utils.PyDataset`, a generator.
        steps_per_epoch: `fit`'s `steps_per_epoch` (then the length is set,
            and the input is read on across epochs: no skipping).
    """
    if steps_per_epoch:
        return False
    if isinstance(x, tf.data.Dataset):
        return int(x.cardinality()) > 0
    if isinstance(x, keras.utils.PyDataset):
        try:
            return len(x) > 0
        except (TypeError, NotImplementedError):
            return False
    leaves = keras.tree.flatten(x) if isinstance(x, (dict, list, tuple)) else [x]
    return bool(leaves) and all(hasattr(leaf, "shape") and hasattr(leaf, "__getitem__") for leaf in leaves)


@contextlib.contextmanager
def skipping_resumed_steps(model, point, can_skip):
    """Skips the first `steps` batches of the training input's first iteration while `fit` runs.

    The training input is the first one `fit` hands to
    `strategy.experimental_distribute_dataset` (seen through a hook of
    `keras_dist._runtime.distribute_dataset`, after `keras_dist.data`'s
    routing when that is installed); its first iterator is
    advanced by `steps` batches (on every worker alike), so the resumed epoch
    runs only the steps the backup had not done. Keras then finds the epoch
    short and warns that the input "ran out of data"; that warning is
    silenced for this call only.
    """
    if not point.steps:
        yield
        return
    strategy = model.distribute_strategy

    def distribute(dataset, options, distribute_next):
        distributed = distribute_next(dataset, options=options)  # May be keras_dist.data's routing.
        if point.skipped is None:  # The first input fit distributes is the training input.
            if can_skip:
                point.skipped = point.steps
                distributed = _SkipOnFirstIteration(distributed, point.steps)
            else:
                point.skipped = 0
                warnings.warn(
                    f"The backup was taken {point.steps} steps into an epoch, but this input's epoch length "
                    "is unknown, infinite or set by `steps_per_epoch`, so skipping those batches would not "
                    "shorten the epoch: the epoch is replayed from its start, on the backup's weights (Keras' "
                    "behaviour). Fix: a finite input of known length (no `filter`/`repeat`, no "
                    "`steps_per_epoch`), or `BackupAndRestore(save_freq='epoch')`.",
                    errors.KerasDistWarning,
                    stacklevel=2,
                )
        return distributed

    try:
        with runtime_distribute_dataset.hooking(strategy, distribute), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_RAN_OUT_OF_DATA)
            yield
    finally:
        if point.skipped is None:
            point.skipped = 0


class _SkipOnFirstIteration:
    """A distributed dataset whose first iterator starts `steps` batches in."""

    def __init__(self, distributed, steps):
        self._distributed = distributed
        self._steps = steps

    def __iter__(self):
        iterator = iter(self._distributed)
        steps, self._steps = self._steps, 0
        for _ in range(steps):
            next(iterator)
        return iterator

    def __getattr__(self, name):
        return getattr(self._distributed, name)


def make_resumable(backup, agreement, point):
    """Makes `backup` write on the chief only, atomically, with the steps done in the epoch.

    Args:
        backup: A `keras.callbacks.BackupAndRestore`.
        agreement: The model's `WorkerAgreement`.
        point: The `ResumePoint` of this `fit` (its skipped steps are added
            to the step count of backups taken in the first epoch).

    Raises:
        ValueError: `double_checkpoint=True` under several workers.
    """
    if backup.double_checkpoint and agreement.multi_worker:
        raise ValueError(
            "BackupAndRestore(double_checkpoint=True) is not supported on several workers yet: "
            "keras-dist writes each backup atomically instead (a crash never leaves a half file). "
            "Received: double_checkpoint=True. Fix: pass double_checkpoint=False."
        )
    if backup.double_checkpoint:
        warnings.warn(
            "BackupAndRestore(double_checkpoint=True) is not needed with keras-dist, which writes each "
            "backup atomically (a crash never leaves a half file); the previous backup is not kept.",
            errors.KerasDistWarning,
            stacklevel=3,
        )
    state = {"epoch": 0, "first_epoch": True, "frozen": False, "at_epoch_end": False}

    def offset():
        return (point.skipped or 0) if state["first_epoch"] else 0

    def save(steps_this_run):
        """Writes weights, then the metadata, each atomically; the chief writes, every worker waits."""
        if state["frozen"]:
            return
        epoch, steps = state["epoch"], steps_this_run + offset()
        total = (backup.params or {}).get("steps")
        if state["at_epoch_end"] or (total and steps >= total):
            epoch, steps = epoch + 1, 0  # A finished epoch: resume at the next one's start.
        if _plan.is_chief(agreement.strategy) and not tf.io.gfile.exists(backup.backup_dir):
            tf.io.gfile.makedirs(backup.backup_dir)
        backup.model.save_weights(filepath=keras_backup.weights_path(backup), overwrite=True)
        metadata = {"epoch": epoch, "batch": max(steps - 1, 0), STEPS_KEY: steps}

        def write_metadata(path):
            with tf.io.gfile.GFile(path, "w") as f:
                f.write(json.dumps(metadata))

        agreement.chief_writes(write_metadata, keras_backup.metadata_path(backup))

    def save_model():  # Keras calls this at epoch ends (save_freq="epoch") and every `save_freq` batches.
        save(0 if state["at_epoch_end"] else keras_backup.last_batch_seen(backup) + 1)

    # Keras' own methods, kept from the first time: the same callback passed to another `fit` is
    # wrapped again around them, not around the previous wrappers.
    keras_methods = keras_backup.keras_methods(backup)
    keras_epoch_begin = keras_methods["on_epoch_begin"]
    keras_epoch_end, keras_train_end = keras_methods["on_epoch_end"], keras_methods["on_train_end"]

    def on_epoch_begin(epoch, logs=None):
        state["epoch"] = epoch
        keras_epoch_begin(epoch, logs)

    def on_epoch_end(epoch, logs=None):
        state["at_epoch_end"] = True
        try:
            keras_epoch_end(epoch, logs)
        finally:
            state["at_epoch_end"] = False
            state["first_epoch"] = False

    def on_train_end(logs=None):
        agreement.barrier()
        if _plan.is_chief(agreement.strategy) and not state["frozen"]:
            keras_train_end(logs)

    def save_for_preemption(steps_this_run):
        """Saves once at the agreed step; Keras' end-of-epoch save of the cut epoch is then ignored."""
        save(steps_this_run)
        state["frozen"] = True

    keras_backup.replace_methods(
        backup,
        save_model=save_model,
        on_epoch_begin=on_epoch_begin,
        on_epoch_end=on_epoch_end,
        on_train_end=on_train_end,
        save_for_preemption=save_for_preemption,
    )
