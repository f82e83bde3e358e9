"""Keras' `BackupAndRestore` internals that keras-dist reads, and the methods it replaces on an instance.

`keras_dist.callbacks` makes a user's `keras.callbacks.BackupAndRestore`
resumable mid-epoch and chief-writing (see `keras_dist.callbacks._resume`);
the policy lives there. This module is the only place that touches the
callback's private state: the files it writes (`_weights_path`,
`_training_metadata_path`), the batch it last saw (`_last_batch_seen`), its loader (`_load_model`, through `load_from`), and
the methods replaced on the instance, each listed in `replace_methods`.

What happens on each worker: every worker's own callback object is changed
alike; nothing is exchanged.
"""

KERAS_METHODS_KEY = "_keras_dist_keras_methods"  # On the instance: Keras' own methods, kept from the first fit.
SAVE_FOR_PREEMPTION = "keras_dist_save_for_preemption"  # On the instance: set by `replace_methods`.
_REPLACED_HOOKS = ("on_epoch_begin", "on_epoch_end", "on_train_end")


def weights_path(backup):
    """Returns the path `backup` writes its weights to (Keras' private `_weights_path`)."""
    return backup._weights_path


def metadata_path(backup):
    """Returns the path of `backup`'s training-metadata JSON file (Keras' private `_training_metadata_path`)."""
    return backup._training_metadata_path


def load_from(backup, weights_path, metadata_path):
    """Runs Keras' own loader of `backup` (`_load_model`) on these two files instead of its fixed names.

    Keras' loader builds the optimizer when needed, loads the weights and sets
    the model's initial epoch from the metadata's `"epoch"`; its paths are
    restored afterwards.
    """
    kept = backup._weights_path, backup._training_metadata_path
    backup._weights_path, backup._training_metadata_path = weights_path, metadata_path
    try:
        backup._load_model()
    finally:
        backup._weights_path, backup._training_metadata_path = kept


def last_batch_seen(backup):
    """Returns the index of the last training batch `backup` saw this epoch (Keras' private `_last_batch_seen`)."""
    return backup._last_batch_seen


def keras_methods(backup):
    """Returns Keras' own `on_epoch_begin`, `on_epoch_end` and `on_train_end` of `backup`, as a dict.

    Kept on the instance (`_keras_dist_keras_methods`) the first time: the same
    callback passed to another `fit` is wrapped again around Keras' methods,
    not around the previous `fit`'s replacements.
    """
    return backup.__dict__.setdefault(KERAS_METHODS_KEY, {name: getattr(backup, name) for name in _REPLACED_HOOKS})


def replace_methods(
    backup, *, save_model, on_epoch_begin, on_epoch_end, on_train_end, save_for_preemption, on_train_begin=None
):
    """Replaces, on this `BackupAndRestore` instance only, what keras-dist changes about it.

    - `_save_model` (private; Keras calls it at epoch ends and every
      `save_freq` batches): keras-dist's save, atomic, chief-writing, with the
      steps done in the epoch.
    - `on_epoch_begin`, `on_epoch_end`, `on_train_end`: Keras' own methods
      (`keras_methods`) wrapped to track the epoch and to let only the chief
      delete the backup at the end.
    - `keras_dist_save_for_preemption(steps_this_run)` (added): the one save
      every worker makes at the agreed step after SIGTERM (`save_for_preemption`).
    - `on_train_begin` (when given): keras-dist's restore, which picks the
      newest complete backup (Keras' own loads its fixed file names).
    """
    backup._save_model = save_model
    backup.on_epoch_begin = on_epoch_begin
    backup.on_epoch_end = on_epoch_end
    backup.on_train_end = on_train_end
    if on_train_begin is not None:
        backup.on_train_begin = on_train_begin
    setattr(backup, SAVE_FOR_PREEMPTION, save_for_preemption)


def save_for_preemption(backup, steps_this_run):
    """Calls the preemption save that `replace_methods` added to `backup`."""
    getattr(backup, SAVE_FOR_PREEMPTION)(steps_this_run)
