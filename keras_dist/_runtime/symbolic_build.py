"""Keras' pre-build of model, metric and optimizer state (`Trainer._symbolic_build`), for a model under a strategy.

From a batch's element spec (one replica's spec of a distributed dataset, no
batch taken from the iterator), on ragged or sparse placeholders where the
inputs are ragged or sparse, or, for a model without `call` (a GAN that trains
through its own `train_step`), what can be built without tracing.
"""

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


def symbolic_build_from_spec(model, element_spec, *, composite_inputs=False):
    """Builds model, metric and optimizer state from a batch's element spec.

    Args:
        model: The `keras.Model`.
        element_spec: Nested `tf.TypeSpec` structure of one global batch.
        composite_inputs: Boolean, trace `call` on ragged/sparse placeholders where
            the inputs are ragged/sparse (`build_context.build_from_composite_spec`)
            instead of Keras' dense ones.
    """
    spec = tf.nest.map_structure(_one_replica_spec, element_spec, expand_composites=False)
    if composite_inputs and build_context.has_composite_inputs(spec):
        return build_context.build_from_composite_spec(model, spec)
    model._symbolic_build(data_batch=spec)


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
