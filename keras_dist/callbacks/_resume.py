"""Resume after failure: mid-epoch backups, agreed saves on SIGTERM, and the "restart me" exit status.

Keras' `BackupAndRestore` restores the epoch only: a backup taken in the middle
of an epoch replays that epoch from its start, on weights that already include
part of it (more steps than an uninterrupted run). keras-dist records how many
steps of the epoch were done, skips those batches of the input when it
resumes, and on SIGTERM (a scheduler's preemption notice) has every worker
agree to save once at the same step, then exit with `RESTART_EXIT_STATUS`.
"""

import contextlib
import os
import signal
import threading
import warnings

import keras
import tensorflow as tf

from keras_dist import errors
from keras_dist._process import RESTART_EXIT_STATUS as RESTART_EXIT_STATUS  # noqa: E402 (75, EX_TEMPFAIL; re-exported)
from keras_dist._runtime import backup_and_restore as keras_backup
from keras_dist._runtime import datasets as runtime_datasets
from keras_dist._runtime import distribute_dataset as runtime_distribute_dataset
from keras_dist.callbacks import _backup_files as backup_files
from keras_dist.strategy import _plan

STEPS_KEY = "keras_dist_steps_done_in_epoch"
GLOBAL_BATCH_KEY = "keras_dist_global_batch_size"
NUM_WORKERS_KEY = "keras_dist_num_workers"
NUM_REPLICAS_KEY = "keras_dist_num_replicas_in_sync"
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


class ResumePoint:
    """Where `fit` resumes: the backup found, the steps of its epoch it had done, how many the input skips.

    Args:
        steps: Integer, steps done in the epoch when the backup was taken.
        found: The `_backup_files.Backup` resumed from, or `None`.

    Attributes:
        steps: Integer, as passed.
        found: As passed.
        skipped: Integer, batches actually skipped: `steps`; or the same
            examples counted in batches of a new global batch size; or 0 when
            the input's position cannot be mapped (its length is unknown or
            infinite, `steps_per_epoch` is set, the new global batch size does
            not divide the examples done, FILE sharding on another number of
            workers): the epoch is then replayed from its start, as Keras
            does. `None` until `fit` distributes its training input.
        global_batch_size: Integer, this `fit`'s global batch size (recorded
            in the backups it writes), `None` until the training input is
            distributed or when it cannot be told.
    """

    def __init__(self, steps, found=None):
        self.steps = steps
        self.found = found
        self.skipped = None if steps else 0
        self.global_batch_size = None
        self.input_seen = False
        self.backup = None  # The `BackupAndRestore` that `found` belongs to.

    @classmethod
    def of(cls, backup, *, by_step=True):
        """Returns the `ResumePoint` of the newest complete backup of `backup` (`_backup_files.choose`).

        Args:
            backup: A `keras.callbacks.BackupAndRestore`.
            by_step: Boolean; `False` resumes at the backup's epoch (an input
                built per worker, such as a `DatasetCreator`).

        Raises:
            OSError: Backup files exist but none is complete.
        """
        found = backup_files.choose(backup)
        steps = int(found.metadata.get(STEPS_KEY, 0)) if found is not None and by_step else 0
        point = cls(steps, found=found)
        point.backup = backup
        return point


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
def skipping_resumed_steps(model, point, can_skip, batch_size=None):
    """Records the training input's global batch size and skips the batches a backup had done, while `fit` runs.

    The training input is the first one `fit` hands to
    `strategy.experimental_distribute_dataset` (seen through a hook of
    `keras_dist._runtime.distribute_dataset`, after `keras_dist.data`'s
    routing when that is installed). Its global batch size is recorded in
    `point` (and so in every backup). When resuming `point.steps` into an
    epoch, its first iterator is advanced by the batches that hold the
    examples done (`steps` global batches of the backup's size: the data
    position is the global step's, the same on any number of workers and
    replicas), so the resumed epoch runs only the rest. Keras then finds the
    epoch short and warns that the input "ran out of data"; that warning is
    silenced for this call only. A position that cannot be mapped replays
    the epoch from its start with a `KerasDistWarning` (`_mapped_steps`).

    Args:
        model: The `DistributedModel` whose `fit` runs.
        point: This `fit`'s `ResumePoint`.
        can_skip: Boolean, `epoch_length_is_known` of the training input.
        batch_size: Integer, `fit`'s global `batch_size` for arrays (Keras'
            array pipeline hides it from the dataset when the last batch is
            partial), or `None`.
    """
    strategy = model.distribute_strategy

    def distribute(dataset, options, distribute_next):
        distributed = distribute_next(dataset, options=options)  # May be keras_dist.data's routing.
        if point.input_seen:  # The first input fit distributes is the training input.
            return distributed
        point.input_seen = True
        point.global_batch_size = runtime_datasets.batch_size_of(dataset) or batch_size
        if point.steps:
            point.skipped, problem = _mapped_steps(model, point, can_skip)
            if problem:
                warnings.warn(problem, errors.KerasDistWarning, stacklevel=2)
            if point.skipped:
                distributed = _SkipOnFirstIteration(distributed, point.skipped)
        return distributed

    try:
        with runtime_distribute_dataset.hooking(strategy, distribute), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_RAN_OUT_OF_DATA)
            yield
    finally:
        if point.skipped is None:
            point.skipped = 0


def _mapped_steps(model, point, can_skip):
    """Returns `(batches to skip, warning or None)`: the backup's data position in this input's batches."""
    replay = (
        "the epoch is replayed from its start, on the backup's weights (Keras' behaviour: its examples done "
        "before the backup are trained again)"
    )
    saved = point.found.metadata if point.found is not None else {}
    if not can_skip:
        return 0, (
            f"The backup was taken {point.steps} steps into an epoch, but this input's epoch length is unknown, "
            f"infinite or set by `steps_per_epoch`, so skipping those batches would not shorten the epoch: {replay}. "
            "Fix: a finite input of known length (no `filter`/`repeat`, no `steps_per_epoch`), or "
            "`BackupAndRestore(save_freq='epoch')`."
        )
    saved_topology = _describe_topology(saved.get(NUM_WORKERS_KEY), saved.get(NUM_REPLICAS_KEY))
    topology = _describe_topology(_num_workers(model), model.distribute_strategy.num_replicas_in_sync)
    plan = getattr(model, "input_plan", None)
    if (
        saved.get(NUM_WORKERS_KEY) not in (None, _num_workers(model))
        and plan is not None
        and plan.auto_shard_policy == "file"
    ):
        return 0, (
            f"The backup was taken {point.steps} steps into an epoch on {saved_topology}; this run has {topology} "
            f"and shards its input by FILE, so each worker reads other files and the examples done cannot be "
            f"found again: {replay}. Fix: `DistributedModel(..., auto_shard_policy='data')` (the position is "
            "then the global step's on any number of workers), or `BackupAndRestore(save_freq='epoch')`."
        )
    saved_batch, batch = saved.get(GLOBAL_BATCH_KEY), point.global_batch_size
    if saved_batch is None or batch is None or saved_batch == batch:
        return point.steps, None
    examples = point.steps * saved_batch
    if examples % batch:
        return 0, (
            f"The backup was taken {point.steps} steps into an epoch with a global batch size of {saved_batch} "
            f"({saved_topology}), i.e. after {examples} examples; this run's global batch size is {batch} "
            f"({topology}), which does not divide {examples}: {replay}. Fix: pass the backup's global batch "
            f"size (`batch_size={saved_batch}`; keras-dist splits it over any number of replicas), or "
            "`BackupAndRestore(save_freq='epoch')`."
        )
    return examples // batch, (
        f"The backup was taken with a global batch size of {saved_batch} ({saved_topology}); this run's is {batch} "
        f"({topology}). Resuming after the same {examples} examples ({examples // batch} batches of {batch}), but "
        "the steps that follow differ from the interrupted run's (another batch per step), so the result will "
        f"not match an uninterrupted run. Fix: pass `batch_size={saved_batch}` (the global batch; keras-dist "
        "splits it over any number of replicas, unevenly when it must)."
    )


def _num_workers(model):
    return _plan.cluster_info_of(model.distribute_strategy).num_workers


def _describe_topology(num_workers, num_replicas):
    if num_workers is None or num_replicas is None:
        return "a topology not recorded"
    return f"{num_workers} worker(s), {num_replicas} replica(s) in sync"


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
    """Makes `backup` restore the newest complete backup, and write on the chief only, atomically, by generations.

    Args:
        backup: A `keras.callbacks.BackupAndRestore`.
        agreement: The model's `WorkerAgreement`.
        point: The `ResumePoint` of this `fit` (its skipped steps are added
            to the step count of backups taken in the first epoch; its global
            batch size and this run's workers and replicas are recorded).

    Each save writes a complete new pair (weights, then metadata naming their
    SHA-256) before it replaces the previous one (`_backup_files.commit`);
    `double_checkpoint=True` keeps the previous pair (`previous.weights.h5`), for a resume
    to fall back to when the newest is damaged.

    Raises:
        OSError (from the save, on the chief): the backup could not be written
            (e.g. the disk is full); the previous backup is left intact.
        OSError (from `on_train_begin`): backup files exist but none is complete.
    """
    state = {"epoch": 0, "first_epoch": True, "frozen": False, "at_epoch_end": False, "found": None, "generation": 0}

    def offset():
        return (point.skipped or 0) if state["first_epoch"] else 0

    def on_train_begin(logs=None):
        found = point.found if point.backup is backup else backup_files.choose(backup)
        state["found"], state["generation"] = found, found.generation if found is not None else 0
        if found is not None:
            keras_backup.load_from(backup, found.weights_path, found.metadata_path)

    def save(steps_this_run):
        """Writes the weights (every worker calls it), then the chief commits them with the metadata."""
        if state["frozen"]:
            return
        epoch, steps = state["epoch"], steps_this_run + offset()
        total = (backup.params or {}).get("steps")
        if state["at_epoch_end"] or (total and steps >= total):
            epoch, steps = epoch + 1, 0  # A finished epoch: resume at the next one's start.
        if _plan.is_chief(agreement.strategy) and not tf.io.gfile.exists(backup.backup_dir):
            tf.io.gfile.makedirs(backup.backup_dir)
        metadata = {
            "epoch": epoch,
            "batch": max(steps - 1, 0),
            STEPS_KEY: steps,
            GLOBAL_BATCH_KEY: point.global_batch_size,
            NUM_WORKERS_KEY: _plan.cluster_info_of(agreement.strategy).num_workers,
            NUM_REPLICAS_KEY: agreement.strategy.num_replicas_in_sync,
        }
        state["generation"] += 1
        with _naming_a_failed_save(backup):
            agreement.chief_writes(
                lambda _: backup_files.check_room(backup, backup.model), backup.backup_dir, atomic=False
            )
            backup.model.save_weights(filepath=backup_files.next_weights_path(backup), overwrite=True)
            agreement.chief_writes(
                lambda path: backup_files.commit(
                    backup, metadata, generation=state["generation"], keep_previous=backup.double_checkpoint
                ),
                keras_backup.metadata_path(backup),
                atomic=False,  # `commit` writes under temporary names and renames them itself.
            )

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
        on_train_begin=on_train_begin,
        save_model=save_model,
        on_epoch_begin=on_epoch_begin,
        on_epoch_end=on_epoch_end,
        on_train_end=on_train_end,
        save_for_preemption=save_for_preemption,
    )


@contextlib.contextmanager
def _naming_a_failed_save(backup):
    """Turns a write error of a save (a full disk, a file-size limit) into one that names the path and the fix."""
    try:
        yield
    except backup_files.NoRoomError:
        raise  # Already names the path and the fix.
    except (OSError, tf.errors.OpError) as e:
        directory = os.fspath(backup.backup_dir)
        raise OSError(
            f"BackupAndRestore could not write its backup in {directory!r}: {e}. {backup_files.kept(backup)} "
            f"Expected: room in {directory!r} for a second copy of the weights while a save runs. Fix: free disk "
            "space there, or pass another `backup_dir` to BackupAndRestore (a file system with room)."
        ) from e
