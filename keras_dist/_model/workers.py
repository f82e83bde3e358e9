"""What a `DistributedModel` does about the other workers: agreement, chief-only output, lost peers.

`agreement` is the model's `WorkerAgreement` (chief-only writes, a stop on any
worker stopping all). `naming_lost_workers` turns TensorFlow's errors about a
peer that crashed, stopped answering or ran other collectives into errors that
name the worker and say what to do.
"""

import contextlib

import tensorflow as tf

from keras_dist._runtime import variables
from keras_dist.callbacks import _coordination as callbacks_coordination
from keras_dist.collectives import _all_reduce as collectives_all_reduce
from keras_dist.monitor import _stall
from keras_dist.strategy import _cluster, _peer_errors, _plan, _resolve

# What TensorFlow raises when a peer crashed, stopped answering or missed a collective.
PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.AbortedError)
_AGREEMENT = "_keras_dist_agreement"


def agreement(model):
    """The `WorkerAgreement` of `model`'s strategy (made again when the model moved to another strategy)."""
    found = model.__dict__.get(_AGREEMENT)
    if found is None or found.strategy is not model._distribute_strategy:
        found = callbacks_coordination.WorkerAgreement(model._distribute_strategy)
        model.__dict__[_AGREEMENT] = found
    return found


def chief_only_verbosity(model, kwargs):
    """`kwargs` with `verbose=0` on a worker other than the chief."""
    if variables.is_multi_worker(model._distribute_strategy) and not _plan.is_chief(model._distribute_strategy):
        kwargs = {**kwargs, "verbose": 0}
    return kwargs


@contextlib.contextmanager
def naming_lost_workers(model):
    """Re-raises a lost or out-of-step peer's TensorFlow error as one that names it (several workers only)."""
    if not variables.is_multi_worker(model._distribute_strategy):
        yield
        return
    try:
        yield
    except (tf.errors.InvalidArgumentError, tf.errors.InternalError) as e:  # Mismatched collectives raise either.
        info = _cluster.cluster_from_environment()
        if collectives_all_reduce.GRADIENT_STRUCTURE_MISMATCH in e.message:
            raise RuntimeError(_peer_errors.gradient_structure_message(info, e.message)) from e
        mismatched = "collective" in e.message.lower() and (
            isinstance(e, tf.errors.InvalidArgumentError)
            or "expected type" in e.message
            or "mismatch" in e.message.lower()
        )
        if not mismatched:
            raise
        raise RuntimeError(_peer_errors.out_of_step_message(info, e.message)) from e
    except PEER_ERRORS as e:
        _stall.raise_if_stalled(e)  # The stall watchdog aborted the collectives: its verdict names who.
        during = "collective" if isinstance(e, tf.errors.DeadlineExceededError) else "training"
        raise _peer_errors.worker_unavailable_error(
            _cluster.cluster_from_environment(),
            e.message,
            during=during,
            timeouts=_resolve.timeouts_from_environment(),
        ) from e
