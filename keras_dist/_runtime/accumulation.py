"""Gradient accumulation with one all-reduce per `gradient_accumulation_steps` micro-batches.

Keras' accumulation (`BaseOptimizer._backend_apply_gradients`) keeps the running
sum in optimizer variables, which a strategy mirrors: every micro-batch's
gradient must then be summed over the replicas before it can be added. Here each
replica keeps its own running sum (sync-on-read variables, no communication),
and the sums are all-reduced once, on the micro-batch that updates the weights.
Summing over replicas commutes with summing over micro-batches, so the update is
Keras' `(g + acc) / k` on the global gradients, and Keras' own `apply` (its
update branch, its clipping, weight decay, update step and EMA) makes it.
"""

import tensorflow as tf

from keras_dist._runtime import keras_internals as ki


class ReplicaGradientSums:
    """Each replica's running sum of its own gradients since the last update.

    One sync-on-read variable per trainable variable (same shape and dtype):
    in replica context every replica reads and writes only its own copy, so
    accumulating sends nothing between replicas.

    Args:
        strategy: The `tf.distribute.Strategy` the model trains under.
        variables: The model's trainable variables (Keras variables), in the
            order the optimizer receives their gradients.
        previous: The `ReplicaGradientSums` these replace, if any: sums of
            variables in both are kept, with their values.
    """

    def __init__(self, strategy, variables, previous=None):
        self.variable_ids = tuple(id(v) for v in variables)
        kept = dict(zip(previous.variable_ids, previous.sums)) if previous is not None else {}
        self.new_ids = {id(v) for v in variables if id(v) not in kept}
        with strategy.scope():
            # A variable still trained keeps its running sum (a recompile mid-cycle loses nothing).
            self.sums = [kept.get(id(v)) or self._new_sum(v) for v in variables]

    @staticmethod
    def _new_sum(variable):
        return tf.Variable(
            tf.zeros(variable.shape, dtype=variable.dtype),
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.SUM,
            name="keras_dist_replica_gradient_sum",
        )

    def keras_accumulators(self, optimizer, variables):
        """Returns Keras' own accumulator of each variable (the optimizer variables a weights file holds)."""
        return [optimizer._accumulated_gradients[optimizer._get_variable_index(v)] for v in variables]

    def matches(self, variables):
        """True when these sums were made for exactly `variables`, in this order."""
        return self.variable_ids == tuple(id(v) for v in variables)


def accumulates_at_top_level(optimizer):
    """True when `optimizer` itself (not an optimizer it wraps) accumulates gradients."""
    return bool(getattr(optimizer, "gradient_accumulation_steps", None)) and len(ki.optimizers_within(optimizer)) == 1


def accumulates_anywhere(optimizer):
    """True when `optimizer` or an optimizer it delegates to has `gradient_accumulation_steps`."""
    return any(getattr(opt, "gradient_accumulation_steps", None) for opt in ki.optimizers_within(optimizer))


def accumulate_then_apply(
    optimizer, gradients, variables, sums, *, to_wire, cross_replica_sum, from_wire, apply, check=None, check_input=None
):
    """Adds this micro-batch to the replica's sums; on every k-th one, all-reduces them and applies.

    Args:
        optimizer: Keras optimizer with `gradient_accumulation_steps = k >= 2`.
        gradients: List of this replica's gradients (dense tensors,
            `tf.IndexedSlices`, densified as Keras' own accumulators do, or
            `None`), one per entry of `variables`.
        variables: The trainable variables `sums` was made for.
        sums: `ReplicaGradientSums` for `variables`.
        to_wire: Callable mapping a list of tensors to what is all-reduced
            (e.g. cast to float16), in replica context.
        cross_replica_sum: Callable `(strategy, per_replica_values)` returning
            the summed values (mirrored), run in cross-replica context.
        from_wire: Callable `(value, dtype)` undoing `to_wire` on a sum.
        apply: Callable `(gradients, variables)` running Keras' `apply` on
            gradients summed over replicas and micro-batches, in cross-replica
            context.
        check: Optional callable `(strategy, per_replica_check_input)`
            returning ops that must run before the sums are all-reduced (the
            gradient-structure check), in cross-replica context.
        check_input: The tensor (replica context) handed to `check`.

    Distributed behavior:
        Runs in replica context and calls `merge_call` once per micro-batch;
        the all-reduce inside runs only on update micro-batches, on every
        replica of every worker alike (they share `optimizer.iterations`).
    """
    steps = optimizer.gradient_accumulation_steps
    is_update = tf.equal((optimizer._iterations + 1) % steps, 0)
    totals = []
    for gradient, running in zip(gradients, sums.sums):
        if gradient is None:
            totals.append(None)
            continue
        total = running.read_value() + tf.cast(tf.convert_to_tensor(gradient), running.dtype)
        running.assign(tf.where(is_update, tf.zeros_like(total), total))
        totals.append(total)
    present = [i for i, total in enumerate(totals) if total is not None]
    wire = to_wire([totals[i] for i in present])

    def merge(strategy, wire, check_input):
        def update():
            # Keras' own `apply` takes this branch too (same `_iterations`), adding
            # its accumulators, which stay zero here, and dividing by k.
            checks = [] if check is None else check(strategy, check_input)
            with tf.control_dependencies(checks):
                summed = cross_replica_sum(strategy, wire)
            summed_gradients = [None] * len(totals)
            for i, value in zip(present, summed):
                summed_gradients[i] = from_wire(strategy.experimental_local_results(value)[0], totals[i].dtype)
            apply(summed_gradients, variables)

        def accumulate():
            # What Keras' `apply` does on a micro-batch that only accumulates, besides accumulating:
            # the EMA step, the variables' constraints, the iteration count.
            _moving_average_step(optimizer)
            for i in present:
                if variables[i].constraint is not None:
                    variables[i].assign(variables[i].constraint(variables[i]))
            optimizer._iterations.assign_add(1)

        tf.cond(tf.equal((optimizer._iterations + 1) % steps, 0), update, accumulate)

    tf.distribute.get_replica_context().merge_call(merge, args=(wire, check_input))


def _moving_average_step(optimizer):
    """Keras' per-`apply` EMA update (`BaseOptimizer._backend_apply_gradients`), for micro-batches that only accumulate."""
    if not optimizer.use_ema:
        return
    optimizer._update_model_variables_moving_average(optimizer._trainable_variables)
    if optimizer.ema_overwrite_frequency:
        tf.cond(
            tf.equal((optimizer.iterations + 1) % optimizer.ema_overwrite_frequency, 0),
            lambda: optimizer._overwrite_model_variables_with_average_value(optimizer._trainable_variables),
            lambda: None,
        )


def copy_sums_to_keras_accumulators(optimizer, variables, sums, strategy):
    """Writes the running sums, summed over replicas, into Keras' accumulators (so a save keeps them)."""
    with strategy.scope():
        for running, keras_accumulator in zip(sums.sums, sums.keras_accumulators(optimizer, variables)):
            keras_accumulator.assign(running.read_value())  # Cross-replica read of a SUM variable: the total.


def take_sums_from_keras_accumulators(optimizer, variables, sums, strategy, only=None):
    """Moves Keras' accumulators (e.g. just loaded) into the running sums and zeroes them.

    The sums are sync-on-read with SUM aggregation: assigning a total from
    cross-replica context splits it over the replicas, so their sum is kept.
    Keras' accumulators must stay zero while the sums are used: its update
    adds them to the all-reduced sums.

    Args:
        only: Optional set of variable ids to move (others keep their sums).
    """
    with strategy.scope():
        for v, running, keras_accumulator in zip(variables, sums.sums, sums.keras_accumulators(optimizer, variables)):
            if only is not None and id(v) not in only:
                continue
            running.assign(keras_accumulator.value if hasattr(keras_accumulator, "value") else keras_accumulator)
            keras_accumulator.assign(tf.zeros_like(keras_accumulator))


def zero_keras_accumulators(optimizer, variables, sums, strategy):
    with strategy.scope():
        for keras_accumulator in sums.keras_accumulators(optimizer, variables):
            keras_accumulator.assign(tf.zeros_like(keras_accumulator))
