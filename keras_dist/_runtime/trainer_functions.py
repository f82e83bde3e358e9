"""The functions `fit`/`evaluate`/`predict` call per execution, made by Keras' own factory.

Keras' `TensorFlowTrainer._make_function` keeps the `steps_per_execution` loop,
`tf.function` compilation and output reduction; under several workers the
outputs get a replica axis (Keras reduces them with `axis=0`), or, when every
replica returns the same values, are taken from the first local replica.
"""

import functools

import numpy as np
import tensorflow as tf
from keras import tree
from tensorflow.python.distribute import values as distribute_values

from keras_dist._compat import locations
from keras_dist._runtime import keras_internals as ki


def make_step_function(model, replica_step, *, add_replica_axis=False, synchronized_outputs=False):
    """Builds the function `fit`/`evaluate` call per execution, from a replica step.

    Uses Keras' own factory (`TensorFlowTrainer._make_function`): the
    `steps_per_execution` loop, `tf.function` compilation and output reduction
    stay Keras', except under several workers with `synchronized_outputs`.

    Args:
        model: The `keras.Model`.
        replica_step: Callable run in replica context on one per-replica batch,
            returning a structure of tensors.
        add_replica_axis: Boolean. Under `MultiWorkerMirroredStrategy` Keras
            reduces each output with `strategy.reduce("MEAN", value, axis=0)`;
            a leading axis of size 1 makes that the mean over replicas.
        synchronized_outputs: Boolean, `replica_step` returns the same values
            on every replica of every worker (keras-dist's own steps: metric
            results from state summed over all replicas). With
            `add_replica_axis` and `steps_per_execution == 1` (always the case
            under several workers), the outputs are then taken from this
            worker's first replica: Keras' reduction would cost two
            collectives per output per step, for the values already there.
    """
    if add_replica_axis and synchronized_outputs and model.steps_per_execution == 1:
        return _first_replica_step_function(model, replica_step)
    if add_replica_axis:
        step = replica_step

        def replica_step(data):
            return tree.map_structure(_with_replica_axis, step(data))

    return ki.TensorFlowTrainer._make_function(model, replica_step)


def _first_replica_step_function(model, replica_step):
    """Keras' `_make_function` for `steps_per_execution == 1` (3.15), with the outputs of the first local replica."""
    strategy = model.distribute_strategy

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        outputs = strategy.run(replica_step, args=(data,))
        return tree.map_structure(lambda value: strategy.experimental_local_results(value)[0], outputs)

    if not model.run_eagerly:
        one_step_on_data = tf.function(one_step_on_data, reduce_retracing=True, jit_compile=model.jit_compile)
    one_step_on_data = locations.autoconvert_optionals(model, one_step_on_data)  # None on Keras 3.10.

    @tf.autograph.experimental.do_not_convert
    def one_step_on_iterator(iterator):
        return tf.experimental.Optional.from_value(one_step_on_data(iterator.get_next()))

    if not model.run_eagerly:
        one_step_on_iterator = tf.function(one_step_on_iterator, reduce_retracing=True)

    def function(iterator):
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            optional_outputs = one_step_on_iterator(iterator)
            if not optional_outputs.has_value():
                raise StopIteration
            return optional_outputs.get_value()
        for data in iterator:  # Keras' `zip(range(steps_per_execution), iterator)` with 1 step.
            return one_step_on_data(data)

    return function


def _with_replica_axis(value):
    """`value` with a leading axis of size 1; Python and NumPy numbers too (TFRS' `sum(self.losses)` is the int 0)."""
    if isinstance(value, (tf.Tensor, tf.Variable, int, float, np.number, np.ndarray)):
        return tf.expand_dims(tf.convert_to_tensor(value), 0)
    return value


def predict_for_any_batch(function):
    """Returns Keras' predict function (a `tf.function`) traced first for batches of any size on each replica.

    Keras' `predict` hands the function each batch as values, not an iterator,
    so its first trace fixes each replica's batch size: one device's is the
    global batch's, a replica's is its share, which can be 0 or 1 row where one
    device has several. Keras' TensorFlow ops then take paths one device never
    takes: `ops.add` of two `(0, k)` tensors (a residual `Add`, an `LSTM`
    cell) chooses `tf.nn.bias_add` and fails ("Shape must be rank 1 but is
    rank 2"; a new-user probe, `model.predict(x[:1])` on 2 replicas). Traced
    first with each replica's batch dimension unknown, later batches of any
    size reuse that trace. A model whose trace needs static batch sizes (the
    first trace fails) is traced per call, as Keras does.

    Args:
        function: `model.predict_function` as Keras' factory set it (a
            `tf.function` taking a list of batches of `PerReplica` values),
            or anything else, returned as it is (`None`, an eager function,
            one already wrapped).

    Returns:
        A callable with `function`'s signature; `__wrapped__` is `function`.
    """
    if not isinstance(function, tf.types.experimental.PolymorphicFunction) or getattr(function, _ANY_BATCH, False):
        return function
    traced = []

    @functools.wraps(function)
    def predict(data):
        if not traced:
            traced.append(True)
            try:
                function.get_concrete_function(tf.nest.map_structure(_any_batch_spec, data))
            except Exception:  # noqa: BLE001  A model that needs static batch sizes: traced per call, as before.
                pass
        return function(data)

    setattr(predict, _ANY_BATCH, True)
    return predict


_ANY_BATCH = "_keras_dist_any_batch"


def _any_batch_spec(value):
    """`value`'s type spec (a tensor's, or a `PerReplica`'s) with each tensor's leading dimension unknown."""
    if not (tf.is_tensor(value) or isinstance(value, tf.__internal__.CompositeTensor)):
        return value  # `None`, a Python value: a constant of the trace, as in Keras' own call.
    spec = tf.type_spec_from_value(value)

    def unknown_rows(component):
        if isinstance(component, tf.TensorSpec) and component.shape.rank:
            return tf.TensorSpec([None, *component.shape[1:]], component.dtype, component.name)
        return component

    if isinstance(spec, distribute_values.PerReplicaSpec):
        return distribute_values.PerReplicaSpec(*(unknown_rows(c) for c in spec._value_specs))
    return unknown_rows(spec)
