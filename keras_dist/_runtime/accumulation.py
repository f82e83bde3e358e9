"""Gradient accumulation with one all-reduce per `gradient_accumulation_steps` micro-batches.

Keras' accumulation (`BaseOptimizer._backend_apply_gradients`) keeps the running
sum in optimizer variables, which a strategy mirrors: every micro-batch's
gradient must then be summed over the replicas before it can be added. Here each
replica keeps its own running sum (sync-on-read variables, no communication),
and the sums are all-reduced once, on the micro-batch that updates the weights.
Summing over replicas commutes with summing over micro-batches, so the update is
Keras' `(g + acc) / k` on the global gradients, and Keras' own `apply` (its
update branch, its clipping, weight decay, update step and EMA) makes it.
Sparse gradients (`tf.IndexedSlices`) are summed as rows merged by index (unique
indices, values summed): what Keras' dense accumulator holds, in memory that
grows with the distinct rows of a cycle (at most k x rows per micro-batch), not
with the table; `rows.rows_through_keras_accumulation` keeps them rows through
Keras' update branch.
"""

import tensorflow as tf

from keras_dist._runtime import keras_internals as ki
from keras_dist._runtime import rows as rows_module


class ReplicaGradientSums:
    """Each replica's running sum of its own gradients since the last update.

    One `RunningSum` per trainable variable: in replica context every replica
    reads and writes only its own copy, so accumulating sends nothing between
    replicas. A sum holds what its gradients are: a dense tensor of the
    variable's shape, or rows (`tf.IndexedSlices`, merged by index) whose
    number grows with the micro-batches' distinct indices, not with the table.

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
            self.sums = [kept.get(id(v)) or RunningSum(v) for v in variables]

    def keras_accumulators(self, optimizer, variables):
        """Returns Keras' own accumulator of each variable (the optimizer variables a weights file holds)."""
        return [optimizer._accumulated_gradients[optimizer._get_variable_index(v)] for v in variables]

    def matches(self, variables):
        """True when these sums were made for exactly `variables`, in this order."""
        return self.variable_ids == tuple(id(v) for v in variables)

    def num_bytes(self):
        """Bytes the sums hold now, summed over this worker's replicas (eager)."""
        return sum(s.num_bytes() for s in self.sums)

    def variables(self):
        """The sync-on-read `tf.Variable`s that hold the sums (what a snapshot of the training state keeps)."""
        return [v for s in self.sums for v in s.variables()]


def _on_read(initial, shape, aggregation):
    return tf.Variable(
        initial,
        shape=shape,
        trainable=False,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=aggregation,
        name="keras_dist_replica_gradient_sum",
    )


class RunningSum:
    """One variable's running gradient sum on each replica (sync-on-read variables, created under the scope).

    Holds nothing until the first micro-batch: a dense gradient fills `dense`
    (the variable's shape; the leading dimension is dynamic, 0 while empty), a
    sparse one adds rows to `indices` / `values` (merged by index at every
    micro-batch, so at most the distinct indices of the cycle). Which of the
    two a variable uses is fixed when the step is traced.

    Args:
        variable: The trainable Keras variable (its shape and dtype).
    """

    def __init__(self, variable):
        self.shape = tuple(variable.shape)
        self.dtype = tf.as_dtype(variable.dtype)
        sum_op = tf.VariableAggregation.SUM
        if not self.shape:  # A scalar has no rows.
            self.dense = _on_read(tf.zeros([], self.dtype), tf.TensorShape([]), sum_op)
            self.values = self.indices = None
            return
        self.dense = _on_read(self._empty(), tf.TensorShape([None, *self.shape[1:]]), sum_op)
        self.values = _on_read(self._empty(), tf.TensorShape([None, *self.shape[1:]]), sum_op)
        # Every replica's rows carry their own indices; assigned from cross-replica context, all get the same.
        self.indices = _on_read(
            tf.zeros([0], tf.int64), tf.TensorShape([None]), tf.VariableAggregation.ONLY_FIRST_REPLICA
        )

    def _empty(self):
        return tf.zeros([0, *self.shape[1:]], self.dtype)

    def variables(self):
        """This sum's sync-on-read `tf.Variable`s (the dense sum, and the rows' values and indices)."""
        return [v for v in (self.dense, self.values, self.indices) if v is not None]

    def add_dense(self, gradient, is_update):
        """Replica context: returns this replica's total with the dense `gradient`; keeps it unless `is_update`."""
        gradient = tf.cast(tf.convert_to_tensor(gradient), self.dtype)
        running = self.dense.read_value()
        if not self.shape:
            total = running + gradient
            self.dense.assign(tf.where(is_update, tf.zeros_like(total), total))
            return total
        total = tf.cond(tf.shape(running)[0] > 0, lambda: running + gradient, lambda: gradient)
        total = tf.ensure_shape(total, gradient.shape)
        self.dense.assign(tf.cond(is_update, self._empty, lambda: total))
        return total

    def add_rows(self, gradient, is_update):
        """Replica context: returns this replica's rows plus the rows of `gradient`, merged by index.

        Keeps them unless `is_update`. A dense sum left by a restore (Keras'
        accumulator loaded from a weights file) joins the rows as its nonzero rows.
        """
        running_indices, running_values = self.indices.read_value(), self.values.read_value()
        dense = self.dense.read_value()

        def with_restored():
            axes = list(range(1, len(self.shape)))
            nonzero = tf.where(tf.reduce_any(tf.not_equal(dense, 0), axis=axes) if axes else tf.not_equal(dense, 0))
            nonzero = tf.reshape(nonzero, [-1])
            return tf.concat([running_indices, nonzero], 0), tf.concat([running_values, tf.gather(dense, nonzero)], 0)

        running_indices, running_values = tf.cond(
            tf.shape(dense)[0] > 0, with_restored, lambda: (running_indices, running_values)
        )
        merged = rows_module.merge_rows(
            tf.IndexedSlices(
                tf.concat([running_values, tf.cast(gradient.values, self.dtype)], 0),
                tf.concat([running_indices, tf.cast(gradient.indices, tf.int64)], 0),
                tf.constant(self.shape, tf.int64),
            )
        )
        empty = (tf.zeros([0], tf.int64), self._empty())
        kept_indices, kept_values = tf.cond(is_update, lambda: empty, lambda: (merged.indices, merged.values))
        self.indices.assign(kept_indices)
        self.values.assign(kept_values)
        self.dense.assign(self._empty())
        return merged

    def num_bytes(self):
        """Bytes held now by every local replica's copies (eager)."""
        total = 0
        for part in (self.dense, self.values, self.indices):
            if part is not None:
                for local in part.values:
                    total += int(tf.size(local)) * local.dtype.size
        return total

    def total(self, strategy):
        """Cross-replica context: the sum over all replicas, dense, of the variable's shape (collective)."""

        def local_dense():
            replica_dense = self.dense.read_value()
            dense = tf.zeros(self.shape, self.dtype) if self.shape else replica_dense
            if self.shape:
                dense = tf.cond(
                    tf.shape(replica_dense)[0] > 0, lambda: tf.ensure_shape(replica_dense, self.shape), lambda: dense
                )
                rows = tf.IndexedSlices(self.values.read_value(), self.indices.read_value(), self.shape)
                dense = dense + tf.math.unsorted_segment_sum(rows.values, rows.indices, self.shape[0])
            return dense

        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(local_dense), axis=None)

    def set_total(self, total):
        """Cross-replica context: makes the replicas' sums add up to `total` (dense; split over the replicas)."""
        self.dense.assign(total)  # SUM aggregation: each replica holds total / replicas.
        if self.values is not None:
            self.values.assign(self._empty())
            self.indices.assign(tf.zeros([0], tf.int64))


def accumulates_at_top_level(optimizer):
    """True when `optimizer` itself (not an optimizer it wraps) accumulates gradients."""
    return bool(getattr(optimizer, "gradient_accumulation_steps", None)) and len(ki.optimizers_within(optimizer)) == 1


def accumulates_anywhere(optimizer):
    """True when `optimizer` or an optimizer it delegates to has `gradient_accumulation_steps`."""
    return any(getattr(opt, "gradient_accumulation_steps", None) for opt in ki.optimizers_within(optimizer))


def accumulate_then_apply(
    optimizer,
    gradients,
    variables,
    sums,
    *,
    to_wire,
    cross_replica_sum,
    from_wire,
    apply,
    check=None,
    check_input=None,
    densify=False,
):
    """Adds this micro-batch to the replica's sums; on every k-th one, all-reduces them and applies.

    Args:
        optimizer: Keras optimizer with `gradient_accumulation_steps = k >= 2`.
        gradients: List of this replica's gradients (dense tensors,
            `tf.IndexedSlices` or `None`), one per entry of `variables`. Rows
            are summed as rows: merged by index on each replica at every
            micro-batch, all-gathered on the update micro-batch and merged
            again, so `apply` gets one row per distinct index, values summed:
            what the dense sum of Keras' own accumulators is, densified.
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
        densify: Boolean; `True` sums `tf.IndexedSlices` as dense tensors
            of the variable's shape (Keras' own accumulation), `False` (the
            default) as rows.

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
        if isinstance(gradient, tf.IndexedSlices) and not densify:
            totals.append(running.add_rows(gradient, is_update))
        else:
            totals.append(running.add_dense(gradient, is_update))
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
                value = from_wire(strategy.experimental_local_results(value)[0], sums.sums[i].dtype)
                # The replicas' rows, gathered: one row per distinct index again.
                summed_gradients[i] = rows_module.merge_rows(value) if isinstance(value, tf.IndexedSlices) else value
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
            keras_accumulator.assign(running.total(strategy))  # Summed over the replicas (collective).


def take_sums_from_keras_accumulators(optimizer, variables, sums, strategy, only=None):
    """Moves Keras' accumulators (e.g. just loaded) into the running sums and zeroes them.

    The sums are sync-on-read with SUM aggregation: assigning a total from
    cross-replica context splits it over the replicas, so their sum is kept.
    It lands in the dense part of each sum; a variable whose gradients are
    rows takes its nonzero rows at the next micro-batch.
    Keras' accumulators must stay zero while the sums are used: its update
    adds them to the all-reduced sums.

    Args:
        only: Optional set of variable ids to move (others keep their sums).
    """
    with strategy.scope():
        for v, running, keras_accumulator in zip(variables, sums.sums, sums.keras_accumulators(optimizer, variables)):
            if only is not None and id(v) not in only:
                continue
            running.set_total(keras_accumulator.value if hasattr(keras_accumulator, "value") else keras_accumulator)
            keras_accumulator.assign(tf.zeros_like(keras_accumulator))


def zero_keras_accumulators(optimizer, variables, sums, strategy):
    with strategy.scope():
        for keras_accumulator in sums.keras_accumulators(optimizer, variables):
            keras_accumulator.assign(tf.zeros_like(keras_accumulator))
