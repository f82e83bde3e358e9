"""`distributed_optimizer`: a Keras optimizer that sums gradients over replicas before it applies them."""

import contextlib
import threading
import types

import tensorflow as tf

from keras_dist import _compat
from keras_dist._runtime import accumulation
from keras_dist._runtime import keras_internals as ki
from keras_dist._runtime import variables as variables_module
from keras_dist.collectives import _all_reduce
from keras_dist.collectives._options import CommunicationOptions

_OPTIONS = "_keras_dist_communication"
_SUMS = "_keras_dist_gradient_sums"
_SUMS_VARIABLES = "_keras_dist_gradient_sums_variables"
_STEP_ALL_REDUCE = threading.local()  # A `StepAllReduce` per replica thread (MirroredStrategy runs each replica in its own).


def distributed_optimizer(optimizer, communication=None):
    """Makes `optimizer` sum gradients over the replicas first, then clip and apply them.

    Horovod's `DistributedOptimizer` for Keras optimizers on `tf.distribute`:
    every `optimizer.apply` / `optimizer.apply_gradients` called in replica
    context (a `train_step`, or `strategy.run` in a custom loop) first sums the
    gradients over all replicas with `communication`'s implementation,
    packing, timeout and compression, then runs Keras' `apply` on the sum.
    Clipping (`clipnorm`, `clipvalue`, `global_clipnorm`), weight decay and
    loss-scale checks therefore see the global gradient, as on one device.
    Keras 3 alone sums inside the update step, after clipping each replica's
    share (see docs/compat.md, `sum_gradients_before_apply`).

    With `gradient_accumulation_steps=k`, each replica keeps its own running
    sum and the sums are all-reduced once every k micro-batches
    (`DistributedModel` prepares those sums; elsewhere call
    `prepare_gradient_accumulation`, or every micro-batch is all-reduced).

    `DistributedModel.compile` applies this to the model's optimizer; call it
    yourself for an optimizer used in a custom training loop. Only this
    instance changes; calling it again replaces the options.

    Args:
        optimizer: A `keras.optimizers.Optimizer` (a `LossScaleOptimizer`
            included), created under the strategy's scope for custom loops.
        communication: `keras_dist.CommunicationOptions`, a TensorFlow
            `tf.distribute.experimental.CommunicationOptions`, a dict of the
            fields, or `None` for the defaults.

    Returns:
        `optimizer` itself.

    Raises:
        TypeError: `optimizer` is not a Keras optimizer, or `communication`
            is not an accepted type.
        ValueError: An invalid `communication` field.

    Distributed behavior:
        The sum is a collective: every replica of every worker must call
        `apply` with the same list of variables and the same `None` positions.
        Outside replica context (one device, or cross-replica context) the
        optimizer behaves exactly as before.
    """
    import keras

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "distributed_optimizer expects a `keras.optimizers.Optimizer`. "
            f"Received: {type(optimizer).__name__}. Fix: pass a Keras 3 optimizer "
            "(e.g. `keras.optimizers.Adam()`); tf.keras (Keras 2) optimizers are not supported."
        )
    optimizer.__dict__[_OPTIONS] = CommunicationOptions.from_value(communication)
    if not isinstance(optimizer.__dict__.get("apply"), types.MethodType):
        optimizer.__dict__["apply"] = types.MethodType(_apply_summed, optimizer)
    return optimizer


def is_distributed_optimizer(optimizer):
    """Returns whether `distributed_optimizer` was applied to `optimizer` (this instance)."""
    return _OPTIONS in optimizer.__dict__


def prepare_gradient_accumulation(optimizer, strategy, variables):
    """Creates the per-replica gradient sums for accumulation with one all-reduce per k micro-batches.

    Does nothing unless `optimizer` itself has `gradient_accumulation_steps`
    and `strategy` has several replicas. Call it outside `tf.function`, before
    the first step (`DistributedModel` does, when it builds its train function).

    Args:
        optimizer: An optimizer passed through `distributed_optimizer`.
        strategy: The `tf.distribute.Strategy` training runs under.
        variables: The trainable variables, in the order their gradients
            reach `apply`. Memory: one extra copy of them per replica.
    """
    if strategy.num_replicas_in_sync == 1 or not accumulation.accumulates_at_top_level(optimizer):
        optimizer.__dict__.pop(_SUMS, None)
        return
    sums = optimizer.__dict__.get(_SUMS)
    if sums is None or not sums.matches(variables):
        sums = accumulation.ReplicaGradientSums(strategy, variables, previous=sums)
        optimizer.__dict__[_SUMS] = sums
        optimizer.__dict__[_SUMS_VARIABLES] = list(variables)
        if optimizer.built:  # A partial cycle loaded into Keras' accumulators continues in the sums.
            accumulation.take_sums_from_keras_accumulators(optimizer, variables, sums, strategy, only=sums.new_ids)


@contextlib.contextmanager
def accumulation_saved_with_weights(optimizer, strategy):
    """While the block runs, Keras' accumulators hold the running sums, so a weights file keeps a partial cycle.

    Collective under several workers (reading the sums sums them): every
    worker must enter it, as every worker calls `save`.
    """
    sums = None if optimizer is None else optimizer.__dict__.get(_SUMS)
    if sums is None:
        yield
        return
    variables = optimizer.__dict__[_SUMS_VARIABLES]
    accumulation.copy_sums_to_keras_accumulators(optimizer, variables, sums, strategy)
    try:
        yield
    finally:
        accumulation.zero_keras_accumulators(optimizer, variables, sums, strategy)


def accumulation_loaded_with_weights(optimizer, strategy):
    """After weights (with Keras' accumulators) were loaded: continue their partial cycle in the sums."""
    sums = None if optimizer is None else optimizer.__dict__.get(_SUMS)
    if sums is not None:
        variables = optimizer.__dict__[_SUMS_VARIABLES]
        accumulation.take_sums_from_keras_accumulators(optimizer, variables, sums, strategy)


def weighs_examples_in_all_reduce(optimizer):
    """Whether `optimizer.apply` can weight each replica's gradients by its example count in the gradient all-reduce.

    True for a `distributed_optimizer` that sums every step (no gradient
    accumulation, no compression). Then `train_step` need not all-reduce the
    example counts before the forward pass: inside `weighting_by_examples`,
    the counts travel in the gradients' own all-reduce.
    """
    apply = optimizer.__dict__.get("apply") if optimizer is not None else None
    return (
        isinstance(apply, types.MethodType)
        and apply.__func__ is _apply_summed
        and _compat.is_active("sum_gradients_before_apply")
        and not accumulation.accumulates_anywhere(optimizer)
        and optimizer.__dict__[_OPTIONS].compression is None
    )


class StepAllReduce:
    """What one replica's step sends along with its gradients (see `weighting_by_examples`).

    Attributes:
        num_examples: int32 scalar tensor, this replica's examples.
        extras: List of float32 tensors to sum over the replicas in the
            gradient all-reduce.
        extras_sums: After the optimizer's `apply`: the sums, one tensor per
            `extras` entry, equal on every replica; `None` while no all-reduce
            has carried them.
    """

    def __init__(self, num_examples, extras=()):
        self.num_examples = num_examples
        self.extras = list(extras)
        self.extras_sums = None


@contextlib.contextmanager
def weighting_by_examples(num_examples, extras=()):
    """Within it, this replica's `apply` weights its gradients by `num_examples` (int32 scalar tensor).

    Each replica sends `num_examples x gradient` and `num_examples` in one
    all-reduce and the sum is scaled by `num_replicas_in_sync / total
    examples`: the gradient of the global batch's mean loss when each
    replica's loss is Keras' `mean / num_replicas_in_sync`, as
    `DistributedModel._replica_loss_weight` gives it with a separate
    all-reduce. Only for an optimizer `weighs_examples_in_all_reduce` accepts.

    Args:
        num_examples: int32 scalar tensor, this replica's examples.
        extras: List of float32 tensors (e.g. metric state) summed over the
            replicas in the same all-reduce.

    Yields:
        A `StepAllReduce`; its `extras_sums` hold the sums once `apply` ran.
    """
    previous = getattr(_STEP_ALL_REDUCE, "value", None)
    request = StepAllReduce(num_examples, extras)
    _STEP_ALL_REDUCE.value = request
    try:
        yield request
    finally:
        _STEP_ALL_REDUCE.value = previous


def _apply_summed(optimizer, grads, trainable_variables=None):
    """The `apply` `distributed_optimizer` installs (bound to the optimizer instance)."""
    keras_apply = type(optimizer).apply
    context = tf.distribute.get_replica_context()
    if (
        context is None
        or context.num_replicas_in_sync == 1
        or not _compat.is_active("sum_gradients_before_apply")
    ):
        return keras_apply(optimizer, grads, trainable_variables)
    options = optimizer.__dict__[_OPTIONS].resolved(context.strategy)
    grads = list(grads)
    variables = list(trainable_variables) if trainable_variables is not None else list(optimizer._trainable_variables)
    accumulating = accumulation.accumulates_anywhere(optimizer) and _compat.is_active(
        "gradient_accumulation_under_strategy"
    )
    sums = optimizer.__dict__.get(_SUMS)
    names = [getattr(v, "path", None) or v.name for v in variables] if variables_module.is_multi_worker(context.strategy) else None
    with ki.gradients_already_reduced(optimizer):
        if accumulating and sums is not None and sums.matches(variables):
            accumulation.accumulate_then_apply(
                optimizer,
                grads,
                variables,
                sums,
                to_wire=lambda values: _all_reduce.compress(values, options),
                cross_replica_sum=lambda strategy, values: _all_reduce.cross_replica_sum(strategy, values, options),
                from_wire=_all_reduce.decompress,
                apply=lambda summed, variables: ki.apply_without_merge_call(optimizer, keras_apply, summed, variables),
                check=None if names is None else lambda strategy, kinds: _check_in_cross_replica_context(strategy, kinds, options, names),
                check_input=None if names is None else _all_reduce.gradient_kinds(grads),
            )
            return
        request = getattr(_STEP_ALL_REDUCE, "value", None) if not accumulating else None
        grads, extras_sums = _all_reduce.all_reduce_gradients(
            grads,
            options,
            names=names,
            num_examples=None if request is None else request.num_examples,
            extras=() if request is None else request.extras,
        )
        if request is not None:
            request.extras_sums = extras_sums
        if accumulating:
            ki.apply_once_in_cross_replica_context(optimizer, grads, variables, keras_apply)
        else:
            keras_apply(optimizer, grads, variables)


def _check_in_cross_replica_context(strategy, kinds, options, names):
    summed = _all_reduce.cross_replica_sum(strategy, [kinds], options)[0]
    first = strategy.experimental_local_results(summed)[0]
    return [_all_reduce.assert_same_gradient_kinds(first, strategy.num_replicas_in_sync, names)]
