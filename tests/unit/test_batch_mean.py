"""A loss a layer adds from statistics over the batch: named by the first-batch check, exact with `batch_mean`.

A new-user probe: keras.io's Switch Transformer load-balancing loss
(`mean(router_probs, 0) * mean(expert_mask, 0)`, added with `add_loss` in the
mixture-of-experts layer's `call`) trained 0.21 off one device on 2 replicas
and on 2 workers, without a warning: each replica computed the batch means
over its own examples. The first-batch check names such a layer; written with
`keras_dist.ops.batch_mean`, the model trains to one device's weights and logs
(here on 3 replicas with uneven parts, the last batch leaving one replica
without examples).
"""

import keras
import numpy as np
import pytest
from _support import SummedActivity
from keras import ops

import keras_dist
from keras_dist import errors
from keras_dist.testing import assert_matches_single_device

RS = np.random.RandomState(3)
X = RS.randn(34, 6).astype("float32")
Y = (X[:, :1] * 2.0 - X[:, 1:2]).astype("float32")


class Balance(keras.layers.Layer):
    """Adds a load-balancing loss over the batch's mean routing probabilities (a square of batch means)."""

    def __init__(self, mean, **kwargs):
        super().__init__(**kwargs)
        self.mean = mean

    def call(self, logits):
        probabilities = ops.softmax(logits)
        self.add_loss(ops.sum(ops.square(self.mean(probabilities))) * ops.cast(ops.shape(logits)[-1], "float32"))
        return logits


class PerExampleEntropy(keras.layers.Layer):
    """Adds the mean over the examples of a per-example value: what keras-dist's example shares combine exactly."""

    def call(self, logits):
        probabilities = ops.softmax(logits)
        self.add_loss(0.1 * ops.mean(ops.sum(probabilities * ops.log(probabilities + 1e-7), axis=-1)))
        return logits


def _local_mean(values):
    return ops.mean(values, axis=0)


def _model(cls, mean=_local_mean, **kwargs):
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(4)(inputs)
    hidden = PerExampleEntropy()(Balance(mean, name="balance")(hidden))
    model = cls(inputs, keras.layers.Dense(1)(hidden), **kwargs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def test_a_layer_adding_a_function_of_batch_means_is_named_with_the_fix(mirrored_1x2_cpu):
    model = _model(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu)
    with pytest.warns(errors.KerasDistWarning) as seen:
        model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    messages = [str(w.message) for w in seen if issubclass(w.category, errors.KerasDistWarning)]
    assert len(messages) == 1, messages  # Not the per-example entropy: its mean over the examples combines exactly.
    assert "The loss that layer 'balance' adds with `add_loss` couples the examples of a batch" in messages[0]
    assert "keras_dist.ops.batch_mean(values)" in messages[0]


def test_batch_mean_trains_to_one_devices_weights(mirrored_1x3_cpu):
    def build(cls, **kwargs):
        return _model(cls, keras_dist.ops.batch_mean, **kwargs)

    def train(model):
        history = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return {"history": history.history, "evaluate": model.evaluate(X, Y, batch_size=8, verbose=0)}

    assert_matches_single_device(
        build, strategy=mirrored_1x3_cpu, train=train, atol=1e-5, rtol=0.0, logs_atol=1e-7, logs_rtol=1e-5
    )


def test_batch_mean_is_the_mean_over_the_rows_outside_replica_context():
    values = np.arange(12, dtype="float32").reshape(4, 3)
    np.testing.assert_allclose(ops.convert_to_numpy(keras_dist.ops.batch_mean(values)), values.mean(axis=0))


def test_a_layer_adding_a_sum_over_the_batch_counts_it_as_a_sum(mirrored_1x3_cpu):
    """The check finds that the parts' values add up to the whole batch's: counted once per replica, as a sum.

    keras.io's guide: before, counted as a mean by the example shares, a third of one device's loss here
    (corpus c21 on 2 replicas: logged loss 11.07 against 20.29). No warning: it is exact now.
    """

    def build(cls, **kwargs):
        inputs = keras.Input((6,))
        outputs = keras.layers.Dense(1)(SummedActivity(name="summed")(keras.layers.Dense(4)(inputs)))
        model = cls(inputs, outputs, **kwargs)
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        return model

    def train(model):
        history = model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return {"history": history.history, "evaluate": model.evaluate(X, Y, batch_size=8, verbose=0)}

    assert_matches_single_device(
        build, strategy=mirrored_1x3_cpu, train=train, atol=1e-5, rtol=0.0, logs_atol=1e-7, logs_rtol=1e-5
    )
