"""TensorFlow's coordination service key-value store, and aborting this process's collectives.

Private TensorFlow API (`tensorflow.python.eager.context`), hence `_runtime`. The
store lives on the coordination leader (the chief, or worker 0) that
`MultiWorkerMirroredStrategy` already runs; keras-dist starts no service of
its own. Reads take a timeout and release the GIL while they wait; writes
have none (a frozen leader blocks them), so callers write from a thread of
their own.
"""

import tensorflow as tf
from tensorflow.python.eager import context


def available():
    """True when this process runs TensorFlow's coordination service (a multi-worker cluster)."""
    return context.context().coordination_service is not None


def put(key, value):
    """Sets `key` to `value` (strings), replacing a value already there."""
    ctx = context.context()
    try:
        ctx.delete_config_key_value(key)
    except tf.errors.NotFoundError:
        pass
    ctx.set_config_key_value(key, value)


def insert_once(key, value):
    """Sets `key` to `value` unless it is set already; returns whether this call set it."""
    try:
        context.context().set_config_key_value(key, value)
    except tf.errors.AlreadyExistsError:
        return False
    return True


def get(key, timeout_seconds):
    """Returns the value of `key`, waiting up to `timeout_seconds` (> 0) for it to be set; `None` if it was not."""
    try:
        return context.context().get_config_key_value(key, max(1, int(timeout_seconds * 1000)))
    except (tf.errors.DeadlineExceededError, tf.errors.NotFoundError):
        return None


def abort_collectives(message):
    """Makes every pending and later collective of this process fail with `UnavailableError(message)`.

    TensorFlow's own health check does the same when a peer is down; the
    process cannot run collectives afterwards (it must restart).
    """
    context.context().abort_collective_ops(tf.errors.UNAVAILABLE, message)
