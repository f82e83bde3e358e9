"""The files of a `BackupAndRestore` backup: each save a complete new pair, each resume the newest complete one.

A backup is a pair of files in `backup_dir`: Keras' weights file
(`latest.weights.h5`) and `training_metadata.json`, whose
`keras_dist_weights_sha256` is the SHA-256 of the weights it goes with.

Saving (`commit`, on the chief, after the weights were written to
`next.weights.h5` by every worker's `save_weights`): the new metadata is
written completely under a temporary name first; from then on only renames
follow, which need no disk space. With `double_checkpoint=True` the previous
pair is renamed to `previous.weights.h5` and `previous_training_metadata.json`; then the new metadata and the
new weights are renamed into place. At every instant some metadata file names
weights that exist with that content, so a crash (or a full disk) during a
save leaves the previous complete backup usable.

Resuming (`choose`, on every worker, reading only): the newest metadata
(`keras_dist_generation`) that parses and whose weights are found with the
recorded hash, under any of the three weights names. A bad file is named in a
`KerasDistWarning` when another pair is used instead, and in an `OSError`
when none is complete (never a silent fresh start).
"""

import dataclasses
import hashlib
import json
import os
import shutil
import warnings

import numpy as np
import tensorflow as tf

try:
    import resource
except ImportError:  # Not on Windows.
    resource = None  # type: ignore[assignment]

from keras_dist import errors
from keras_dist._runtime import backup_and_restore as keras_backup
from keras_dist.callbacks import _coordination

WEIGHTS_SHA256_KEY = "keras_dist_weights_sha256"
GENERATION_KEY = "keras_dist_generation"
NEXT_WEIGHTS_NAME = "next.weights.h5"
PREVIOUS_WEIGHTS_NAME = "previous.weights.h5"  # Not Keras' `latest.weights.h5.bkp`: Keras loads `*.weights.h5` only.
PREVIOUS_METADATA_NAME = "previous_training_metadata.json"
_CHUNK_BYTES = 1 << 22


@dataclasses.dataclass(frozen=True)
class Backup:
    """One complete backup found in `backup_dir`.

    Attributes:
        weights_path: String, the weights file whose content the metadata's hash names.
        metadata_path: String, the `training_metadata.json` (or its `.bkp`) it was read from.
        metadata: Dict, the parsed metadata (`"epoch"`, `"batch"`, keras-dist's keys).
    """

    weights_path: str
    metadata_path: str
    metadata: dict

    @property
    def generation(self):
        """Integer, how many saves the run had made when this one was written (0 when not recorded)."""
        return int(self.metadata.get(GENERATION_KEY, 0))


def next_weights_path(backup):
    """Returns where a save writes its new weights before they are renamed into place."""
    return os.path.join(os.fspath(backup.backup_dir), NEXT_WEIGHTS_NAME)


def previous_weights_path(backup):
    """Returns where `double_checkpoint=True` keeps the previous backup's weights."""
    return os.path.join(os.fspath(backup.backup_dir), PREVIOUS_WEIGHTS_NAME)


def previous_metadata_path(backup):
    """Returns where `double_checkpoint=True` keeps the previous backup's metadata."""
    return os.path.join(os.fspath(backup.backup_dir), PREVIOUS_METADATA_NAME)


def file_sha256(path):
    """Returns the SHA-256 hex digest of the file at `path` (local or any `tf.io.gfile` file system)."""
    digest = hashlib.sha256()
    with tf.io.gfile.GFile(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


class NoRoomError(OSError):
    """`check_room`'s error: no room for the next backup (its message already names the path and the fix)."""


def check_room(backup, model):
    """Raises before a save when `backup_dir` has no room for the new weights; the chief only.

    HDF5 may crash the process (not raise) when a weights write fails half
    way, so the room is checked first: the size of the current weights file
    (the same model writes the same size), or of the model's and optimizer's
    variables before the first save, against the disk's free space and this
    process's file-size limit (`ulimit -f`). Remote file systems are not checked.

    Raises:
        NoRoomError (an `OSError`): Less room than that; it names the directory, the sizes and the fix.
    """
    directory = os.fspath(backup.backup_dir)
    if not os.path.isdir(directory):
        return
    weights = keras_backup.weights_path(backup)
    if tf.io.gfile.exists(weights):
        needed = tf.io.gfile.stat(weights).length
    else:
        variables = list(model.weights) + list(getattr(model.optimizer, "variables", []))
        needed = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)
    free = shutil.disk_usage(directory).free
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0] if resource is not None else -1
    if limit not in (-1, getattr(resource, "RLIM_INFINITY", -1)) and limit < needed:
        raise NoRoomError(
            f"BackupAndRestore cannot write its next backup in {directory!r}: the weights file needs about "
            f"{needed} bytes, but this process's file-size limit (ulimit -f, RLIMIT_FSIZE) is {limit} bytes. "
            f"{kept(backup)} Fix: raise the limit (`ulimit -f unlimited`), or pass another `backup_dir`."
        )
    if free < needed:
        raise NoRoomError(
            f"BackupAndRestore cannot write its next backup in {directory!r}: the weights file needs about "
            f"{needed} bytes and the disk has {free} bytes free. {kept(backup)} Expected: room for a second "
            "copy of the weights while a save runs. Fix: free disk space there, or pass another `backup_dir` "
            "to BackupAndRestore (a file system with room)."
        )


def kept(backup):
    """Returns a sentence saying whether a previous backup remains for a resume."""
    if tf.io.gfile.exists(keras_backup.weights_path(backup)):
        return "The previous backup is intact (a resume uses it)."
    return "No previous backup exists yet."


def commit(backup, metadata, *, generation, keep_previous):
    """Makes the weights in `next_weights_path(backup)` and `metadata` the backup; the chief only.

    Args:
        backup: The `keras.callbacks.BackupAndRestore`.
        metadata: Dict of JSON values (`"epoch"`, `"batch"`, keras-dist's keys);
            the weights' hash and `generation` are added.
        generation: Integer, this save's number in the run.
        keep_previous: Boolean, keep the previous pair as `previous*`
            (`double_checkpoint=True`); otherwise it is replaced.

    Raises:
        OSError: The metadata could not be written (the previous backup is
            left as it was) or a rename failed.
    """
    new_weights = next_weights_path(backup)
    weights, metadata_path = keras_backup.weights_path(backup), keras_backup.metadata_path(backup)
    metadata = {**metadata, GENERATION_KEY: generation, WEIGHTS_SHA256_KEY: file_sha256(new_weights)}
    with _coordination.atomic_path(metadata_path) as temporary:  # Renamed into place when the block ends.
        with tf.io.gfile.GFile(temporary, "w") as f:
            f.write(json.dumps(metadata))
        if keep_previous:
            for current, previous in (
                (weights, previous_weights_path(backup)),
                (metadata_path, previous_metadata_path(backup)),
            ):
                if tf.io.gfile.exists(current):
                    tf.io.gfile.rename(current, previous, overwrite=True)
    tf.io.gfile.rename(new_weights, weights, overwrite=True)


def choose(backup):
    """Returns the newest complete backup in `backup.backup_dir`, or `None` when it holds none (a fresh start).

    Args:
        backup: A `keras.callbacks.BackupAndRestore`.

    Returns:
        `Backup`, or `None` when there is no metadata and no weights file
        (a directory that does not exist, or a first save that never
        completed: only `next.weights.h5`).

    Raises:
        OSError: Backup files exist but none is complete (every metadata
            file is missing, unreadable or garbage, or names weights that are
            missing, truncated or corrupted). Nothing is overwritten.

    Distributed behavior:
        Every worker calls it at the start of `fit` and reads the same files;
        nothing is exchanged.
    """
    latest, previous = keras_backup.weights_path(backup), previous_weights_path(backup)
    pairs = (
        (keras_backup.metadata_path(backup), (latest, next_weights_path(backup), previous)),
        (previous_metadata_path(backup), (previous, latest, next_weights_path(backup))),
    )
    hashes = {}
    found, bad = [], []
    for metadata_path, weights_paths in pairs:
        if not tf.io.gfile.exists(metadata_path):
            continue
        try:
            metadata = _read_metadata(metadata_path)
        except (ValueError, tf.errors.OpError) as e:
            bad.append((None, f"{metadata_path!r} (not valid training metadata: {e})"))
            continue
        weights = _matching_weights(metadata, weights_paths, hashes)
        if weights is None:
            description = (
                f"{weights_paths[0]!r} (missing, truncated or corrupted: its SHA-256 is not the one "
                f"{metadata_path!r} records)"
            )
            bad.append((int(metadata.get(GENERATION_KEY, 0)), description))
            continue
        found.append(Backup(weights, metadata_path, metadata))
    if not found:
        leftovers = [p for p in (latest, previous) if tf.io.gfile.exists(p)]
        if bad or leftovers:
            raise OSError(_none_complete_message(backup, [text for _, text in bad], leftovers))
        return None
    chosen = max(found, key=lambda b: b.generation)  # `max` keeps the first of equals: the current pair.
    # An older pair whose weights were replaced is what a save cut short leaves: not worth a warning.
    newer_bad = [text for generation, text in bad if generation is None or generation > chosen.generation]
    if newer_bad:
        warnings.warn(
            f"BackupAndRestore: the backup file {' and '.join(newer_bad)} is not complete; resuming from the previous "
            f"complete backup instead: {chosen.weights_path!r} with {chosen.metadata_path!r} (epoch "
            f"{chosen.metadata.get('epoch')}, generation {chosen.generation}). The steps after it are trained "
            "again.",
            errors.KerasDistWarning,
            stacklevel=3,
        )
    return chosen


def _read_metadata(path):
    with tf.io.gfile.GFile(path) as f:
        metadata = json.loads(f.read())
    if not isinstance(metadata, dict) or not isinstance(metadata.get("epoch"), int):
        raise ValueError(f'expected a JSON object with an integer "epoch", received {str(metadata)[:80]!r}')
    return metadata


def _matching_weights(metadata, weights_paths, hashes):
    """The first of `weights_paths` whose content has the metadata's hash (its fixed partner when it has none)."""
    expected = metadata.get(WEIGHTS_SHA256_KEY)
    if expected is None:  # Written by Keras itself or an older keras-dist: the fixed partner, unchecked.
        return weights_paths[0] if tf.io.gfile.exists(weights_paths[0]) else None
    for path in weights_paths:
        if path not in hashes:
            hashes[path] = file_sha256(path) if tf.io.gfile.exists(path) else None
        if hashes[path] == expected:
            return path
    return None


def _none_complete_message(backup, bad, leftovers):
    problems = bad or [f"{p!r} (weights with no training metadata)" for p in leftovers]
    return (
        f"BackupAndRestore found no complete backup in {os.fspath(backup.backup_dir)!r} to resume from: "
        f"{'; '.join(problems)}. Expected: a training_metadata.json and the weights file it names (keras-dist "
        "keeps the previous pair as previous.weights.h5 and previous_training_metadata.json with BackupAndRestore(double_checkpoint=True)). keras-dist does not "
        "start from scratch over a backup. Fix: restore the files from a copy, or delete the directory (or pass "
        "another backup_dir) to train from the start."
    )
