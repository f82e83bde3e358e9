"""Makes standard Keras callbacks safe on several workers, inside `DistributedModel.fit`.

On W workers Keras runs every callback on every worker. Writes go through
`DistributedModel.save` / `save_weights` (chief only, atomic, then every worker
continues); callbacks that only write logs run on the chief; `BackupAndRestore`
reads on every worker and writes on the chief; and a stop requested on any
worker stops every worker at the same boundary.
"""

import json

import keras
import tensorflow as tf

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


def adapt_callbacks(callbacks, model, agreement):
    """Returns the callbacks `fit` should run on this worker.

    Args:
        callbacks: The user's list of `keras.callbacks.Callback` (or `None`).
        model: The `DistributedModel`.
        agreement: Its `WorkerAgreement`.

    Returns:
        A new list: log-only callbacks dropped on non-chief workers,
        `BackupAndRestore` made chief-writing, and an `AgreeOnStop` last.
        Unchanged (a copy) with one worker.
    """
    callbacks = list(callbacks or [])
    if not agreement.multi_worker:
        return callbacks
    is_chief = _plan.is_chief(model.distribute_strategy)
    adapted = []
    for callback in callbacks:
        if isinstance(callback, _CHIEF_ONLY) and not is_chief:
            continue
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            _write_backups_on_chief(callback, agreement)
        adapted.append(callback)
    stops_alone = [c for c in adapted if _may_stop_alone(c)]
    adapted.append(AgreeOnStop(agreement, every_batch=bool(stops_alone)))
    return adapted


def _may_stop_alone(callback):
    if isinstance(callback, _DECIDE_ON_REDUCED_LOGS):
        return False
    batch_hooks = ("on_train_batch_end", "on_batch_end", "on_train_batch_begin", "on_batch_begin")
    return any(getattr(type(callback), hook) is not getattr(keras.callbacks.Callback, hook) for hook in batch_hooks)


class AgreeOnStop(keras.callbacks.Callback):
    """Stops every worker when a callback on any worker set `model.stop_training`.

    Runs last on every worker: at each epoch end (and each batch end when a
    callback that may decide alone is present: one that is not a standard
    Keras callback reading reduced logs and overrides a batch hook) the
    workers all-reduce their `stop_training` flags. Without it, a worker that
    stops alone leaves the others waiting in the next step's collective.

    Args:
        agreement: The model's `WorkerAgreement`.
        every_batch: Also agree after every training batch (one small
            all-reduce per batch).
    """

    def __init__(self, agreement, every_batch):
        super().__init__()
        self.agreement = agreement
        self.every_batch = every_batch

    def on_train_batch_end(self, batch, logs=None):
        if self.every_batch:
            self._agree()

    def on_epoch_end(self, epoch, logs=None):
        self._agree()

    def _agree(self):
        self.model.stop_training = self.agreement.any(bool(self.model.stop_training))


def _write_backups_on_chief(callback, agreement):
    """Makes a `BackupAndRestore` write its metadata on the chief only, atomically; every worker reads it."""

    def save_model():
        if _plan.is_chief(agreement.strategy) and not tf.io.gfile.exists(callback.backup_dir):
            tf.io.gfile.makedirs(callback.backup_dir)
        callback.model.save_weights(filepath=callback._weights_path, overwrite=True)  # Chief-only, atomic, agreed.

        def write_metadata(path):
            with tf.io.gfile.GFile(path, "w") as f:
                f.write(json.dumps({"epoch": callback._current_epoch, "batch": callback._last_batch_seen}))

        agreement.chief_writes(write_metadata, callback._training_metadata_path)

    original_train_end = callback.on_train_end

    def on_train_end(logs=None):
        agreement.barrier()
        if _plan.is_chief(agreement.strategy):
            original_train_end(logs)

    if callback.double_checkpoint:
        raise ValueError(
            "BackupAndRestore(double_checkpoint=True) is not supported on several workers yet: "
            "keras-dist writes each backup atomically instead (a crash never leaves a half file). "
            "Received: double_checkpoint=True. Fix: pass double_checkpoint=False."
        )
    callback._save_model = save_model
    callback.on_train_end = on_train_end
