"""Keras' TensorFlow convolutions, guarded against a replica's empty batch (compat fix `empty_batch_convolution`).

A last global batch with fewer examples than replicas leaves some replicas
with zero examples. TensorFlow's CPU convolution kernels mishandle a batch of
zero examples: with oneDNN (the x86 default) a convolution returns the
input's channel count on some CPUs, so the next layer fails ('input depth
must be evenly divisible by filter depth'), and the filter gradient of a
separable convolution is uninitialized memory (values like 1e24), which the
all-reduce adds to every replica's weights. One device never sees an empty
batch; what such a replica must contribute is an empty output and zero
gradients.

Here Keras' TensorFlow backend functions for convolutions
(`keras.src.backend.tensorflow.nn.conv` (`...tensorflow.ops.nn` from Keras 3.16), `depthwise_conv`, `separable_conv`,
`conv_transpose`) are wrapped: traced under a multi-replica strategy, an input
whose batch may be empty runs, when it is, the same op on one example of zeros
and keeps none of its rows (`tf.cond`), so the output has the right shape and
the gradients of the kernels are exactly zero. Everywhere else (one device, a
static non-zero batch) the op is Keras' own.
"""

import contextlib
import functools
import threading

import tensorflow as tf

from keras_dist._compat import locations

keras_tf_nn = locations.tensorflow_backend_nn_module()  # Moved in Keras 3.16 (keras_dist._compat.locations).

_GUARDED_OPS = ("conv", "depthwise_conv", "separable_conv", "conv_transpose")
_ORIGINALS = {}
_ENABLED = []  # The predicate `install` was given, read when an op is traced.
_XLA = threading.local()  # `compiling`: this thread traces a function XLA compiles (`compiled_by_xla`).


@contextlib.contextmanager
def compiled_by_xla():
    """While this thread traces a function XLA compiles, convolutions are Keras' own.

    XLA compiles each shape on its own, an empty batch included, and its CPU
    convolutions are not TensorFlow's kernels; and XLA cannot compile the
    guard's gradient (a `tf.cond` whose branches' row counts differ: a new-user
    probe's `jit_compile=True` convolution failed at its first step on any
    last batch shorter than the others, 'shape of dy was [16,4,4,4] instead
    of [0,4,4,4]').
    """
    previous = getattr(_XLA, "compiling", False)
    _XLA.compiling = True
    try:
        yield
    finally:
        _XLA.compiling = previous


def compiling_by_xla():
    """Whether this thread traces a function XLA compiles (`compiled_by_xla`)."""
    return getattr(_XLA, "compiling", False)


def install(is_enabled):
    """Wraps Keras' TensorFlow convolution functions (process-wide, once).

    Args:
        is_enabled: Callable returning whether the guard applies, read each
            time a convolution is traced (the compat registry's switch).

    Returns:
        Boolean, whether they were wrapped now.
    """
    _ENABLED[:] = [is_enabled]
    if _ORIGINALS:
        return False
    for name in _GUARDED_OPS:
        original = getattr(keras_tf_nn, name)
        _ORIGINALS[name] = original
        setattr(keras_tf_nn, name, _guarded(original))
    return True


def _may_see_empty_batches():
    """Whether the op is traced for a replica of a multi-replica strategy (where a replica's batch can be empty)."""
    return (
        bool(_ENABLED)
        and not compiling_by_xla()
        and _ENABLED[0]()
        and tf.distribute.has_strategy()
        and tf.distribute.get_strategy().num_replicas_in_sync > 1
    )


def _guarded(op):
    @functools.wraps(op)
    def guarded(inputs, *args, **kwargs):
        if not _may_see_empty_batches() or isinstance(inputs, tf.RaggedTensor):
            return op(inputs, *args, **kwargs)
        inputs = tf.convert_to_tensor(inputs)
        batch = inputs.shape[0]
        if batch is not None and batch > 0:
            return op(inputs, *args, **kwargs)

        def on_one_example_of_zeros():
            zeros = tf.zeros(tf.concat([[1], tf.shape(inputs)[1:]], axis=0), dtype=inputs.dtype)
            zeros = tf.ensure_shape(zeros, [1, *inputs.shape[1:]])
            return op(zeros, *args, **kwargs)[:0]

        if batch == 0:
            return on_one_example_of_zeros()
        return tf.cond(tf.shape(inputs)[0] > 0, lambda: op(inputs, *args, **kwargs), on_one_example_of_zeros)

    guarded.__wrapped_by_keras_dist__ = True
    return guarded
