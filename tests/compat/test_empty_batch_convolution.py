"""A replica without examples gets an empty output and zero gradients from every convolution."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from keras_dist import _compat
from keras_dist.testing import assert_matches_single_device

pytestmark = pytest.mark.compat


def _separable_model(strategy):
    inputs = keras.Input((4, 4, 2))
    hidden = keras.layers.SeparableConv2D(3, 2)(inputs)
    return keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(hidden)), strategy=strategy)


def _replica_gradients(model, strategy, trials):
    """Per trial: replica 1's output shape and kernel gradients, for a global batch of 1 (replica 1 gets none)."""
    x = tf.ones((1, 4, 4, 2))
    batches = strategy.experimental_distribute_values_from_function(
        lambda context: x if context.replica_id_in_sync_group == 0 else x[:0]
    )

    @tf.function
    def step(batch):
        def replica(batch):
            with tf.GradientTape() as tape:
                y = model(batch, training=True)
                loss = tf.reduce_sum(y)
            return tf.shape(y), tape.gradient(loss, model.trainable_variables)

        return strategy.run(replica, args=(batch,))

    results = []
    for _ in range(trials):
        shapes, gradients = step(batches)
        results.append(
            (
                strategy.experimental_local_results(shapes)[1].numpy().tolist(),
                [strategy.experimental_local_results(g)[1].numpy() for g in gradients],
            )
        )
    return results


def test_without_fix_an_empty_replica_gets_garbage_gradients_or_fails(mirrored_1x2_cpu):
    """TensorFlow's filter gradient over 0 examples is uninitialized memory, or (TF 2.18-2.23 on this CI's CPUs) missing.

    Where it is missing the step fails: 'Missing 1-th output from ... Conv2DBackpropFilter'.
    """
    with _compat.disabled("empty_batch_convolution"):
        model = _separable_model(mirrored_1x2_cpu)
        try:
            results = _replica_gradients(model, mirrored_1x2_cpu, trials=10)
        except tf.errors.InternalError as error:
            assert "Conv2DBackpropFilter" in str(error)
            return
    assert any(any(np.any(g != 0) for g in gradients) for _, gradients in results)  # Nonzero in most trials.


def test_with_fix_an_empty_replica_gets_an_empty_output_and_zero_gradients(mirrored_1x2_cpu):
    model = _separable_model(mirrored_1x2_cpu)
    for shape, gradients in _replica_gradients(model, mirrored_1x2_cpu, trials=10):
        assert shape == [0, 1]
        for gradient in gradients:
            np.testing.assert_array_equal(gradient, np.zeros_like(gradient))


def test_with_fix_a_static_batch_runs_keras_own_op(mirrored_1x2_cpu):
    """Where no batch can be empty (a static batch), or off the strategy, no `tf.cond` is added."""
    model = _separable_model(mirrored_1x2_cpu)

    def graph_ops(shape, strategy):
        with strategy.scope():
            graph = tf.function(lambda x: model(x)).get_concrete_function(tf.TensorSpec(shape, tf.float32)).graph
        return {op.type for op in graph.get_operations()}

    assert "If" in graph_ops((None, 4, 4, 2), mirrored_1x2_cpu) or "StatelessIf" in graph_ops(
        (None, 4, 4, 2), mirrored_1x2_cpu
    )
    assert not {"If", "StatelessIf"} & graph_ops((2, 4, 4, 2), mirrored_1x2_cpu)
    assert not {"If", "StatelessIf"} & graph_ops((None, 4, 4, 2), tf.distribute.get_strategy())


@pytest.mark.parametrize("layer", [keras.layers.Conv2D, keras.layers.SeparableConv2D], ids=["conv", "separable"])
def test_with_fix_xla_compiles_convolutions_on_a_short_last_batch(mirrored_1x3_cpu, layer):
    """A new-user probe: under `jit_compile=True` the guard's `tf.cond` failed XLA at the first step of any fit
    whose last batch was shorter ('shape of dy was [16,4,4,4] instead of [0,4,4,4]'). XLA compiles the step
    without the guard (its convolutions are not TensorFlow's kernels): 34 examples in batches of 16 on 3
    replicas leave one replica of the last batch empty, and the weights are one device's.
    """
    rs = np.random.RandomState(4)
    x = rs.randn(34, 6, 6, 2).astype("float32")
    y = x[:, 0, 0, :1]

    def build(cls, **kwargs):
        inputs = keras.Input((6, 6, 2))
        outputs = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling2D()(layer(4, 3)(inputs)))
        model = cls(inputs, outputs, **kwargs)
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
        return model

    def train(model):
        return {"history": model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history}

    assert_matches_single_device(build, strategy=mirrored_1x3_cpu, train=train, atol=1e-5, rtol=0.0, logs_rtol=1e-5)
