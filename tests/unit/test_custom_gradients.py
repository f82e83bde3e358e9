"""A custom gradient of one's own in a compiled model: its upstream gradient is one device's (a new-user probe).

Under several replicas keras-dist's one-collective step lets each replica differentiate its
own mean loss and weights the gradients by the examples inside the all-reduce. The upstream
gradient a custom gradient function receives is then `global examples / examples` times one
device's: harmless for a linear function, wrong for one that clips it (the probe: weights 0.64
relative off, with and without XLA). A model with a custom gradient written outside TensorFlow
and Keras takes the step that weights each replica's loss before the backward pass.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers, ops

from keras_dist._runtime import steps
from keras_dist.testing import assert_matches_single_device


@ops.custom_gradient
def _clip_upstream(x):
    """The identity forward; backward, the upstream gradient clipped to +-0.01 (a "gradient clipping layer")."""

    def grad(*args, upstream=None):
        upstream = args[0] if upstream is None else upstream
        return ops.clip(upstream, -0.01, 0.01)

    return x, grad


class ClipUpstream(layers.Layer):
    def call(self, x):
        return _clip_upstream(x)


def _data():
    rs = np.random.RandomState(4)
    x = rs.randn(96, 4).astype("float32")
    return x, (x @ rs.randn(4, 1)).astype("float32")


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_a_custom_gradient_that_clips_the_upstream_gradient_matches_one_device(mirrored_1x2_cpu, jit_compile):
    x, y = _data()

    def build(cls, **kwargs):
        inputs = keras.Input((4,))
        outputs = layers.Dense(1)(ClipUpstream()(layers.Dense(8)(inputs)))
        model = cls(inputs, outputs, **kwargs)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit_compile)
        return model

    def train(model):
        return model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)

    assert_matches_single_device(
        build, strategy=mirrored_1x2_cpu, train=train, atol=1e-5, rtol=0.0, logs_atol=1e-6, logs_rtol=1e-5
    )


def _found_in(forward):
    found = {}

    @tf.function
    def traced(x):
        with steps.observing_custom_gradients() as names:
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = forward(x)
        found["names"] = names
        return tape.gradient(tf.reduce_sum(y), x)

    traced(tf.ones([2, 3]))
    return found["names"]


def test_only_custom_gradients_written_outside_tensorflow_and_keras_are_found():
    assert len(_found_in(_clip_upstream)) == 1
    assert _found_in(keras.activations.silu) == []  # tf.nn.silu: TensorFlow's own custom gradient.
    assert _found_in(tf.recompute_grad(lambda x: tf.sin(x) * 2.0)) == []
    assert _found_in(lambda x: tf.nn.relu(x) * 3.0) == []
