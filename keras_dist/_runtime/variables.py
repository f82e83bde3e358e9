"""Re-home Keras variables onto a `tf.distribute.Strategy`, keeping their objects.

A Keras 3 variable (`keras.Variable`) wraps a `tf.Variable` in `_value`. A
variable created outside `strategy.scope()` wraps a plain `tf.Variable` that the
strategy cannot mirror. Re-homing creates a new backing `tf.Variable` under the
strategy's scope with the current value, so every Python reference to the Keras
variable (layers, optimizer slots, user code) stays valid.
"""

import numpy as np
import tensorflow as tf

_AGGREGATIONS = {
    "none": tf.VariableAggregation.NONE,
    "sum": tf.VariableAggregation.SUM,
    "mean": tf.VariableAggregation.MEAN,
    "only_first_replica": tf.VariableAggregation.ONLY_FIRST_REPLICA,
}


def is_multi_replica(strategy):
    """Returns whether `strategy` mirrors variables (more than one replica, or multi-worker)."""
    return isinstance(strategy.extended, _MIRRORING_EXTENDEDS)


def is_multi_worker(strategy):
    """Returns whether `strategy` is a `MultiWorkerMirroredStrategy` spanning more than one worker."""
    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and strategy.extended._in_multi_worker_mode()


def _mirroring_extendeds():
    from tensorflow.python.distribute import mirrored_strategy, tpu_strategy

    return (mirrored_strategy.MirroredExtended, tpu_strategy.TPUExtended)


_MIRRORING_EXTENDEDS = _mirroring_extendeds()


def _belongs_to(tf_variable, strategy):
    """Returns whether `tf_variable` was created under `strategy`'s scope."""
    owner = getattr(tf_variable, "_distribute_strategy", None)
    if is_multi_replica(strategy):
        return isinstance(tf_variable, tf.distribute.DistributedValues) and owner is strategy
    if isinstance(tf_variable, tf.distribute.DistributedValues):
        return False
    # OneDeviceStrategy places its variables on its device and refuses others as slot colocations;
    # under the default strategy any plain variable is fine.
    return owner is strategy or not isinstance(strategy, tf.distribute.OneDeviceStrategy)


def _needs_rehome(variable, strategy):
    value = variable._value
    if value is None:  # Deferred (stateless scope): created later, under the right scope.
        return False
    if not _belongs_to(value, strategy):
        return True
    return (
        isinstance(value, tf.distribute.DistributedValues)
        and value.aggregation != _AGGREGATIONS[variable.aggregation]
    )


def _current_value(tf_variable):
    """Returns the value of `tf_variable` as one NumPy array (summed for on-read sums)."""
    if isinstance(tf_variable, tf.distribute.DistributedValues):
        strategy = tf_variable._distribute_strategy
        with strategy.scope():
            return np.asarray(tf_variable.read_value())
    return np.asarray(tf_variable.numpy())


def rehome(variable, strategy):
    """Re-creates the `tf.Variable` behind one Keras variable under `strategy.scope()`.

    Args:
        variable: `keras.Variable` (TensorFlow backend) of any shape and dtype.
        strategy: `tf.distribute.Strategy` that must own the variable.

    Returns:
        `True` when the backing variable was replaced, `False` when it already
        belonged to `strategy` with the right aggregation.

    Distributed behavior:
        Runs in cross-replica context, eagerly, before any step function is
        traced. Not a collective. On-read variables with `SUM` aggregation
        (metric totals) keep their cross-replica sum: TensorFlow divides the
        assigned value between the replicas.
    """
    if not _needs_rehome(variable, strategy):
        return False
    value = _current_value(variable._value)
    # The new tf.Variable keeps the old one's `trainable` flag, not the Keras variable's: a frozen
    # layer's kernel is still a trainable tf.Variable, so that GradientTape watches it once the
    # layer is unfrozen (Keras only flips its own flag).
    keras_trainable = variable._trainable
    variable._trainable = getattr(variable._value, "trainable", keras_trainable)
    try:
        with strategy.scope():
            variable._initialize(value)
            if variable.synchronization == "on_read" and variable.aggregation == "sum":
                variable._value.assign(value)
    finally:
        variable._trainable = keras_trainable
    return True


def set_aggregation(variable, aggregation):
    """Sets the `tf.distribute` aggregation a Keras variable is (re)created with."""
    variable._aggregation = aggregation


def rehome_optimizer(optimizer, strategy):
    """Moves a Keras optimizer (and an inner one, for loss scaling) onto `strategy`.

    Keras' TensorFlow optimizer remembers the strategy that was current when it
    was constructed and keys its slots by the backing `tf.Variable`; both must
    follow the variables when they are re-homed.

    Args:
        optimizer: `keras.optimizers.Optimizer`, built or not.
        strategy: `tf.distribute.Strategy`.

    Returns:
        Integer, the number of optimizer variables that were re-created.
    """
    moved = 0
    for opt in _optimizer_chain(optimizer):
        opt._distribution_strategy = strategy
        for variable in opt.variables:
            moved += rehome(variable, strategy)
    return moved


def reindex_optimizer(optimizer):
    """Rebuilds an optimizer's slot index after model variables were re-homed."""
    for opt in _optimizer_chain(optimizer):
        if getattr(opt, "built", False) and hasattr(opt, "_trainable_variables"):
            opt._trainable_variables_indices = {
                opt._var_key(v): i for i, v in enumerate(opt._trainable_variables)
            }


def _optimizer_chain(optimizer):
    chain = [optimizer]
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        chain.append(inner)
    return chain


SEED_STATE_NAME = "seed_generator_state"


def decorrelate_seed_state(variable, strategy, *, first_replica_id=0):
    """Gives every replica's copy of a Keras `SeedGenerator` state its own seed.

    Keras mirrors a seed generator's `[seed, counter]` state like any variable,
    so every replica draws the same random numbers (identical dropout masks on
    different examples). Adding the replica's id to the seed makes the draws
    independent, as they are across the examples of one device's batch.

    Args:
        variable: `keras.Variable` named `"seed_generator_state"`, shape `(2,)`.
        strategy: The multi-replica `tf.distribute.Strategy` that mirrors it.
        first_replica_id: Integer, the global id of this worker's first replica.

    Distributed behavior:
        Cross-replica context, eager; not a collective. Replica 0 keeps the
        user's seed, so one replica draws what one device would.
    """
    for offset, component in enumerate(strategy.experimental_local_results(variable.value)):
        replica_id = first_replica_id + offset
        if replica_id:
            value = component.read_value()
            component.assign(value + tf.constant([replica_id, 0], dtype=value.dtype))
