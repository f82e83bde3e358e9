"""What the workers agree on outside the training step: a flag any worker raised, and the chief's writes."""

import contextlib
import os
import uuid

import tensorflow as tf

from keras_dist._env import WRITE_TIMEOUT_ENV
from keras_dist._runtime import variables
from keras_dist.monitor._progress import PROGRESS
from keras_dist.strategy import _plan

DEFAULT_WRITE_TIMEOUT_SECONDS = 120.0


class WorkerAgreement:
    """Collectives run between steps, from Python, on every worker of `strategy`.

    Args:
        strategy: The model's `tf.distribute.Strategy`. With one worker every
            method is local and sends nothing.

    Distributed behavior:
        Every method is a collective under `MultiWorkerMirroredStrategy`:
        every worker must call it at the same point (callbacks at the same
        batch or epoch boundary do).
    """

    def __init__(self, strategy):
        self.strategy = strategy
        self.multi_worker = variables.is_multi_worker(strategy)
        self._sum = None

    def any(self, flag):
        """Returns True on every worker when `flag` (bool) is True on at least one."""
        return self.any_of([flag])[0]

    def any_of(self, flags, timeout_seconds=None):
        """Returns, for each of `flags` (list of bools), whether it is True on at least one worker (one all-reduce).

        Raises:
            tf.errors.DeadlineExceededError: `timeout_seconds` passed before
                every worker joined.
        """
        if not self.multi_worker:
            return [bool(flag) for flag in flags]
        return [value > 0 for value in self._summed([1.0 if flag else 0.0 for flag in flags], timeout_seconds)]

    def summed(self, values):
        """Returns each of `values` (list of floats) summed over the workers (one all-reduce; float32).

        With one worker, `values` as floats. Integers summing to less than
        2**24 over all replicas come back exact.
        """
        if not self.multi_worker:
            return [float(v) for v in values]
        # Every replica of this worker contributes the value: the all-reduce sums each worker's once per replica.
        local_replicas = len(self.strategy.extended.worker_devices)
        return [v / local_replicas for v in self._summed(list(values))]

    def barrier(self):
        """Returns once every worker has called it."""
        if self.multi_worker:
            self._summed([0.0])

    def _summed(self, values, timeout_seconds=None):
        if self._sum is None:
            self._sum = {}
        if timeout_seconds not in self._sum:
            strategy = self.strategy
            options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout_seconds)

            @tf.function
            def summed(value):
                def replica_fn(value):
                    value = tf.identity(value)  # On this replica's device: the all-reduce needs one.
                    context = tf.distribute.get_replica_context()
                    return context.all_reduce(tf.distribute.ReduceOp.SUM, value, options=options)

                return strategy.experimental_local_results(strategy.run(replica_fn, args=(value,)))[0]

            self._sum[timeout_seconds] = summed
        with PROGRESS.phase("agreement", "the workers' agreement all-reduce (stop flags, writes)", collective=True):
            return [float(v) for v in self._sum[timeout_seconds](tf.constant(values, tf.float32)).numpy()]

    def chief_writes(self, write, filepath, atomic=True, extensions=(".keras", ".h5", ".hdf5", ".json")):
        """Runs `write(path)` on the chief only, atomically, and returns when every worker knows it is done.

        The chief writes to a temporary name in the same directory (same
        extension, so Keras picks the same format) and renames it to
        `filepath`: a crash mid-write leaves the previous file, never a half
        one. Other workers write nothing and wait for the chief.

        Args:
            write: Callable taking the path to write to.
            filepath: String or `os.PathLike`, the user's path (local or any
                `tf.io.gfile` file system).
            atomic: Boolean. False, or a path that is not one file Keras can
                write (a directory, an unknown extension, a missing parent
                directory), writes on the user's path directly, so Keras'
                own errors name it.
            extensions: Tuple of the endings Keras accepts for this write;
                another ending is written directly, for Keras to refuse.

        Returns:
            What `write` returned on the chief, `None` elsewhere.

        Raises:
            RuntimeError: On a non-chief worker, when the chief's write failed
                (the chief raises the original error); on the chief, when the
                other workers did not join within `KERAS_DIST_WRITE_TIMEOUT`
                seconds (default 120) after the write: they did not call
                `save` (e.g. a save guarded by `if keras_dist.is_chief():`).
        """
        with PROGRESS.phase("saving", f"saving {os.fspath(filepath)!r}"):
            return self._chief_writes(write, filepath, atomic, extensions)

    def _chief_writes(self, write, filepath, atomic, extensions):
        if self.multi_worker and not _plan.is_chief(self.strategy):
            if self.any(False):
                raise RuntimeError(
                    f"The chief failed to write {os.fspath(filepath)!r}; its log has the error. "
                    "Expected: the chief writes the files the user asked for and the other workers "
                    "wait for it. Fix: the cause on the chief (often a missing or read-only directory)."
                )
            return None
        timeout = float(os.environ.get(WRITE_TIMEOUT_ENV, "") or DEFAULT_WRITE_TIMEOUT_SECONDS)
        try:
            if atomic and writes_one_file(filepath, extensions):
                with atomic_path(filepath) as temporary:
                    result = write(temporary)
            else:  # A directory, or a name Keras will refuse: Keras' own write and message, on the user's path.
                result = write(os.fspath(filepath))
        except BaseException:
            self._tell_the_others(True, timeout, filepath)
            raise
        self._tell_the_others(False, timeout, filepath)
        return result

    def _tell_the_others(self, failed, timeout, filepath):
        """On the chief: all-reduces whether its write failed; the others are already waiting in it."""
        if not self.multi_worker:
            return
        try:
            self.any_of([failed], timeout_seconds=timeout)
        except tf.errors.DeadlineExceededError as e:
            raise RuntimeError(
                f"The chief wrote {os.fspath(filepath)!r}, but the other workers did not join it within "
                f"{timeout:g} s. Expected: every worker calls `save` / `save_weights` (keras-dist writes on "
                "the chief only and makes the others wait for it). Received: no call from the other workers, "
                "e.g. a save guarded by `if keras_dist.is_chief():`. Fix: call `model.save(...)` on every "
                f"worker. ({WRITE_TIMEOUT_ENV} sets this wait, in seconds.)"
            ) from e


def writes_one_file(filepath, extensions):
    """True when `filepath` names one file (one of `extensions`, in an existing directory, not a directory)."""
    filepath = os.fspath(filepath)
    directory = os.path.dirname(filepath) or "."
    return filepath.endswith(tuple(extensions)) and tf.io.gfile.isdir(directory) and not tf.io.gfile.isdir(filepath)


@contextlib.contextmanager
def atomic_path(filepath):
    """Yields a temporary path next to `filepath`; renames it to `filepath` when the block succeeds.

    The temporary name keeps `filepath`'s full extension (`.weights.h5`,
    `.keras`, `.json`). On failure the temporary file is removed and
    `filepath` is untouched.
    """
    filepath = os.fspath(filepath)
    directory, name = os.path.split(filepath)
    stem, dot, extension = name.partition(".")
    temporary = os.path.join(directory, f".{stem}.tmp-{uuid.uuid4().hex[:8]}{dot}{extension}")
    try:
        yield temporary
        tf.io.gfile.rename(temporary, filepath, overwrite=True)
    finally:
        if tf.io.gfile.exists(temporary):
            tf.io.gfile.remove(temporary)
