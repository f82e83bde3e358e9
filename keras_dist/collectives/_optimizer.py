"""`distributed_optimizer`: a Keras optimizer that sums gradients over replicas before it applies them."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import keras
import tensorflow as tf

from keras_dist import _compat
from keras_dist._runtime import accumulation, optimizer_patches, rows, step_state, strategy_info
from keras_dist._runtime import keras_internals as ki
from keras_dist._runtime import variables as variables_module
from keras_dist.collectives import _all_reduce
from keras_dist.collectives._options import CommunicationOptions, CommunicationValue


def distributed_optimizer(
    optimizer: keras.optimizers.Optimizer, communication: CommunicationValue = None
) -> keras.optimizers.Optimizer:
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

    Sparse gradients (`tf.IndexedSlices`, e.g. an `Embedding`'s) reach Keras'
    `apply` with the rows plain Keras has on one device: the replicas' token
    rows concatenated, the rows of a lookup that is the same on every replica
    (a position embedding) summed position by position (see
    `keras_dist.collectives._all_reduce.combine_gathered_rows`).

    With `gradient_accumulation_steps=k`, each replica keeps its own running
    sum and the sums are all-reduced once every k micro-batches
    (`DistributedModel` prepares those sums; elsewhere call
    `prepare_gradient_accumulation`, or every micro-batch is all-reduced).

    `DistributedModel.compile` applies this to the model's optimizer; call it
    yourself for an optimizer used in a custom training loop. Only this
    instance changes; calling it again replaces the options. Its `build`,
    called outside any scope (`model.optimizer.build(...)` before `fit`),
    builds under the optimizer's strategy.

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
    optimizer_patches.install(
        optimizer,
        options=CommunicationOptions.from_value(communication),
        apply=_apply_summed,
        build=_build_under_its_strategy,
        apply_gradients=_apply_gradients_summed if _overrides_apply_gradients(optimizer) else None,
    )
    return optimizer


# Per thread (MirroredStrategy runs each replica's step on a thread of its own), per optimizer `id`: while the
# installed `apply_gradients` sums, `then_apply_<id>` is what `_apply_summed` calls in place of Keras' `apply`
# (the class's own `apply_gradients`, on the sums); `passing_through_<id>` is set while that runs (sum nothing).
_PER_REPLICA = threading.local()


def _passing_through(optimizer):
    """Whether this thread runs `optimizer`'s class's `apply_gradients` on gradients `_apply_gradients_summed` summed."""
    return getattr(_PER_REPLICA, f"passing_through_{id(optimizer)}", False)


def _overrides_apply_gradients(optimizer):
    """Whether `optimizer`'s class (a user's subclass) has an `apply_gradients` of its own, not Keras'."""
    return type(optimizer).apply_gradients is not keras.optimizers.Optimizer.apply_gradients


@tf.autograph.experimental.do_not_convert  # Called inside a user's tf.function: nothing here to convert.
def _apply_gradients_summed(optimizer, grads_and_vars):
    """The `apply_gradients` `distributed_optimizer` installs where the class overrides Keras' (bound to the instance).

    A subclass that edits the gradients in `apply_gradients` before calling
    Keras' (clipping each by value, scaling each to unit norm; keras.io's
    gradient centralization written for Keras 3) would see each replica's
    own gradients: keras-dist's built-in step hands them over unsummed and
    the installed `apply` sums them. Here they are summed first, as in
    `apply`, and the class's `apply_gradients` gets the global batch's
    gradients; the installed `apply` it reaches then sums nothing. As
    before where the gradients are accumulated (`gradient_accumulation_steps`)
    or already the global batch's (a step of the user's).
    """
    class_apply_gradients = type(optimizer).apply_gradients
    grads_and_vars = list(grads_and_vars)
    context = tf.distribute.get_replica_context()
    state = optimizer_patches.state(optimizer)
    variables = [v for _, v in grads_and_vars]
    step = step_state.current()
    if (
        context is None
        or context.num_replicas_in_sync == 1
        or not _compat.is_active("sum_gradients_before_apply")
        or state is None
        or getattr(_PER_REPLICA, f"then_apply_{id(optimizer)}", None) is not None
        or _passing_through(optimizer)
        or accumulation.accumulates_anywhere(optimizer)
        or (step is not None and step.already_summed(variables))
    ):
        return class_apply_gradients(optimizer, grads_and_vars)
    results = []

    def then_apply(summed, summed_variables):
        setattr(_PER_REPLICA, f"passing_through_{id(optimizer)}", True)
        try:
            results.append(class_apply_gradients(optimizer, list(zip(summed, summed_variables))))
        finally:
            delattr(_PER_REPLICA, f"passing_through_{id(optimizer)}")

    setattr(_PER_REPLICA, f"then_apply_{id(optimizer)}", then_apply)
    try:
        _apply_summed(optimizer, [g for g, _ in grads_and_vars], variables)
    finally:
        delattr(_PER_REPLICA, f"then_apply_{id(optimizer)}")
    return results[0] if results else optimizer.iterations


def _build_under_its_strategy(optimizer, *args, **kwargs):
    """The `build` `distributed_optimizer` installs: outside any scope, Keras' `build` runs under the optimizer's strategy.

    A user's `model.optimizer.build(model.trainable_variables)` before `fit`
    (keras.io style, no `strategy.scope()`) would otherwise fail ("Need to be
    inside `with strategy.scope()`") or create variables no strategy mirrors.
    """
    keras_build = optimizer_patches.class_method(optimizer, "build")
    strategy = ki.optimizer_strategy(optimizer)
    with contextlib.ExitStack() as stack:
        for opt in variables_module.nested_optimizers(optimizer):  # A MultiOptimizer in a LossScaleOptimizer too.
            stack.enter_context(_selected_optimizers_on(opt, strategy))
        if tf.distribute.has_strategy() or strategy is None or not variables_module.is_multi_replica(strategy):
            return keras_build(*args, **kwargs)
        with strategy.scope():
            return keras_build(*args, **kwargs)


@contextlib.contextmanager
def _selected_optimizers_on(optimizer, strategy):
    """While a `MultiOptimizer` builds, every optimizer its selector returns is moved onto `strategy` first.

    `MultiOptimizer(lambda v: adam if "hid" in v.path else sgd)` holds `adam`
    and `sgd` only in the selector until it is built: `compile` could not
    move them as it moves the optimizer (`optimizer_strategy`), and on 2
    replicas their `build` failed in `fit` ('Mixing different
    tf.distribute.Strategy objects: MirroredStrategy ... is not
    _DefaultDistributionStrategy'; a new-user probe). Here each one the
    selector returns (its iterations, learning rate and strategy) is moved
    before Keras builds it; one it makes in the call is already on it.
    `OptimizerMap`'s optimizers are known at construction and moved by
    `compile`. Anything else: Keras' `build` as is.
    """
    selector = optimizer.__dict__.get("_optimizer_map")
    if (
        optimizer.built
        or not callable(selector)
        or strategy is None
        or not _compat.is_active("optimizer_strategy")
        or not variables_module.is_multi_replica(strategy)
    ):
        yield
        return
    moved = set()

    def select_on_strategy(variable):
        selected = selector(variable)
        if isinstance(selected, keras.optimizers.Optimizer) and id(selected) not in moved:
            moved.add(id(selected))
            variables_module.rehome_optimizer(selected, strategy)
        return selected

    optimizer.__dict__["_optimizer_map"] = select_on_strategy
    try:
        yield
    finally:
        optimizer.__dict__["_optimizer_map"] = selector


def is_distributed_optimizer(optimizer):
    """Returns whether `distributed_optimizer` was applied to `optimizer` (this instance)."""
    return optimizer_patches.state(optimizer) is not None


def prepare_gradient_accumulation(
    optimizer: keras.optimizers.Optimizer, strategy: tf.distribute.Strategy, variables: Sequence[keras.Variable]
) -> None:
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
    state = optimizer_patches.state(optimizer)
    if state is None:  # Not a `distributed_optimizer`: its `apply` would not read the sums.
        return
    if strategy.num_replicas_in_sync == 1 or not accumulation.accumulates_at_top_level(optimizer):
        state.sums = None
        return
    sums = state.sums
    if sums is None or not sums.matches(variables):
        sums = accumulation.ReplicaGradientSums(strategy, variables, previous=sums)
        state.sums, state.sums_variables = sums, list(variables)
        if optimizer.built:  # A partial cycle loaded into Keras' accumulators continues in the sums.
            accumulation.take_sums_from_keras_accumulators(optimizer, variables, sums, strategy, only=sums.new_ids)


@contextlib.contextmanager
def accumulation_saved_with_weights(optimizer, strategy):
    """While the block runs, Keras' accumulators hold the running sums, so a weights file keeps a partial cycle.

    Collective under several workers (reading the sums sums them): every
    worker must enter it, as every worker calls `save`.
    """
    state = optimizer_patches.state(optimizer)
    sums = None if state is None else state.sums
    if sums is None:
        yield
        return
    variables = state.sums_variables
    accumulation.copy_sums_to_keras_accumulators(optimizer, variables, sums, strategy)
    try:
        yield
    finally:
        accumulation.zero_keras_accumulators(optimizer, variables, sums, strategy)


def accumulation_loaded_with_weights(optimizer, strategy):
    """After weights (with Keras' accumulators) were loaded: continue their partial cycle in the sums."""
    state = optimizer_patches.state(optimizer)
    if state is not None and state.sums is not None:
        sums, variables = state.sums, state.sums_variables
        accumulation.take_sums_from_keras_accumulators(optimizer, variables, sums, strategy)


def weighs_examples_in_all_reduce(optimizer):
    """Whether `optimizer.apply` can weight each replica's gradients by its example count in the gradient all-reduce.

    True for a `distributed_optimizer` that sums every step (no gradient
    accumulation, no compression). Then `train_step` need not all-reduce the
    example counts before the forward pass: when the step says so
    (`step_state.EXAMPLES_IN_ALL_REDUCE`), the counts travel in the
    gradients' own all-reduce.
    """
    return (
        optimizer_patches.has_installed(optimizer, "apply", _apply_summed)
        and _compat.is_active("sum_gradients_before_apply")
        and not accumulation.accumulates_anywhere(optimizer)
        and optimizer_patches.state(optimizer).options.compression is None
    )


def _apply_summed(optimizer, grads, trainable_variables=None):
    """The `apply` `distributed_optimizer` installs (bound to the optimizer instance).

    Raises:
        RuntimeError: called in a branch of `tf.cond` or `tf.while_loop` (or
            a nested `tf.function`) of a step on several replicas, where
            TensorFlow cannot sum over the replicas (its `merge_call` error,
            which names neither the optimizer nor the remedy), as a
            hand-written accumulation (`tf.cond(count == k, apply, ...)`) does.
    """
    user_branch = strategy_info.in_nested_graph_of_replica()  # Before Keras' own conditionals (EMA, accumulation).
    try:
        return _apply_summed_in_step(optimizer, grads, trainable_variables)
    except RuntimeError as error:
        if not user_branch or "`merge_call` called while defining a new graph" not in str(error):
            raise
        context = tf.distribute.get_replica_context()
        replicas = context.num_replicas_in_sync if context is not None else "several"
        raise RuntimeError(
            f"{type(optimizer).__name__}.apply_gradients() (or apply()) ran inside a tf.cond or tf.while_loop "
            f"branch, or a nested tf.function, of the step on {replicas} replicas. Expected: the optimizer "
            "applied unconditionally in train_step, where keras-dist can sum the gradients over the replicas "
            "(TensorFlow cannot inside a control-flow branch). To accumulate gradients, drop the hand-written "
            "accumulation (variables and tf.cond) and pass gradient_accumulation_steps=k to the optimizer, "
            "e.g. keras.optimizers.Adam(1e-3, gradient_accumulation_steps=4): it applies every k-th step, as "
            "on one device."
        ) from error


def _apply_summed_in_step(optimizer, grads, trainable_variables):
    """`_apply_summed`'s work, in replica context or not."""
    keras_apply = type(optimizer).apply
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1 or not _compat.is_active("sum_gradients_before_apply"):
        return keras_apply(optimizer, grads, trainable_variables)
    if _passing_through(optimizer):  # The class's `apply_gradients`, on summed gradients: sum nothing.
        variables = (
            list(trainable_variables) if trainable_variables is not None else ki.trainable_variables_of(optimizer)
        )
        with ki.gradients_already_reduced(optimizer):
            _keras_apply(optimizer, keras_apply, list(grads), variables, accumulating=False)
        return
    options = optimizer_patches.state(optimizer).options.resolved(context.strategy)
    grads = list(grads)
    variables = list(trainable_variables) if trainable_variables is not None else ki.trainable_variables_of(optimizer)
    grads = [_with_variable_shape(g, v) for g, v in zip(grads, variables)] + grads[len(variables) :]
    accumulating = accumulation.accumulates_anywhere(optimizer) and _compat.is_active(
        "gradient_accumulation_under_strategy"
    )
    # The step running on this replica says how its gradients count (`step_state`); none: summed as given
    # (a custom training loop that scales its loss for the global batch, as TensorFlow's guide does).
    step = step_state.current()
    marks = step.marks if step is not None else None  # The timeline's timestamps (None: it is off).
    if marks is not None:
        marks.stamp("gradients", grads)  # Taken by keras-dist's own step already; a step of the user's: here.
    sums = optimizer_patches.state(optimizer).sums
    # A step of the user's whose `tape.gradient` returned the global batch's gradients (`user_steps`), the same on
    # every replica: applied, or added to the replica's sums and applied every k-th micro-batch, summing nothing.
    already_summed = step is not None and step.already_summed(variables)
    if step is not None and step.weighting == step_state.EXAMPLES and not already_summed:
        grads = [step.by_share(g) for g in grads]  # A user's step: its replica's mean loss.
    names = None if already_summed else structure_check_names(variables, context.strategy)
    with ki.gradients_already_reduced(optimizer):
        if accumulating and sums is not None and sums.matches(variables):
            if already_summed:
                wire = dict(to_wire=list, cross_replica_sum=lambda strategy, values: values, from_wire=lambda v, _: v)
            else:
                wire = dict(
                    to_wire=lambda values: _all_reduce.compress(values, options),
                    cross_replica_sum=lambda strategy, values: _all_reduce.cross_replica_sum(strategy, values, options),
                    from_wire=_all_reduce.decompress,
                )
            accumulation.accumulate_then_apply(
                optimizer,
                grads,
                variables,
                sums,
                **wire,
                apply=lambda summed, variables: _apply_keeping_rows(optimizer, keras_apply, summed, variables),
                check=None
                if names is None
                else lambda strategy, kinds: _check_in_cross_replica_context(strategy, kinds, options, names),
                check_input=None if names is None else _all_reduce.gradient_kinds(grads),
                densify=options.sparse_gradients == "dense",
            )
            if marks is not None:  # All-reduced every k-th step inside `apply`: no `all_reduced` timestamp.
                marks.stamp("applied", variables)
            return
        if already_summed:
            _keras_apply(optimizer, keras_apply, grads, variables, accumulating=accumulating)
            if marks is not None:
                marks.stamp("applied", variables)
            return
        request = step if step is not None and not accumulating else None
        in_all_reduce = request is not None and request.weighting == step_state.EXAMPLES_IN_ALL_REDUCE
        grads, extras_sums = _all_reduce.all_reduce_gradients(
            grads,
            options,
            names=names,
            num_examples=request.num_examples if in_all_reduce else None,
            extras=request.extras if request is not None else (),
        )
        if request is not None:
            request.extras_sums = extras_sums
        if marks is not None:
            marks.stamp("all_reduced", grads)
        then_apply = getattr(_PER_REPLICA, f"then_apply_{id(optimizer)}", None)
        if then_apply is not None:  # The class's own `apply_gradients`, on the sums.
            then_apply(grads, variables)
        else:
            _keras_apply(optimizer, keras_apply, grads, variables, accumulating=accumulating)
        if marks is not None:
            marks.stamp("applied", variables)


def _keras_apply(optimizer, keras_apply, grads, variables, *, accumulating):
    """Keras' `apply` on gradients summed over the replicas, in replica context; rows stay rows through clipping."""
    # Keras' apply reaches merge_call inside ops.cond when it accumulates or overwrites the weights
    # with their moving averages; TensorFlow refuses that in replica context.
    conditional_merge_call = accumulating or (
        ki.overwrites_with_moving_average(optimizer) and _compat.is_active("ema_overwrite_under_strategy")
    )
    with rows.rows_kept_through_clipping(ki.optimizers_within(optimizer)):
        if conditional_merge_call:
            ki.apply_once_in_cross_replica_context(optimizer, grads, variables, keras_apply)
        else:
            keras_apply(optimizer, grads, variables)


def structure_check_names(variables, strategy):
    """The variables' names for the all-reduce's gradient-structure check (`all_reduce_gradients(names=...)`).

    `None` on one worker, whose replicas run one trace and cannot disagree;
    a list of strings (`path`, else `name`) under several workers.
    """
    if not variables_module.is_multi_worker(strategy):
        return None
    return [getattr(v, "path", None) or v.name for v in variables]


def _with_variable_shape(gradient, variable):
    """A dense `gradient` with its `variable`'s static shape, where the trace lost it (else as given).

    The gradient of a Dense kernel applied to a 3-D input (a transformer's feed-forward layer) is traced
    with shape `(None, units)`; without a static size it cannot be cut into windows (`_windows`), nor
    packed by TensorFlow ("not packing values due to the unknown or inconsistent shape"). A gradient
    has its variable's shape, so `tf.ensure_shape` states it (and checks it when the step runs).
    """
    if gradient is None or isinstance(gradient, tf.IndexedSlices) or gradient.shape.is_fully_defined():
        return gradient
    shape = getattr(variable, "shape", None)
    if shape is None or not tf.TensorShape(shape).is_fully_defined():
        return gradient
    return tf.ensure_shape(gradient, shape)


def _apply_keeping_rows(optimizer, keras_apply, summed, variables):
    """Keras' update branch on sums over micro-batches and replicas, from cross-replica context; rows stay rows."""
    with (
        rows.rows_through_keras_accumulation(optimizer, summed, variables),
        rows.rows_kept_through_clipping([optimizer]),
    ):
        ki.apply_without_merge_call(optimizer, keras_apply, summed, variables)


def _check_in_cross_replica_context(strategy, kinds, options, names):
    summed = _all_reduce.cross_replica_sum(strategy, [kinds], options)[0]
    first = strategy.experimental_local_results(summed)[0]
    return [_all_reduce.assert_same_gradient_kinds(first, strategy.num_replicas_in_sync, names)]
