"""CPU thread pools per worker: apply `KERAS_DIST_INTRA_OP_THREADS` / `KERAS_DIST_INTER_OP_THREADS`.

TensorFlow sizes its intra-op pool (threads inside one op, e.g. a matmul) and
its inter-op pool (ops run side by side) from the number of cores of the whole
machine. Several workers on one host then start several full-size pools each and
oversubscribe the cores. `keras-dist launch` shares the cores out (see
`keras_dist.cli.launch.threads_per_worker`) and passes the share in these
variables; `import keras_dist` applies them here, before TensorFlow's first
operation (after it, the pool sizes are fixed).

What happens on each worker: every worker reads its own environment once, at
import; nothing is exchanged between workers.
"""

import os
import warnings

import tensorflow as tf

from keras_dist import errors
from keras_dist._env import INTER_OP_THREADS_ENV, INTRA_OP_THREADS_ENV


def requested_threads(environ=None):
    """Returns the thread pool sizes asked for in the environment.

    Args:
        environ: Mapping of environment variables. Defaults to `os.environ`.

    Returns:
        Dict `{"intra_op": n or None, "inter_op": n or None}`; `None` (the
        variable unset, empty or `0`) keeps TensorFlow's default.

    Raises:
        ValueError: A variable is set to something other than an integer >= 0.
    """
    environ = os.environ if environ is None else environ
    requested = {}
    for key, name in (("intra_op", INTRA_OP_THREADS_ENV), ("inter_op", INTER_OP_THREADS_ENV)):
        raw = environ.get(name, "").strip()
        try:
            value = int(raw) if raw else 0
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(
                f"`{name}` must be an integer >= 0 (threads per worker; 0 keeps TensorFlow's default). "
                f"Received: {name}={raw!r}. Fix: `export {name}=1`, or unset it "
                "(`keras-dist launch --threads-per-worker N` sets it for every worker)."
            )
        requested[key] = value or None
    return requested


def apply_requested_threads(environ=None):
    """Sets TensorFlow's intra-op and inter-op pool sizes from the environment, if asked.

    Called once when keras_dist is imported. Too late (TensorFlow already ran an
    operation in this process) means a warning, not an error: the run still
    works, with TensorFlow's default pools.

    Args:
        environ: Mapping of environment variables. Defaults to `os.environ`.

    Returns:
        Dict `{"intra_op": n or None, "inter_op": n or None}`, what was applied.

    Raises:
        ValueError: See `requested_threads`.
    """
    requested = requested_threads(environ)
    setters = {
        "intra_op": tf.config.threading.set_intra_op_parallelism_threads,
        "inter_op": tf.config.threading.set_inter_op_parallelism_threads,
    }
    for key, threads in requested.items():
        if threads is None:
            continue
        try:
            setters[key](threads)
        except RuntimeError:
            warnings.warn(
                f"keras_dist could not set TensorFlow's {key.replace('_', '-')} threads to {threads}: "
                "TensorFlow already ran an operation in this process, which fixes its thread pools. "
                "Fix: put `import keras_dist` before any TensorFlow or Keras code, or unset "
                f"{INTRA_OP_THREADS_ENV} and {INTER_OP_THREADS_ENV}.",
                errors.KerasDistWarning,
                stacklevel=2,
            )
            requested[key] = None
    return requested
