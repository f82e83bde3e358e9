"""A replica that gets no examples (a last batch smaller than the replica count) computes what one device would.

Every convolution and pooling family, with BatchNormalization and metrics, a residual block and an LSTM,
trained on data whose last batch leaves a replica empty (9 examples, batch 4,
on 2 and 3 replicas; a global batch of 1), against plain Keras on one device
from the same weights: weights within 1e-5, the same logs. BatchNormalization
is `synchronized=True` here: a replica's own batch statistics differ from one
device's by design (an empty replica's stay finite: tests/compat/test_empty_replica_batch_norm.py).
"""

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist.testing import max_weight_difference

L = keras.layers


class _ResidualDense(L.Layer):
    """`x + Dense(x)` through Keras' `Add` (a residual block of an MLP or a transformer)."""

    def build(self, input_shape):
        self.dense = L.Dense(input_shape[-1], activation="relu")
        self.add = L.Add()

    def call(self, inputs):
        return self.add([inputs, self.dense(inputs)])


_FAMILIES = {
    # Keras' `ops.add` of two `(0, k)` tensors took them for a bias (`tf.nn.bias_add`) when traced with 0 rows.
    "residual": ((8,), lambda: [_ResidualDense()]),
    "lstm": ((5, 3), lambda: [L.LSTM(4)]),
    "Conv1D": ((6, 2), lambda: [L.Conv1D(3, 2, activation="relu"), L.Conv1D(2, 2, padding="same")]),
    "Conv2D": ((4, 4, 2), lambda: [L.Conv2D(4, 3, padding="same", activation="relu"), L.Conv2D(3, 1)]),
    "Conv3D": ((3, 3, 3, 1), lambda: [L.Conv3D(2, 2)]),
    "SeparableConv1D": ((6, 2), lambda: [L.SeparableConv1D(3, 2)]),
    "SeparableConv2D": ((4, 4, 2), lambda: [L.SeparableConv2D(3, 2), L.SeparableConv2D(2, 1)]),
    "DepthwiseConv1D": ((6, 2), lambda: [L.DepthwiseConv1D(2)]),
    "DepthwiseConv2D": ((4, 4, 2), lambda: [L.DepthwiseConv2D(2, depth_multiplier=2)]),
    "Conv1DTranspose": ((4, 2), lambda: [L.Conv1DTranspose(3, 2)]),
    "Conv2DTranspose": ((3, 3, 2), lambda: [L.Conv2DTranspose(3, 2, strides=2)]),
    "Conv3DTranspose": ((2, 2, 2, 1), lambda: [L.Conv3DTranspose(2, 2)]),
    "pooling": ((4, 4, 2), lambda: [L.Conv2D(3, 1), L.MaxPooling2D(2), L.AveragePooling2D(1), L.UpSampling2D()]),
    "pooling_1d_3d": (
        (4, 2, 2, 2),
        lambda: [L.MaxPooling3D(2, padding="same"), L.Reshape((2, 2)), L.AveragePooling1D(1)],
    ),
    "global_pooling": ((6, 2), lambda: [L.Conv1D(3, 2), L.GlobalMaxPooling1D()]),
    "conv_batch_norm": (
        (4, 4, 2),
        lambda: [L.Conv2D(3, 1), L.BatchNormalization(synchronized=True), L.ReLU(), L.GlobalAveragePooling2D()],
    ),
}


def _model(cls, kwargs, shape, layers):
    inputs = keras.Input(shape)
    hidden = inputs
    for layer in layers:
        hidden = layer(hidden)
    if len(hidden.shape) > 2:
        hidden = L.Flatten()(hidden)
    model = cls(inputs, L.Dense(3)(hidden), **kwargs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _compare(strategy, family, *, num_examples=9, batch_size=4, epochs=2):
    shape, make_layers = _FAMILIES[family]
    rs = np.random.RandomState(0)
    x = rs.rand(num_examples, *shape).astype("float32")
    y = rs.randint(0, 3, num_examples)
    keras.utils.set_random_seed(3)
    reference = _model(keras.Model, {}, shape, make_layers())
    model = _model(keras_dist.DistributedModel, {"strategy": strategy}, shape, make_layers())
    model.set_weights(reference.get_weights())
    fitted = [
        m.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0).history for m in (reference, model)
    ]
    evaluated = [m.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True) for m in (reference, model)]
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    assert max_weight_difference(reference, model) < 1e-5
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(fitted[1][name], fitted[0][name], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(evaluated[1][name], evaluated[0][name], rtol=1e-5, atol=1e-6)
    predicted = [m.predict(x, batch_size=batch_size, verbose=0) for m in (reference, model)]
    np.testing.assert_allclose(predicted[1], predicted[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_last_batch_leaves_a_replica_empty(mirrored_1x2_cpu, family):
    _compare(mirrored_1x2_cpu, family)


@pytest.mark.parametrize("family", ["Conv2D", "SeparableConv2D", "conv_batch_norm"])
def test_last_batch_leaves_two_of_three_replicas_empty(mirrored_1x3_cpu, family):
    _compare(mirrored_1x3_cpu, family)


@pytest.mark.parametrize("family", ["Conv2D", "SeparableConv2D", "conv_batch_norm", "residual", "lstm"])
def test_global_batch_of_one(mirrored_1x2_cpu, family):
    """`residual`, `lstm`: a new-user probe's `model.predict(x[:1])` failed ("Shape must be rank 1 but is rank 2").

    Keras' `predict` traces its function for the first batch's values: a replica's share of 0 rows was static.
    """
    _compare(mirrored_1x2_cpu, family, num_examples=3, batch_size=1)


def test_sixty_five_examples_in_batches_of_sixty_four(mirrored_1x2_cpu):
    """The reported case: a conv classifier whose last batch holds one example."""
    _compare(mirrored_1x2_cpu, "Conv2D", num_examples=65, batch_size=64, epochs=1)
