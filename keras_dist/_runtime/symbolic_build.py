"""Keras' pre-build of model, metric and optimizer state (`Trainer._symbolic_build`), for a model under a strategy.

From a batch's element spec (one replica's spec of a distributed dataset, no
batch taken from the iterator), on ragged or sparse placeholders where the
inputs are ragged or sparse, or, for a model without `call` (a GAN that trains
through its own `train_step`), what can be built without tracing. Data without
targets builds no compiled loss or metrics (`targets_deferred`).
"""

import contextlib

import keras
import tensorflow as tf
from tensorflow.python.distribute.values import PerReplicaSpec

from keras_dist._runtime import build_context, variables
from keras_dist._runtime import keras_internals as ki


def has_own_call(model):
    """Returns whether `model` defines `call` (a functional model does; a GAN that only has a `train_step` not)."""
    return type(model).call is not keras.Model.call


def build_without_call(model):
    """What Keras' `_symbolic_build` can build of a model that has no `call`, and what the steps must build.

    Nothing is traced: on one device Keras builds such a model (a GAN that
    trains through its own `train_step`) in the first step. Here the compiled
    optimizer is built on the trainable variables when every layer is built
    (the keras.io GAN's sub-models start with `keras.Input`); layers not built
    yet, and the optimizer then, build in the first step, once, outside the
    step function (`variables.build_outside_step`). Call it under the
    model's strategy scope.
    """
    unbuilt = [layer for layer in model._flatten_layers(include_self=False) if not layer.built]
    if model.distribute_strategy.num_replicas_in_sync > 1:
        for layer in unbuilt:
            variables.build_outside_step(layer)
    if model.optimizer is not None and not model.optimizer.built and not unbuilt:
        model.optimizer.build(model.trainable_variables)


def symbolic_build_from_spec(model, element_spec, *, composite_inputs=False, defer_without_targets=False):
    """Builds model, metric and optimizer state from a batch's element spec.

    Args:
        model: The `keras.Model`.
        element_spec: Nested `tf.TypeSpec` structure of one global batch.
        composite_inputs: Boolean, trace `call` on ragged/sparse placeholders where
            the inputs are ragged/sparse (`build_context.build_from_composite_spec`)
            instead of Keras' dense ones.
        defer_without_targets: Boolean, build no compiled loss or metrics when
            the batches have no targets (`targets_deferred`).
    """
    spec = tf.nest.map_structure(_one_replica_spec, element_spec, expand_composites=False)
    defer = defer_without_targets and not has_targets(spec)
    with targets_deferred(model) if defer else contextlib.nullcontext():
        if composite_inputs and build_context.has_composite_inputs(spec):
            build_context.build_from_composite_spec(model, spec)
        else:
            model._symbolic_build(data_batch=spec)
    if defer:
        build_compiled_in_first_step(model)


def build_compiled_in_first_step(model):
    """Makes the compiled loss and metrics build when first called, once, outside the step function.

    As on one device, they build from the targets and predictions of the
    step's first call to `compute_loss` / `compute_metrics`; the variables are
    created once for all replicas (`variables.build_outside_step`), before any
    replica reads them.
    """
    if model.distribute_strategy.num_replicas_in_sync < 2:
        return
    for name in ("_compile_loss", "_compile_metrics"):
        compiled = getattr(model, name, None)
        if compiled is not None and not compiled.built:
            variables.build_outside_step(compiled)


def has_targets(data_spec):
    """Returns whether a batch's spec (`x`, `(x,)`, `(x, y)`, `(x, y, sample_weight)`) has a `y`."""
    _, y, _ = ki.unpack_x_y_sample_weight(data_spec)
    return y is not None


@contextlib.contextmanager
def targets_deferred(model):
    """Hides the compiled loss and metrics from Keras' pre-build, which would build them from `y=None`.

    On one device Keras builds them only when `compute_loss` / `compute_metrics`
    is first called (a `train_step` of one's own on inputs only may never call
    them, or call them with targets it makes, an autoencoder's `y=x`); under a
    strategy its `_symbolic_build` calls both with the batch's `y`, and with none
    fails: 'None values not supported.' They build as on one device instead. The
    attributes are set past Keras' tracking (`object.__setattr__`), which keeps them.
    """
    hidden = {name: getattr(model, name, None) for name in ("_compile_loss", "_compile_metrics")}
    for name in hidden:
        object.__setattr__(model, name, None)
    try:
        yield
    finally:
        for name, value in hidden.items():
            object.__setattr__(model, name, value)


def _one_replica_spec(spec):
    """Returns the spec a model is built from: `None` for absent parts, one replica's for `PerReplicaSpec`."""
    if isinstance(spec, tf.OptionalSpec):
        return None
    if isinstance(spec, PerReplicaSpec):  # From a distributed dataset (e.g. a DatasetCreator).
        return spec._value_specs[0]
    return spec


def maybe_symbolic_build(model, iterator=None, data_batch=None):
    """Keras' own pre-build (takes a batch from `iterator`); kept for disabled fixes."""
    return ki.TensorFlowTrainer._maybe_symbolic_build(model, iterator=iterator, data_batch=data_batch)
