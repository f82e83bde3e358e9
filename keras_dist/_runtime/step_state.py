"""Layer 3: `ReplicaStep`, what one replica's step tells the gradient all-reduce (the one side channel).

Keras' `optimizer.apply_gradients(...)` is called from inside a step: keras-dist's
own `train_step`, or a `train_step` the user wrote for one device. Its
arguments carry only the gradients; how each replica's gradients count in the
sum (by its share of the examples, or as they are) and what else travels in
the same all-reduce (example counts, metric state) is decided by the step.
The step registers one `ReplicaStep` per replica for its duration and the
optimizer's `apply` (`keras_dist.collectives._optimizer`) reads it: the shape of
Accelerate's `GradientState` (`src/accelerate/state.py`), keyed by the replica
context instead of held in a thread-local, so that every replica thread of a
`MirroredStrategy` finds its own.

Everything here runs when a step is traced (graph mode) or run eagerly; the
tensors are the replica's own.
"""

import contextlib
import dataclasses

import tensorflow as tf
from keras import tree

# How the gradients a step hands to `apply` count in the cross-replica sum.
SUM = "sum"  # Already weighted for the global batch: summed as given.
EXAMPLES_IN_ALL_REDUCE = "examples_in_all_reduce"  # Gradients of this replica's mean: weighted by `num_examples / total` inside the all-reduce.
EXAMPLES = "examples"  # Gradients of this replica's mean: scaled by `num_examples / global_examples` before the sum.

_STEPS = {}  # id(replica context) -> ReplicaStep, while a step runs on that replica.


@dataclasses.dataclass
class ReplicaStep:
    """One replica's step, as the gradient all-reduce needs to know it.

    Attributes:
        weighting: `SUM`, `EXAMPLES_IN_ALL_REDUCE` or `EXAMPLES` (see above).
        num_examples: int32 scalar tensor, this replica's examples in the step.
        global_examples: float32 scalar tensor, the examples of all replicas
            (for `EXAMPLES`; known before the step's forward pass), or `None`.
        extras: List of float32 tensors to sum over the replicas in the
            gradient all-reduce (e.g. metric state), or empty.
        extras_sums: Set by the all-reduce: one tensor per `extras` entry,
            equal on every replica; `None` while no all-reduce carried them.
        user_step: Boolean, the step is one the user wrote (`train_step` or
            `test_step` overridden): `compute_loss` and scalar `Mean` updates
            inside it are made exact for the global batch.
        marks: `None` (the timeline is off), or this replica's
            `step_marks.StepMarks`: the gradient all-reduce and `apply` take
            their timestamps there.
        tape_all_reduce: `None`, or (a step the user wrote, which trains)
            `fn(gradients, variables) -> gradients` summing a list of
            gradients of `variables` over the replicas (the optimizer's
            all-reduce): `tf.GradientTape.gradient` then returns the global
            batch's gradients (`user_steps`).
        global_gradient_ids: `id`s of the variables whose gradients
            `tape_all_reduce` already summed in this step: `apply` takes
            their gradients as they are.
        weighted_in_backward: Boolean, true while `tf.GradientTape.gradient`
            in a user's step weights the target by the example share itself
            (`user_steps._backward_weights`): gradients that compensate
            for weighting after the backward pass (`gather`) do not then.
        options: `tf.distribute.experimental.CommunicationOptions` of the
            step's small all-reduces (a user's step), or `None`.
        ratio_shares: `id` of a loss value written as a ratio of sums ->
            `(value, share)`: this replica's share of the global batch's
            denominator (`loss_terms.ratio_share`), computed once per value.
        data_leaves: The tensors of the step's batch (a user's step and keras-dist's own), in
            `tree.flatten` order; `leaf_counts` / `global_leaf_counts` their
            leading dimensions on this replica / summed over the replicas
            (float32 vectors), where a batch zips inputs of different batch
            sizes; `example_leaf` the index of the leaf the examples are
            counted from. `leaves_of`: `id` of a value -> `(value, index)`
            (`loss_terms.term_share`; `index` a tuple where the value joins
            several leaves' rows).
        global_results: `None`, or (a user's step) the
            `metric_results.GlobalResults` whose metrics' `result()` reads the
            state summed over the replicas.
    """

    weighting: str
    num_examples: object = None
    global_examples: object = None
    extras: list = dataclasses.field(default_factory=list)
    extras_sums: object = None
    user_step: bool = False
    marks: object = None
    tape_all_reduce: object = None
    global_gradient_ids: set = dataclasses.field(default_factory=set)
    weighted_in_backward: bool = False
    options: object = None
    ratio_shares: dict = dataclasses.field(default_factory=dict)
    data_leaves: list = dataclasses.field(default_factory=list)
    leaf_counts: object = None
    global_leaf_counts: object = None
    example_leaf: object = None
    leaves_of: dict = dataclasses.field(default_factory=dict)
    global_results: object = None

    def leaf_share(self, index):
        """float32 scalar: this replica's share of the global batch's rows of data leaf `index` (0 when none).

        `index` may be a tuple of leaves whose rows a value joins (a
        concatenation of the batch's parts): the share of their rows together.
        """
        if isinstance(index, tuple):
            rows = tf.add_n([self.leaf_counts[i] for i in index])
            return tf.math.divide_no_nan(rows, tf.add_n([self.global_leaf_counts[i] for i in index]))
        return tf.math.divide_no_nan(self.leaf_counts[index], self.global_leaf_counts[index])

    def example_share(self):
        """float32 scalar `num_examples / global_examples` (0 when the global batch is empty)."""
        return tf.math.divide_no_nan(tf.cast(self.num_examples, tf.float32), tf.cast(self.global_examples, tf.float32))

    def by_share(self, gradient):
        """`gradient` (a tensor, `tf.IndexedSlices` or `None`) times `example_share()`; zeros on a replica without examples."""
        if gradient is None:
            return None
        share = self.example_share()
        if isinstance(gradient, tf.IndexedSlices):
            return tf.IndexedSlices(
                gradient.values * tf.cast(share, gradient.values.dtype), gradient.indices, gradient.dense_shape
            )
        return self.zeros_if_empty(gradient * tf.cast(share, gradient.dtype))

    def zeros_if_empty(self, gradient):
        """`gradient` (a tensor, `tf.IndexedSlices` or `None`), zeros on a replica without examples (its loss may be NaN)."""
        if gradient is None or isinstance(gradient, tf.IndexedSlices):
            return gradient
        return tf.where(self.num_examples > 0, gradient, tf.zeros_like(gradient))

    def already_summed(self, variables):
        """Whether the gradients of every one of `variables` were summed over the replicas by `tape_all_reduce`."""
        return bool(variables) and all(id(v) in self.global_gradient_ids for v in variables)


def data_leaves(data):
    """The tensors of a batch `data` (any nesting) with a leading dimension, in `tree.flatten` order: `ReplicaStep.data_leaves`."""
    return [t for t in tree.flatten(data) if tf.is_tensor(t) and t.shape.rank]


def replica_key():
    """A key for this replica's context (an int), or `None` in cross-replica context or outside any strategy's replica."""
    context = tf.distribute.get_replica_context()
    if context is None or tf.distribute.in_cross_replica_context():
        return None
    return id(context)


def current():
    """The `ReplicaStep` of the step running on this replica, or `None` (no step, or cross-replica context)."""
    key = replica_key()
    return None if key is None else _STEPS.get(key)


@contextlib.contextmanager
def running(step):
    """Registers `step` (a `ReplicaStep`) for this replica context while the block runs.

    Re-entrant: an inner step (a user `train_step` calling keras-dist's own)
    shadows the outer one and restores it on exit.
    """
    key = replica_key()
    if key is None:
        yield step
        return
    previous = _STEPS.get(key)
    _STEPS[key] = step
    try:
        yield step
    finally:
        if previous is None:
            _STEPS.pop(key, None)
        else:
            _STEPS[key] = previous
