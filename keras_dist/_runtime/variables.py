"""Re-home Keras variables onto a `tf.distribute.Strategy`, keeping their objects.

A Keras 3 variable (`keras.Variable`) wraps a `tf.Variable` in `_value`. A
variable created outside `strategy.scope()` wraps a plain `tf.Variable` that the
strategy cannot mirror. Re-homing creates a new backing `tf.Variable` under the
strategy's scope with the current value, so every Python reference to the Keras
variable (layers, optimizer slots, user code) stays valid.
"""

import functools

import tensorflow as tf
from keras.src.backend.common import global_state as keras_global_state

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
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and strategy.extended._in_multi_worker_mode()


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
        isinstance(value, tf.distribute.DistributedValues) and value.aggregation != _AGGREGATIONS[variable.aggregation]
    )


def _current_value(tf_variable):
    """Returns the value of `tf_variable` as one tensor (summed for on-read sums).

    A tensor, not a NumPy array: TensorFlow's read shares the variable's buffer,
    where the NumPy round trip made host copies. Re-homing a 1M x 64 float32
    table onto 2 replicas peaked at 2 tables more than raw Keras' build with
    NumPy (`benchmarks/suite.py --workloads recommender`, peak RSS).
    """
    if isinstance(tf_variable, tf.distribute.DistributedValues):
        strategy = tf_variable._distribute_strategy
        with strategy.scope():
            return tf_variable.read_value()
    return tf_variable.read_value()


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
    """Moves a Keras optimizer and every optimizer it wraps onto `strategy`.

    Keras' TensorFlow optimizer remembers the strategy that was current when it
    was constructed and keys its slots by the backing `tf.Variable`; both must
    follow the variables when they are re-homed. A wrapper optimizer
    (`LossScaleOptimizer`, `MultiOptimizer`, or one of one's own holding
    optimizers in its attributes) has its inner optimizers moved too: their
    iterations, learning-rate and slot variables, and their strategy.

    Args:
        optimizer: `keras.optimizers.Optimizer`, built or not.
        strategy: `tf.distribute.Strategy`.

    Returns:
        Integer, the number of optimizer variables that were re-created.
    """
    moved = 0
    for opt in nested_optimizers(optimizer):
        opt._distribution_strategy = strategy
        for variable in opt.variables:
            moved += rehome(variable, strategy)
    return moved


def reindex_optimizer(optimizer):
    """Rebuilds an optimizer's (and every inner optimizer's) slot index after model variables were re-homed.

    Keras keys its per-variable tables by the backing `tf.Variable`, which
    re-homing replaces: the slot index of every optimizer, and a
    `MultiOptimizer`'s table of which inner optimizer updates each variable
    (its entries are in the order of the variables it was built with).
    """
    for opt in nested_optimizers(optimizer):
        if not (getattr(opt, "built", False) and hasattr(opt, "_trainable_variables")):
            continue
        variables = opt._trainable_variables
        dispatch = opt.__dict__.get("_var_to_optimizer_idx")
        if isinstance(dispatch, dict) and len(dispatch) == len(variables):
            opt._var_to_optimizer_idx = {opt._var_key(v): i for v, i in zip(variables, dispatch.values())}
        opt._trainable_variables_indices = {opt._var_key(v): i for i, v in enumerate(variables)}


_BUILDS_OUTSIDE_STEP = "_keras_dist_builds_outside_step"


def build_outside_step(obj, *, without_strategy=False):
    """Makes a Keras optimizer or layer create its variables outside the step function when built in one.

    Keras builds an optimizer lazily, in its first `apply`, and a layer in
    its first call (on one device, inside the first step of a model that has
    no `call` for Keras to build it with beforehand). Inside a train step
    under a multi-replica strategy that creates the variables inside the
    step function (in a replica context, inside Keras' loop), and with
    collective all-reduces (TensorFlow's default for `MirroredStrategy`, and
    every multi-worker strategy) running it fails ('You must feed a value
    for placeholder tensor'). Here a `build` called in a replica context
    inside a function runs once, in cross-replica context (`merge_call`,
    which every replica reaches, as every replica runs the same step) and
    eagerly (`tf.init_scope`), with the same arguments and Keras name scopes:
    the variables are created under the strategy's scope as if built before
    `fit`, with the paths Keras gives them. Overrides the instance's `build`
    only; idempotent.

    With `without_strategy=True` (optimizers) a `build` called inside a
    function with no strategy (one replica, or plain Keras on one device)
    runs eagerly too (`tf.init_scope`). Keras on one device builds the
    optimizer while tracing the first step, where what `build` assigns is
    lost: ScheduleFreeAdamW's momentum, which must start at the weights,
    stayed 0 (Keras 3.15.1; with `learning_rate=0` a Dense kernel went from
    max |w| 0.79 to 0 in two steps), and its loss rose over 2 epochs (1.058,
    1.094) where built before `fit` it fell (0.967, 0.852; a new-user probe).

    Args:
        obj: A `keras.optimizers.Optimizer` or `keras.layers.Layer`, built or not.
        without_strategy: Boolean, also build eagerly when no strategy is set.

    Returns:
        Boolean, whether `obj` was changed now.

    Distributed behavior:
        The `merge_call` is a synchronization point of the replicas of this
        worker, not a collective between workers: every worker builds its own.
    """
    if obj.__dict__.get(_BUILDS_OUTSIDE_STEP):
        return False
    build = obj.build  # A layer's is already Keras' per-instance wrapper (name scope, `built`).

    @functools.wraps(build)  # Keras reads the signature to pass a layer's input shapes by name.
    def build_once_in_cross_replica_context(*args, **kwargs):
        context = tf.distribute.get_replica_context()
        if without_strategy and tf.inside_function() and not tf.distribute.has_strategy():
            with tf.init_scope():  # The same thread: Keras' name scopes hold.
                return build(*args, **kwargs)
        if context is None or not tf.distribute.has_strategy() or not tf.inside_function():
            return build(*args, **kwargs)
        # Keras' name scopes are per thread, and the merge may run in another: the variables' paths need these.
        scopes = list(keras_global_state.get_global_attribute("name_scope_stack") or [])

        def build_eagerly(strategy):
            del strategy
            own = keras_global_state.get_global_attribute("name_scope_stack")
            keras_global_state.set_global_attribute("name_scope_stack", list(scopes))
            try:
                with tf.init_scope():
                    if not obj.built:
                        build(*args, **kwargs)
            finally:
                keras_global_state.set_global_attribute("name_scope_stack", own)

        return context.merge_call(build_eagerly)

    obj.__dict__["build"] = build_once_in_cross_replica_context
    obj.__dict__[_BUILDS_OUTSIDE_STEP] = True
    return True


def nested_optimizers(optimizer):
    """Returns `optimizer` and every Keras optimizer it holds, depth first, each once.

    Inner optimizers are found in the optimizer's attributes, directly or in
    lists, tuples and dicts (`LossScaleOptimizer.inner_optimizer`,
    `MultiOptimizer`'s inner optimizers).
    """
    chain, seen = [], set()

    def visit(opt):
        if id(opt) in seen:
            return
        seen.add(id(opt))
        chain.append(opt)
        for inner in optimizers_in(vars(opt).values()):
            visit(inner)

    visit(optimizer)
    return chain


def optimizers_in(values):
    """Returns the Keras optimizers among `values` (and in their lists, tuples and dict values), each once."""
    import keras

    found, seen = [], set()

    def visit(value, depth):
        if isinstance(value, keras.optimizers.Optimizer):
            if id(value) not in seen:
                seen.add(id(value))
                found.append(value)
        elif depth < 3 and isinstance(value, (list, tuple)):
            for item in value:
                visit(item, depth + 1)
        elif depth < 3 and isinstance(value, dict):
            for item in value.values():
                visit(item, depth + 1)

    for value in values:
        visit(value, 0)
    return found


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


_SCALAR_CONVERSION_ENABLED = []  # [callable] once installed: the compat registry's switch, read at each call.


def install_scalar_conversion(is_enabled):
    """Makes `float(v)` and `int(v)` of a Keras variable on a strategy read its value (process-wide, once).

    Keras' `Variable.__float__`/`__int__` convert `v.value`, which on a strategy
    is a `tf.distribute` `MirroredVariable` (or sync-on-read variable) without
    those conversions: `float(model.optimizer.learning_rate)` in a callback
    raised `TypeError: float() argument must be ... not 'MirroredVariable'`
    (a new-user probe). The replacement converts such a variable through
    NumPy, as `v.numpy()` reads it (the value every replica holds; a
    sync-on-read variable's aggregate); any other variable is Keras' own way.

    Args:
        is_enabled: Callable returning whether the conversion applies, read at
            each call (the compat registry's switch).

    Returns:
        Boolean, whether the methods were replaced now (False: already).
    """
    from keras.src.backend.common.variables import Variable as KerasVariable

    _SCALAR_CONVERSION_ENABLED[:] = [is_enabled]
    if getattr(KerasVariable.__float__, "_keras_dist_scalar_conversion", False):
        return False
    for name, convert in (("__float__", float), ("__int__", int)):
        setattr(KerasVariable, name, _scalar_conversion(getattr(KerasVariable, name), convert))
    return True


def _scalar_conversion(original, convert):
    @functools.wraps(original)
    def converted(self):
        value = getattr(self, "_value", None)
        if isinstance(value, tf.distribute.DistributedValues) and _SCALAR_CONVERSION_ENABLED[0]() and self.ndim == 0:
            return convert(self.numpy())
        return original(self)

    converted._keras_dist_scalar_conversion = True  # type: ignore[attr-defined]
    return converted
