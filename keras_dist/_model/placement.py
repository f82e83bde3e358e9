"""Every variable a `DistributedModel` owns, under its strategy's scope; seeds; the build context.

`distribute_state` runs before every step function is made, after `compile`,
and around Keras' symbolic build: it re-homes variables created elsewhere
(layers built before the model, an optimizer made outside any scope, metric
state), applies the layer-state fixes, decorrelates the replicas' seed
generators, and resets the step functions when something moved. It is cheap
when nothing moved.
"""

from keras_dist import _compat
from keras_dist._runtime import build_context, empty_batch, symbolic_build, variables
from keras_dist._runtime import keras_internals as ki
from keras_dist._runtime import layers as runtime_layers
from keras_dist.collectives import _optimizer as collectives_optimizer


def distribute_state(model):
    """Re-homes every variable `model` owns onto its strategy (cheap when nothing moved).

    Raises:
        ValueError: a layer of `model` is stateful (`LSTM(stateful=True)`) under several replicas.
    """
    strategy = model._distribute_strategy
    if variables.is_multi_replica(strategy):
        check_no_stateful_layers(model, strategy.num_replicas_in_sync)
    if _compat.is_active("empty_batch_convolution") and variables.is_multi_replica(strategy):
        empty_batch.install(lambda: _compat.is_active("empty_batch_convolution"))
    if _compat.is_active("variable_scalar_conversion") and variables.is_multi_replica(strategy):
        variables.install_scalar_conversion(lambda: _compat.is_active("variable_scalar_conversion"))
    if _compat.is_active("empty_replica_batch_norm") and variables.is_multi_replica(strategy):
        guarded = [
            runtime_layers.guard_empty_batch_moments(bn) for bn in runtime_layers.batch_normalization_layers(model)
        ]
        if any(guarded):
            _reset_step_functions(model, "train_function")
    if _compat.is_active("sparse_embedding_read"):
        reading_rows = [
            runtime_layers.read_embedding_rows(layer, lambda: _compat.is_active("sparse_embedding_read"))
            for layer in runtime_layers.embedding_layers(model)
        ]
        if any(reading_rows):
            _reset_step_functions(model, "train_function", "test_function", "predict_function")
    if _compat.is_active("mirrored_layer_state") and variables.is_multi_replica(strategy):
        for v in model.weights:
            if not v.trainable and v.aggregation == "none" and "float" in v.dtype:
                variables.set_aggregation(v, "mean")
    try:
        metrics_variables = model.metrics_variables
    except AttributeError:  # A `metrics` property reading attributes set after __init__.
        metrics_variables = []
    owned = {id(v): v for v in [*model.variables, *model.weights, *metrics_variables]}
    moved = sum(variables.rehome(v, strategy) for v in owned.values())
    _decorrelate_seeds(model, owned.values())
    optimizers = _owned_optimizers(model)
    for optimizer in optimizers:
        if _compat.is_active("optimizer_strategy"):
            moved += variables.rehome_optimizer(optimizer, strategy)
        if _compat.is_active("optimizer_built_in_step") and variables.build_outside_step(
            optimizer, without_strategy=True
        ):  # On one replica too: an assign in `build` is lost when built in the trace (ScheduleFreeAdamW).
            _reset_step_functions(model, "train_function")
    if moved:
        for optimizer in optimizers:
            variables.reindex_optimizer(optimizer)
        _reset_step_functions(model, "train_function", "test_function", "predict_function")


def check_no_stateful_layers(model, num_replicas):
    """Raises `ValueError` naming the first stateful layer of `model` (an RNN with `stateful=True`).

    A stateful RNN carries each example's state from one batch to the next,
    for a batch size fixed when it is built. Under several replicas each
    replica runs on its own part of every batch: the state was built for
    the global batch (Keras' "If an RNN is stateful, the batch size ..."
    error, or TensorFlow's `Incompatible shapes: [0,16] vs. [4,16]` on a
    replica whose part is empty, in a new-user probe), and nothing keeps an
    example's sequence on one replica. Not supported (docs/troubleshooting.md).
    """
    for layer in model._flatten_layers(include_self=False):
        if getattr(layer, "stateful", False) is True:
            raise ValueError(
                f"Layer {layer.name!r} ({type(layer).__name__}) is stateful (`stateful=True`): it carries each "
                f"example's state from one batch to the next, for one batch size. keras-dist expected no stateful "
                f"layers under several replicas; received a model with {num_replicas} replicas in sync, where each "
                "replica runs on its own part of every batch. Fix: train a stateful RNN on one device "
                '(`DistributedModel(..., strategy="one_device")`), or use `stateful=False` and pass whole '
                "sequences (docs/troubleshooting.md, stateful RNNs)."
            )


def _reset_step_functions(model, *names):
    """Sets the named step functions to `None`, to be traced again; a train function that existed is made again now.

    Keras' `fit` makes `train_function` once, before its first epoch, and calls
    it from then on. Variables first created inside a step (the metrics of a
    model Keras cannot build ahead, keras.io's graph attention network) are
    re-homed at the next `distribute_state`, which `fit`'s validation runs
    mid-`fit`: a `None` there failed the next epoch ('NoneType' object is not
    callable; a new-user probe). Made again, it is traced with the re-homed
    variables on its next call.
    """
    remake = "train_function" in names and getattr(model, "train_function", None) is not None
    for name in names:
        setattr(model, name, None)
    if remake:
        model.make_train_function()


def _owned_optimizers(model):
    """The compiled optimizer and those kept in the model's attributes (a GAN's `d_optimizer`, `g_optimizer`).

    An optimizer in an attribute, which `compile` did not set up, is made
    to sum its gradients over the replicas before it applies them, as the
    compiled one (`keras_dist.distributed_optimizer`, with `communication`).
    """
    compiled = getattr(model, "optimizer", None)
    found = variables.optimizers_in(vars(model).values())
    for optimizer in found:
        if optimizer is not compiled and not collectives_optimizer.is_distributed_optimizer(optimizer):
            collectives_optimizer.distributed_optimizer(optimizer, model.communication)
    if compiled is not None and all(o is not compiled for o in found):
        found.insert(0, compiled)
    return found


def _decorrelate_seeds(model, candidates):
    strategy = model._distribute_strategy
    if not (_compat.is_active("replica_seed_state") and variables.is_multi_replica(strategy)):
        return
    done = model.__dict__.setdefault("_keras_dist_seeded", {})
    for v in candidates:
        if v.name == variables.SEED_STATE_NAME and done.get(id(v)) is not v.value:
            variables.decorrelate_seed_state(v, strategy)
            done[id(v)] = v.value


def build(model, iterator=None, data_batch=None):
    """`DistributedModel._maybe_symbolic_build`: Keras' pre-build of model, metric and optimizer state, fixed."""
    distribute_state(model)  # Layers built after compile (outside the scope) move before the optimizer builds.
    if not symbolic_build.has_own_call(model) and _compat.is_active("build_without_call"):
        with model._distribute_strategy.scope():
            symbolic_build.build_without_call(model)
    elif not _compat.is_active("symbolic_build_from_spec"):
        symbolic_build.maybe_symbolic_build(model, iterator=iterator, data_batch=data_batch)
    else:
        if iterator is not None:
            data_batch = ki.dataset_element_spec(iterator)
        try:
            with _build_context(model):
                symbolic_build.symbolic_build_from_spec(
                    model,
                    data_batch,
                    composite_inputs=_compat.is_active("ragged_symbolic_build"),
                    defer_without_targets=_compat.is_active("symbolic_build_without_targets"),
                )
        except (ValueError, TypeError, RuntimeError, KeyError):
            if not (_own_step(model) and _compat.is_active("build_for_own_step")):
                raise
            # The step may call the model on inputs it makes (MixUp before `super().train_step`): build as one device.
            with model._distribute_strategy.scope():
                symbolic_build.build_without_call(model)
            symbolic_build.build_compiled_in_first_step(model)
    distribute_state(model)


def _own_step(model):
    """Whether `model`'s class writes its own train/test/predict step (keras-dist's and Keras' are not)."""
    overrides = getattr(model, "_overrides", None)
    return overrides is not None and any(overrides(name) for name in ("train_step", "test_step", "predict_step"))


def _build_context(model):
    """The strategy's scope, in a replica context for layers that call collectives (`build_in_replica_context`)."""
    strategy = model._distribute_strategy
    if _compat.is_active("build_in_replica_context"):
        return build_context.symbolic_replica_context(strategy, optimizer=getattr(model, "optimizer", None))
    return strategy.scope()
