"""Per-layer overrides of Keras layer hooks (BatchNormalization's `_moments`, Embedding's `call`)."""

import types

import keras
import tensorflow as tf
from tensorflow.python.distribute import values as tf_values
from tensorflow.python.ops import resource_variable_ops

from keras_dist._runtime import keras_internals as ki
from keras_dist._runtime import loss_terms, step_state

_GUARDED = "_keras_dist_empty_batch_guard"
_READS_ROWS = "_keras_dist_sparse_embedding_read"


def guard_empty_batch_moments(layer):
    """Makes a BatchNormalization layer keep its moving statistics on an empty batch.

    A replica whose share of a (last, partial) global batch is empty computes
    the mean and variance of zero examples: NaN, which then reaches the
    moving statistics (mean-aggregated over replicas) and, through the
    gradient, `gamma` and `beta`. On an empty batch the moments are replaced
    by the moving statistics, so that replica's update leaves them as they are.
    Overrides the instance's `_moments` only; idempotent.

    Args:
        layer: A `keras.layers.BatchNormalization`.

    Returns:
        Boolean, whether the layer was changed now (False if already guarded,
        or `synchronized=True`: its moments are the global batch's).
    """
    if getattr(layer, _GUARDED, False) or layer.synchronized:
        # A synchronized layer's moments are those of the global batch, empty only when the global batch is.
        return False
    moments = layer._moments

    def guarded_moments(inputs, mask):
        mean, variance = moments(inputs, mask)
        nonempty = tf.size(inputs) > 0
        mean = tf.where(nonempty, mean, tf.cast(tf.reshape(layer.moving_mean, tf.shape(mean)), mean.dtype))
        variance = tf.where(
            nonempty, variance, tf.cast(tf.reshape(layer.moving_variance, tf.shape(variance)), variance.dtype)
        )
        return mean, variance

    layer._moments = guarded_moments
    setattr(layer, _GUARDED, True)
    return True


def batch_normalization_layers(model):
    """Returns the `keras.layers.BatchNormalization` layers of `model`, nested ones included."""
    layers = model._flatten_layers(include_self=False)
    return [layer for layer in layers if isinstance(layer, keras.layers.BatchNormalization)]


def embedding_layers(model):
    """Returns the layers of `model`, nested ones included, that run Keras' own `keras.layers.Embedding.call`.

    A subclass with a `call` of its own (keras_hub's `ReversibleEmbedding`) is left out.
    """
    layers = model._flatten_layers(include_self=False)
    return [layer for layer in layers if type(layer).call is keras.layers.Embedding.call]


def read_embedding_rows(layer, is_enabled):
    """Makes an Embedding layer read only the rows it looks up (`ResourceGather`), not the whole table.

    Keras' `Embedding.call` (TensorFlow backend) is `ops.take(self.embeddings, ids)`:
    a dense read of the table, then `GatherV2`. Once an optimizer has applied an
    `IndexedSlices` gradient to the table (`ResourceScatterSub`), TensorFlow keeps
    the variable in copy-on-read mode, so every later dense read copies the whole
    table: about 50 ms a step for 1M x 64 float32, per replica. tf.keras 2 read the
    rows with `embedding_lookup` (`ResourceGather`). Here the instance's `call`
    reads them with `sparse_read` of the `tf.Variable` that Keras' dense read
    reads (under a `MirroredStrategy`, the replica's own copy), with Keras'
    casts and negative-id wrap: the same values, and the gradient stays
    `IndexedSlices`. Anything else runs Keras' own `call`: symbolic or stateless
    calls (Keras' build, `stateless_call`), ragged or sparse ids, LoRA,
    quantized tables, variables of other kinds (TPU, parameter servers), and
    calls while `is_enabled()` is false. Overrides the instance's `call` only;
    idempotent.

    Args:
        layer: A `keras.layers.Embedding` running Keras' own `call`.
        is_enabled: Callable returning whether to read rows, asked each time
            `call` is traced (the compat registry's switch).

    Returns:
        Boolean, whether the layer was changed now.
    """
    if getattr(layer, _READS_ROWS, False) or type(layer).call is not keras.layers.Embedding.call:
        return False

    def call(self, inputs):
        table = _rows_source(self, inputs) if is_enabled() else None
        if table is None:
            return type(self).call(self, inputs)  # Keras' own.
        if inputs.dtype != "int32" and inputs.dtype != "int64":
            inputs = tf.cast(inputs, "int32")
        # Keras' `ops.take` wraps negative ids ("fill" mode, as in JAX).
        ids = tf.where(inputs < 0, inputs + tf.cast(self._embeddings.shape[0], inputs.dtype), inputs)
        return tf.cast(table.sparse_read(ids), self.compute_dtype)

    # A bound method, so that a deep copy of the layer reads its own table.
    layer.call = types.MethodType(call, layer)
    setattr(layer, _READS_ROWS, True)
    return True


def _rows_source(layer, inputs):
    """The `tf.Variable` whose `sparse_read` reads what Keras' dense read of `layer`'s table would, or `None`."""
    if not isinstance(inputs, tf.Tensor) or ki.in_stateless_scope() or ki.in_symbolic_scope():
        return None
    if layer.quantization_mode is not None or getattr(layer, "lora_enabled", False):
        return None
    embeddings = getattr(layer, "_embeddings", None)
    variable = getattr(embeddings, "_value", None)
    if not isinstance(embeddings, keras.Variable) or variable is None:
        return None
    if type(variable) is tf_values.MirroredVariable:
        if variable._policy is not None or tf.distribute.in_cross_replica_context():
            return None
        variable = variable._get_on_device_or_primary()  # What MirroredVariable.value() reads.
    return variable if isinstance(variable, resource_variable_ops.BaseResourceVariable) else None


_ORIGINAL_DIRECT_ASSIGN = {}


def weighted_state_installed():
    """Installs `_weighted_direct_assign` as `keras.Variable._direct_assign` (idempotent).

    `keras.Variable` inherits the TensorFlow backend's `_direct_assign`, whose
    module moved in Keras 3.16 (`backend/tensorflow/core.py` to `ops/core.py`):
    the public class is patched, which every Keras 3 has.
    """
    if "assign" not in _ORIGINAL_DIRECT_ASSIGN:
        _ORIGINAL_DIRECT_ASSIGN["assign"] = keras.Variable._direct_assign
        keras.Variable._direct_assign = _weighted_direct_assign


def _weighted_direct_assign(self, value):
    """`variable.assign(value)`; for layer state averaged over the replicas, the average weighted by their examples.

    Non-trainable float layer state (a running mean a layer updates in
    `call`, BatchNormalization's moving statistics) is mirrored with
    aggregation "mean" (compat fix `mirrored_layer_state`): TensorFlow's
    assignment averages the replicas' values, each counting once. One device
    assigns the value computed from the global batch; for an update linear in
    a batch mean (`0.5 * state + 0.5 * ops.mean(x, 0)`) that is the replicas'
    values weighted by their examples, which equals the plain average only
    when every replica has as many (a new-user probe: a running mean 8.5e-2
    off on a last batch split 3/2). Inside a keras-dist step the value is
    weighted so: one all-reduce of `examples x value` and the examples (the
    one TensorFlow's averaging ran), then each replica writes the result into
    its own copy. A replica without examples counts 0 (its value may be
    NaN); where no replica has any, the state stays. A term of the value that
    is a sum over the replica's examples (`count.assign_add(ops.shape(x)[0])`,
    `total.assign_add(ops.sum(x, axis=0))`: keras.io's "making new layers"
    guide; `loss_terms.batch_sum_parts`) counts once per replica instead: one
    device adds the global batch's sum (a count was halved on 2 replicas).
    """
    step = step_state.current()
    if step is not None and step.global_results is not None:
        step.global_results.written(self)  # A metric's state changes: its summed state is read again.
    mirrored = getattr(self, "_value", None)
    if (
        step is None
        or step.num_examples is None
        or getattr(self, "aggregation", None) != "mean"
        or self.trainable
        or not isinstance(mirrored, tf_values.MirroredVariable)
        or tf.distribute.in_cross_replica_context()
        or not mirrored.dtype.is_floating
    ):
        return _ORIGINAL_DIRECT_ASSIGN["assign"](self, value)
    context = tf.distribute.get_replica_context()
    parts = loss_terms.batch_sum_parts(value, step, mirrored.dtype)
    value = tf.cast(value, mirrored.dtype)
    once = None
    if parts is not None:  # `count.assign_add(ops.shape(x)[0])`: the replicas' counts add up.
        once, value = parts
    examples = tf.cast(step.num_examples, mirrored.dtype)
    weighted = tf.where(examples > 0, value * examples, tf.zeros_like(value))
    pieces = [tf.reshape(weighted, [-1])] + ([tf.reshape(once, [-1])] if once is not None else [])
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.concat([*pieces, tf.reshape(examples, [1])], 0))
    total = summed[-1]
    size = tf.size(value)
    average = tf.reshape(summed[:size], tf.shape(value)) / tf.maximum(total, 1)
    if once is not None:
        average += tf.reshape(summed[size:-1], tf.shape(value))
    local = mirrored._get_on_device_or_primary()
    return local.assign(tf.where(total > 0, average, local.read_value()))
