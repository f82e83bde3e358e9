"""The functions `fit`/`evaluate` call per execution, built from a replica step.

Keras' own factory builds them (`_runtime.trainer_functions.make_step_function`). What is
decided here: whether the step is the user's own (then made exact for the
global batch, `user_step`), how the values a user's step returns are reduced
over the replicas (`distribute_reduction_method`), and the replica axis
`MultiWorkerMirroredStrategy`'s output reduction needs.
"""

import numbers
import warnings

import tensorflow as tf

from keras_dist import _compat, errors
from keras_dist._model import user_step
from keras_dist._runtime import strategy_info, trainer_functions, variables

REDUCTION_METHODS = ("auto", "mean", "sum", "first")


def make(model, replica_step, *, user_written, marks=None):
    """The train or test function for `replica_step` (`model.train_step` or `model.test_step`).

    Args:
        model: The `DistributedModel`.
        replica_step: The bound step, run in replica context on one per-replica batch.
        user_written: Boolean, the step overrides `DistributedModel`'s.
        marks: `None`, or the `StepMarksBuffer` a train step of the user's
            takes the timeline's timestamps into (keras-dist's own step
            finds it itself).
    """
    if user_written:
        replica_step = user_step.exact_for_global_batch(model, replica_step, marks=marks)
    return trainer_functions.make_step_function(
        model,
        lambda data: _reduce_in_replica_context(model, replica_step(data), user_written=user_written),
        add_replica_axis=_compat.is_active("multi_worker_output_reduction")
        and variables.is_multi_worker(model._distribute_strategy),
        synchronized_outputs=_returns_synchronized_outputs(user_written),
    )


def trace_predict_for_any_batch(model):
    """Sets `model.predict_function` to `trainer_functions.predict_for_any_batch` of it (several replicas)."""
    model.predict_function = trainer_functions.predict_for_any_batch(model.predict_function)


def _reduce_in_replica_context(model, outputs, *, user_written):
    """Applies `distribute_reduction_method` so every replica returns the reduced value.

    Only to the outputs of a step you wrote (`user_written`): they may
    differ between replicas. keras-dist's own steps return values already
    equal on every replica (the metrics of the global batch), which a "sum"
    would multiply by the replicas.
    """
    method = model.distribute_reduction_method
    num_replicas = model._distribute_strategy.num_replicas_in_sync
    if (
        method == "auto"
        or num_replicas == 1
        or not _compat.is_active("distribute_reduction_method")
        or _returns_synchronized_outputs(user_written)
    ):
        return outputs
    context = tf.distribute.get_replica_context()

    def reduce(value):
        if not isinstance(value, (tf.Tensor, tf.Variable)):
            return value
        value = tf.identity(value)  # On this replica's device: a result made in cross-replica context has none.
        if method == "first":
            is_first = tf.equal(context.replica_id_in_sync_group, 0)
            value = tf.where(is_first, value, tf.zeros_like(value))
        return context.all_reduce("MEAN" if method == "mean" else "SUM", value)

    return tf.nest.map_structure(reduce, outputs)


def _returns_synchronized_outputs(user_written):
    """Whether the step returns the same values on every replica: keras-dist's or Keras' own step, metrics summed over replicas.

    An overriding step may return per-replica values (e.g. a loss tensor);
    those keep Keras' mean over the replicas.
    """
    return not user_written and _compat.is_active("cross_replica_metrics")


def limit_steps_per_execution(model, kwargs):
    """Where the all-reduce runs collective ops, replaces `compile(steps_per_execution > 1)` by 1, with a warning (changes `kwargs`).

    Several workers, or one worker's `MirroredStrategy` with TensorFlow's
    `CollectiveAllReduce` (its default on several CPUs: a new-user probe's
    `fit` and `evaluate` failed). The value asked for stays on the model:
    `fit`, `evaluate` and `predict` then run the steps Keras runs with it
    (`keras_step_counts`).
    """
    steps_per_execution = kwargs.get("steps_per_execution", 1)
    model._requested_steps_per_execution = 1
    strategy = model._distribute_strategy
    collective = variables.is_multi_worker(strategy) or (
        strategy_info.all_reduce_implementation(strategy) == "CollectiveAllReduce"  # "none" for one replica.
    )
    if steps_per_execution != 1 and collective and _compat.is_active("multi_worker_steps_per_execution"):
        warnings.warn(
            "`steps_per_execution` > 1 is not supported where the all-reduce runs TensorFlow's collective ops "
            "(MultiWorkerMirroredStrategy, or MirroredStrategy's CollectiveAllReduce) yet "
            "(TensorFlow fails on collectives inside Keras' multi-step loop); using 1. "
            f"Received: steps_per_execution={steps_per_execution}. The results are the same: "
            "a `steps_per_epoch`, `validation_steps` or `steps` runs the steps Keras runs in whole "
            f"executions of {steps_per_execution} (rounded up to a multiple of {steps_per_execution}). "
            "Pass steps_per_execution=1 to silence this warning.",
            errors.KerasDistWarning,
            stacklevel=3,
        )
        model._requested_steps_per_execution = int(steps_per_execution)
        kwargs["steps_per_execution"] = 1


def keras_step_counts(model, arguments, names):
    """Rounds the step counts `names` of `arguments` up as Keras runs them with the `steps_per_execution` asked for.

    Keras runs whole executions: with `steps_per_execution=k`, `fit(steps_per_epoch=s)`
    runs `ceil(s / k)` executions of `k` steps each (fewer only when the input
    runs out), and so do `validation_steps`, `evaluate(steps=...)` and
    `predict(steps=...)`. When `limit_steps_per_execution` replaced `k` by 1,
    `s` becomes `ceil(s / k) * k`: the same steps, one per execution. A count
    Keras takes from the input (`None`) needs nothing: the last execution
    stops where the input ends, as one step per execution does.

    Args:
        model: The `DistributedModel`.
        arguments: Dict of `fit`'s, `evaluate`'s or `predict`'s arguments by name (changed in place).
        names: The names of the step counts among them.
    """
    per_execution = getattr(model, "_requested_steps_per_execution", 1)
    if per_execution == 1 or model.steps_per_execution != 1:
        return
    for name in names:
        steps = arguments.get(name)
        if isinstance(steps, numbers.Integral) and steps > 0:
            arguments[name] = -(-steps // per_execution) * per_execution
