"""The private Keras 3 internals keras-dist relies on, imported in one place.

Layers 1 and 2 reach each of these names through this module only, so a Keras
release that moves or renames one breaks this file alone, and
`tests/unit/test_runtime.py` (which resolves every name here against the
installed Keras) says which.
"""

import contextlib

import keras
import tensorflow as tf

# Where Keras 3.10-3.16 all keep them (keras.src.backend re-exported them until Keras 3.16).
from keras.src.backend.common.masking import get_keras_mask as get_keras_mask  # Re-exported.
from keras.src.backend.common.masking import set_keras_mask as set_keras_mask  # Re-exported.
from keras.src.backend.common.stateless_scope import in_stateless_scope as in_stateless_scope  # Re-exported.
from keras.src.backend.common.symbolic_scope import in_symbolic_scope as in_symbolic_scope  # Re-exported.
from keras.src.losses.loss import unscale_loss_for_distribution
from keras.src.losses.losses import LossFunctionWrapper
from keras.src.models.functional import Functional
from keras.src.models.model import functional_init_arguments
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras.src.trainers.data_adapters.data_adapter_utils import unpack_x_y_sample_weight
from keras.src.trainers.trainer import model_supports_jit as model_supports_jit  # Re-exported.
from keras.src.utils.rng_utils import get_random_seed

from keras_dist._compat import locations

TensorFlowTrainer = locations.tensorflow_trainer_class()  # Keras' TensorFlow trainer (renamed in Keras 3.16).

__all__ = [
    "Functional",
    "LossFunctionWrapper",
    "TensorFlowTrainer",
    "apply_once_in_cross_replica_context",
    "apply_without_merge_call",
    "compile_arguments",
    "compiled_metrics",
    "record_compile_argument",
    "trainable_variables_of",
    "functional_init_arguments",
    "unpack_x_y_sample_weight",
    "unscale_loss_for_distribution",
    "dataset_element_spec",
    "functional_structure",
    "get_data_adapter",
    "get_keras_mask",
    "get_random_seed",
    "in_stateless_scope",
    "in_symbolic_scope",
    "gradients_already_reduced",
    "optimizer_chain",
    "optimizer_strategy",
    "optimizers_within",
    "set_keras_mask",
    "overwrites_with_moving_average",
    "raw_iterations",
    "uses_learning_rate_schedule",
    "is_graph_network",
    "set_distribute_strategy",
    "tf_functions_behind",
]


def functional_structure(model):
    """Returns `(inputs, outputs)` of a functional model with their nesting (dicts, lists) kept."""
    return model._inputs_struct, model._outputs_struct


def compile_arguments(model):
    """Returns the arguments `model.compile(...)` was last called with, as live objects.

    Args:
        model: A compiled `keras.Model`.

    Returns:
        Dict of `compile` keyword arguments (the optimizer is the same object, so
        its state is kept), or `None` when the model was never compiled.
    """
    config = getattr(model, "_compile_config", None)
    if not getattr(model, "compiled", False) or config is None:
        return None
    return dict(config.config)


def record_compile_argument(model, name, value):
    """Sets `name=value` in the compile arguments Keras saves with the model (`model._compile_config`).

    Used after `compile` so that `keras.models.load_model` compiles the loaded
    model the same way (e.g. `jit_compile=True` that keras-dist applies per replica).
    """
    model._compile_config.config[name] = value


def compiled_metrics(model):
    """Returns the list of metrics `compile(metrics=...)` created (Keras' `model._compile_metrics`), or `[]`."""
    compile_metrics = getattr(model, "_compile_metrics", None)
    return compile_metrics.metrics if compile_metrics is not None else []


def trainable_variables_of(optimizer):
    """Returns the list of variables a built Keras optimizer updates (its private `_trainable_variables`)."""
    return list(optimizer._trainable_variables)


def dataset_element_spec(epoch_iterator):
    """Returns the element spec of the global batches a Keras epoch iterator yields.

    Args:
        epoch_iterator: `keras.src.trainers.epoch_iterator.EpochIterator` (TF backend).

    Returns:
        Nested structure of `tf.TensorSpec` (batch dimension first, usually `None`).
    """
    return epoch_iterator.data_adapter.get_tf_dataset().element_spec


def get_data_adapter(x, y=None, sample_weight=None, batch_size=None, steps=None):
    """Returns Keras' data adapter for `(x, y, sample_weight)`, as `evaluate` builds it (no shuffle)."""
    from keras.src.trainers.data_adapters import get_data_adapter as keras_get_data_adapter

    return keras_get_data_adapter(
        x, y, sample_weight=sample_weight, batch_size=batch_size, steps_per_epoch=steps, shuffle=False
    )


def optimizer_chain(optimizer):
    """Returns `[optimizer, its inner_optimizer, ...]` (a `LossScaleOptimizer` wraps another)."""
    chain = []
    while optimizer is not None and optimizer not in chain:
        chain.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return chain


def optimizer_strategy(optimizer):
    """Returns the `tf.distribute.Strategy` a Keras (TensorFlow) optimizer creates and updates its variables under, or `None`."""
    return getattr(optimizer, "_distribution_strategy", None)


def optimizers_within(optimizer):
    """Returns `optimizer` and every optimizer it delegates to, each once, outermost first.

    Follows a `LossScaleOptimizer`'s `inner_optimizer`, a `MultiOptimizer`'s
    `optimizers`, and any attribute of a user-written wrapper that holds a Keras
    optimizer (or a list, tuple or dict of them): the optimizers whose `apply`
    may run on the gradients given to `optimizer.apply`.

    Args:
        optimizer: A `keras.optimizers.Optimizer`, or `None`.

    Returns:
        List of `keras.optimizers.Optimizer` (empty for `None`).
    """
    from keras.optimizers import Optimizer

    found, pending = [], [optimizer]
    while pending:
        current = pending.pop(0)
        if not isinstance(current, Optimizer) or any(current is seen for seen in found):
            continue
        found.append(current)
        for value in list(vars(current).values()):
            if isinstance(value, Optimizer):
                pending.append(value)
            elif isinstance(value, (list, tuple)):
                pending.extend(v for v in value if isinstance(v, Optimizer))
            elif isinstance(value, dict):
                pending.extend(v for v in value.values() if isinstance(v, Optimizer))
    return found


def overwrites_with_moving_average(optimizer):
    """True when `optimizer`'s `apply` (or an optimizer's it delegates to) may overwrite the weights with their EMA.

    Keras' `_backend_apply_gradients` does that inside `ops.cond` when
    `use_ema=True` and `ema_overwrite_frequency` is set; the TensorFlow
    overwrite calls `extended.update`, a `merge_call` in replica context.
    """
    return any(
        getattr(opt, "use_ema", False) and getattr(opt, "ema_overwrite_frequency", None)
        for opt in optimizers_within(optimizer)
    )


@contextlib.contextmanager
def gradients_already_reduced(optimizer):
    """Makes `optimizer.apply` skip its own cross-replica gradient sum while the block runs.

    Keras' TensorFlow optimizer sums gradients over replicas inside `apply`
    (`TFOptimizer._all_reduce_sum_gradients`), after clipping them. keras-dist
    sums them before `apply` instead; inside this block the optimizer (and the
    inner optimizer of a `LossScaleOptimizer`) takes the gradients as given.
    Only this instance changes, only while the block runs (at trace time).
    Re-entrant: MirroredStrategy's replica threads each enter it, and the
    override stays until the last one leaves.
    """
    chain = optimizers_within(optimizer)
    for opt in chain:
        opt.__dict__["_keras_dist_reduced_depth"] = opt.__dict__.get("_keras_dist_reduced_depth", 0) + 1
        opt._all_reduce_sum_gradients = list
    try:
        yield
    finally:
        for opt in chain:
            opt.__dict__["_keras_dist_reduced_depth"] -= 1
            if not opt.__dict__["_keras_dist_reduced_depth"]:
                opt.__dict__.pop("_all_reduce_sum_gradients", None)


@contextlib.contextmanager
def _without_merge_call(strategy):
    """Tells `strategy` it needs no `merge_call` while the block runs, so Keras' `maybe_merge_call`s run directly."""
    extended = strategy.extended
    extended._use_merge_call = lambda: False
    try:
        yield
    finally:
        extended.__dict__.pop("_use_merge_call", None)


def apply_without_merge_call(optimizer, keras_apply, gradients, variables):
    """Runs Keras' `apply` from cross-replica context on gradients already summed over replicas.

    Args:
        optimizer: The Keras optimizer.
        keras_apply: The class's unbound `apply` (the instance's may be replaced).
        gradients: List of summed gradients (plain tensors), `None` allowed.
        variables: The matching trainable variables; `extended.update` inside
            writes every replica's copy.
    """
    with _without_merge_call(tf.distribute.get_strategy()):
        keras_apply(optimizer, gradients, variables)


def apply_once_in_cross_replica_context(optimizer, gradients, variables, keras_apply):
    """Applies gradients already summed over replicas once, from cross-replica context.

    Keras' gradient accumulation makes `optimizer.apply` choose between
    updating and accumulating with `ops.cond`, and both branches reach
    `merge_call`, which TensorFlow refuses inside a conditional in replica
    context (keras-team/keras#17429); so does the conditional overwrite of the
    weights with their moving averages (`use_ema` with
    `ema_overwrite_frequency`). The summed gradients are the same on every
    replica, so one `merge_call` runs the whole `apply` in cross-replica
    context on the first replica's copy; its variable updates
    (`extended.update`) then write every replica's copy. Keras' own
    `maybe_merge_call`s inside need a replica context unless the strategy
    says it works without `merge_call`, which it is told for the duration.

    Args:
        optimizer: The Keras optimizer.
        gradients: List of summed gradients (replica context), `None` allowed.
        variables: The matching list of trainable variables.
        keras_apply: The class's unbound `apply`.

    Distributed behavior:
        Runs in replica context and calls `merge_call` once: every replica
        must call it.
    """
    context = tf.distribute.get_replica_context()

    def apply(strategy, summed):
        first = [None if g is None else strategy.experimental_local_results(g)[0] for g in summed]
        with _without_merge_call(strategy):
            if isinstance(optimizer, LossScaleOptimizer):
                # Its `apply` refuses cross-replica context; its backend-neutral body does not need one:
                # the summed gradients' overflow check, then the inner optimizer's `apply`.
                optimizer._common_apply(first, variables)
            else:
                keras_apply(optimizer, first, variables)

    context.merge_call(apply, args=(gradients,))


# ---- Private attributes read or written by layers 1 and 2 (callbacks, data, `distribute`).


def raw_iterations(optimizer):
    """Returns the variable that counts every `apply` of `optimizer`'s innermost optimizer.

    Private API: Keras' `BaseOptimizer._iterations`. The public `iterations`
    divides it by `gradient_accumulation_steps`, and a `LossScaleOptimizer`
    delegates to its inner optimizer's; keras-dist counts training steps
    (micro-batches under accumulation) and must set the counter back
    (`exhausted_input_iteration_count`), so it needs the variable itself.

    Args:
        optimizer: A `keras.optimizers.Optimizer`, possibly wrapped.

    Returns:
        The int64 scalar `keras.Variable` (read it with `keras.ops.convert_to_numpy`,
        write it with `.assign`).
    """
    return optimizer_chain(optimizer)[-1]._iterations


def uses_learning_rate_schedule(optimizer):
    """True when `optimizer` was given a `keras.optimizers.schedules.LearningRateSchedule`.

    Private API: Keras keeps the schedule in `BaseOptimizer._learning_rate`;
    the public `learning_rate` returns the schedule's current value, so it
    cannot tell a schedule from a fixed rate.
    """
    return isinstance(getattr(optimizer, "_learning_rate", None), keras.optimizers.schedules.LearningRateSchedule)


def is_graph_network(model):
    """Returns `model._is_graph_network`, `True` when the model has no such attribute.

    Private API: tf.keras' flag for a functional graph. Keras 3 does not set
    it, so every Keras 3 model counts as a graph network here unless it sets
    the attribute itself (kept for such models; their input ranks are not
    trusted to tell batched datasets from unbatched ones).
    """
    return getattr(model, "_is_graph_network", True)


def set_distribute_strategy(model, strategy):
    """Makes `strategy` the `tf.distribute.Strategy` that `model`'s `fit`/`evaluate`/`predict` run under.

    Private API: Keras' TensorFlow trainer keeps it in `_distribute_strategy`
    (its `distribute_strategy` property has no setter); `keras_dist.distribute`
    moves an existing `DistributedModel` to another strategy.
    """
    model._distribute_strategy = strategy


def tf_functions_behind(function, depth=3):
    """Returns the `tf.function`s that `function` is or closes over (a few levels deep), each once.

    Keras 3 internals: its TensorFlow trainer wraps the `tf.function`s of
    `model.train_function` (and test, predict) in plain Python closures, so
    their tracing counts are found in the closures' cells (`__closure__`) and
    in `__wrapped__`, not through a public attribute.

    Args:
        function: A callable (e.g. `model.train_function`), or `None`.
        depth: Integer, how many closure levels to search.

    Returns:
        List of `tf.function` objects (empty for `None`).
    """
    found, seen, pending = [], set(), [(function, 0)]
    while pending:
        candidate, level = pending.pop()
        if candidate is None or id(candidate) in seen:
            continue
        seen.add(id(candidate))
        if hasattr(candidate, "experimental_get_tracing_count"):
            found.append(candidate)
            continue
        if level < depth:
            for cell in getattr(candidate, "__closure__", None) or ():
                try:
                    pending.append((cell.cell_contents, level + 1))
                except ValueError:  # An empty cell.
                    pass
            pending.append((getattr(candidate, "__wrapped__", None), level + 1))
    return found
