"""CPU threads per worker for `keras-dist launch`: share the host's cores among its workers.

Owns: the arithmetic (`threads_per_worker`) and which setting wins (the flag,
then variables the user exported, then the shared-out default). The workers
apply the result at `import keras_dist` (`keras_dist._runtime.threads`).
Must not: import TensorFlow or Keras (the launcher runs without them).
"""

import os

from keras_dist._env import INTER_OP_THREADS_ENV, INTRA_OP_THREADS_ENV  # Read by keras_dist._runtime.threads at import.


def threads_per_worker(num_local_workers, cpu_count, requested=None):
    """Returns how many CPU threads each of the workers on this host gets.

    TensorFlow sizes its intra-op and inter-op pools by the cores of the whole
    machine, so W workers on one host would run W full-size pools on the same
    cores. By default the cores are shared out instead, as `torchrun` does with
    `OMP_NUM_THREADS`: `cpu_count // num_local_workers` threads each, at least 1.
    One worker on the host keeps TensorFlow's defaults.

    Args:
        num_local_workers: Integer >= 1, the workers this launcher starts on
            this host.
        cpu_count: Integer >= 1, the host's logical cores (`os.cpu_count()`).
        requested: Integer >= 0 from `--threads-per-worker`, or `None` (not
            given): 0 means TensorFlow's defaults, N > 0 means N threads per pool.

    Returns:
        Integer >= 1, threads per pool in each worker, or 0 for TensorFlow's
        defaults.

    Raises:
        ValueError: `num_local_workers` or `cpu_count` < 1, or `requested` < 0.

    Example:
    >>> threads_per_worker(2, 16), threads_per_worker(3, 2), threads_per_worker(1, 16)
    (8, 1, 0)
    >>> threads_per_worker(2, 16, requested=0), threads_per_worker(2, 16, requested=4)
    (0, 4)
    """
    _check_positive_int("num_local_workers", num_local_workers, fix="pass the number of workers on this host.")
    _check_positive_int("cpu_count", cpu_count, fix="pass os.cpu_count().")
    if requested is not None:
        check_threads("requested", requested)
        return requested
    return max(1, cpu_count // num_local_workers) if num_local_workers > 1 else 0


def threads_for_launch(num_local_workers, requested, environ):
    """`--threads-per-worker` wins; else thread variables already exported are kept; else the cores are shared."""
    if requested is None and (environ.get(INTRA_OP_THREADS_ENV) or environ.get(INTER_OP_THREADS_ENV)):
        return None
    return threads_per_worker(num_local_workers, host_cpu_count(), requested)


def check_threads(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"`{name}` must be an integer >= 0 (threads per worker; 0 keeps TensorFlow's default). "
            f"Received: {name}={value!r}. Fix: pass e.g. 1, or 0."
        )


def host_cpu_count():
    """Returns the cores this process may run on (its CPU affinity, else `os.cpu_count()`), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _check_positive_int(name, value, *, fix):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}. Fix: {fix}")
