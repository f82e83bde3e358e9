"""Keras' TensorFlow step functions with keras-dist's distribution fixes threaded in.

`DistributedModel` calls these from its `train_step`, step-function factories
and build hook. They use Keras' private trainer attributes, which is why they
live in `_runtime`.
"""

import warnings

import tensorflow as tf
from keras import tree

from tensorflow.python.distribute.values import PerReplicaSpec

from keras_dist._runtime import keras_internals as ki


def train_step(model, data, *, replica_loss_weight):
    """Runs Keras' TensorFlow `train_step` with a per-replica loss weight.

    Identical to `keras.Model.train_step` on the TensorFlow backend (3.15), except
    that the loss is multiplied by `replica_loss_weight(num_examples)` after the
    loss tracker is updated and before gradients are taken.

    Args:
        model: The `keras.Model` being trained.
        data: One per-replica batch: `x`, `(x, y)` or `(x, y, sample_weight)`.
        replica_loss_weight: Callable taking this replica's example count (int32
            scalar tensor) and returning a float scalar multiplier.

    Returns:
        Dict of metric results, as `model.compute_metrics` returns them.

    Distributed behavior:
        Runs in replica context. `replica_loss_weight` may be a collective; every
        replica calls it once per step.
    """
    x, y, sample_weight = ki.unpack_x_y_sample_weight(data)
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
        loss = model._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        num_examples = batch_size_of(x)
        model._loss_tracker.update_state(
            ki.unscale_loss_for_distribution(loss), sample_weight=num_examples
        )
        loss = loss * tf.cast(replica_loss_weight(num_examples), loss.dtype)
        if model.optimizer is not None:
            loss = model.optimizer.scale_loss(loss)
    if model.trainable_weights:
        trainable_weights = model.trainable_weights
        gradients = tape.gradient(loss, trainable_weights)
        model.optimizer.apply_gradients(zip(gradients, trainable_weights))
    else:
        warnings.warn("The model does not have any trainable weights.")
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def batch_size_of(x):
    """Returns the leading dimension of the first non-`None` leaf of `x` (int32 scalar)."""
    return tf.shape(next(leaf for leaf in tree.flatten(x) if leaf is not None))[0]


def make_step_function(model, replica_step, *, add_replica_axis=False):
    """Builds the function `fit`/`evaluate` call per execution, from a replica step.

    Uses Keras' own factory (`TensorFlowTrainer._make_function`): the
    `steps_per_execution` loop, `tf.function` compilation and output reduction
    stay Keras'.

    Args:
        model: The `keras.Model`.
        replica_step: Callable run in replica context on one per-replica batch,
            returning a structure of tensors.
        add_replica_axis: Boolean. Under `MultiWorkerMirroredStrategy` Keras
            reduces each output with `strategy.reduce("MEAN", value, axis=0)`;
            a leading axis of size 1 makes that the mean over replicas.
    """
    if add_replica_axis:
        step = replica_step

        def replica_step(data):
            return tree.map_structure(_with_replica_axis, step(data))

    return ki.TensorFlowTrainer._make_function(model, replica_step)


def _with_replica_axis(value):
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return tf.expand_dims(value, 0)
    return value


def symbolic_build_from_spec(model, element_spec):
    """Builds model, metric and optimizer state from a batch's element spec.

    Args:
        model: The `keras.Model`.
        element_spec: Nested `tf.TensorSpec` structure of one global batch.
    """
    spec = tf.nest.map_structure(_one_replica_spec, element_spec, expand_composites=False)
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
