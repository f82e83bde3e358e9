"""N replicas must give the numbers of one device on the same global batches.

Reference: a plain `keras.Model` with the same starting weights, data and batch
order, trained on the default strategy (one device).
"""

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist.testing import max_weight_difference

TOL = 1e-5


def _data(num_examples, seed=0):
    rs = np.random.RandomState(seed + num_examples)
    x = rs.rand(num_examples, 3).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.3 + 0.1 * rs.randn(num_examples, 1)).astype("float32")
    return x, y


def _layers():
    return [
        keras.layers.Dense(4, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(seed=1)),
        keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2)),
    ]


class SubclassedMLP(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden, self.out = _layers()

    def call(self, x):
        return self.out(self.hidden(x))


class DistributedSubclassedMLP(keras_dist.DistributedModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden, self.out = _layers()

    def call(self, x):
        return self.out(self.hidden(x))


def _functional(cls, **kwargs):
    inputs = keras.Input((3,))
    hidden, out = _layers()
    return cls(inputs, out(hidden(inputs)), **kwargs)


def _make_pair(style, strategy):
    """Returns (reference keras.Model, DistributedModel) with identical starting weights."""
    if style == "functional":
        reference = _functional(keras.Model)
        model = _functional(keras_dist.DistributedModel, strategy=strategy)
    elif style == "subclassed":
        reference = SubclassedMLP()
        model = DistributedSubclassedMLP(strategy=strategy)
        reference(np.zeros((1, 3), "float32"))
        model(np.zeros((1, 3), "float32"))  # Built outside any scope: must be re-homed.
    else:  # wrapped: an existing, already-built plain model
        existing = SubclassedMLP()
        existing(np.zeros((1, 3), "float32"))
        model = keras_dist.distribute(existing, strategy=strategy)
        reference = SubclassedMLP()
        reference(np.zeros((1, 3), "float32"))
        reference.set_weights(existing.get_weights())
    model.set_weights(reference.get_weights())
    for m in (reference, model):
        m.compile(
            optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
            loss="mse",
            metrics=["mae", keras.metrics.RootMeanSquaredError(name="rmse")],
        )
    return reference, model


CASES = [
    # (style, num_examples, global batch): uneven last batches (7/4 -> 3, 33/8 -> 1,
    # 37/8 -> 5), a first batch smaller than the global batch (3/8).
    ("functional", 7, 4),
    ("functional", 33, 8),
    ("functional", 37, 8),
    ("functional", 3, 8),
    ("subclassed", 7, 4),
    ("subclassed", 37, 8),
    ("subclassed", 3, 8),
    ("wrapped", 33, 8),
    ("wrapped", 3, 8),
]


@pytest.mark.parametrize("style,num_examples,batch_size", CASES)
def test_fit_evaluate_predict_match_single_device(style, num_examples, batch_size, both_replica_counts):
    x, y = _data(num_examples)
    reference, model = _make_pair(style, both_replica_counts)
    fit = dict(batch_size=batch_size, epochs=2, shuffle=False, verbose=0, validation_data=(x[:5], y[:5]))

    history_ref = reference.fit(x, y, **fit).history
    history = model.fit(x, y, **fit).history

    assert max_weight_difference(reference, model) < TOL
    assert history.keys() == history_ref.keys()
    for key in history_ref:
        np.testing.assert_allclose(history[key], history_ref[key], rtol=1e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(
        model.evaluate(x, y, batch_size=batch_size, verbose=0),
        reference.evaluate(x, y, batch_size=batch_size, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )
    predictions = model.predict(x, batch_size=batch_size, verbose=0)
    assert predictions.shape == (num_examples, 1)
    np.testing.assert_allclose(predictions, reference.predict(x, batch_size=batch_size, verbose=0), atol=1e-5)


def test_every_variable_is_mirrored(mirrored_1x2_cpu):
    x, y = _data(16)
    _, model = _make_pair("functional", mirrored_1x2_cpu)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    owned = [*model.weights, *model.metrics_variables, *model.optimizer.variables]
    kinds = {type(v.value).__name__ for v in owned}
    assert kinds <= {"MirroredVariable", "SyncOnReadVariable"}, kinds
    assert all(v.value._distribute_strategy is mirrored_1x2_cpu for v in owned)


def test_regularization_loss_counted_once(both_replica_counts):
    """Layer losses are the same on every replica and must enter the gradient once."""
    x, y = _data(7)

    def build(cls, **kwargs):
        inputs = keras.Input((3,))
        layer = keras.layers.Dense(1, kernel_initializer="ones", kernel_regularizer=keras.regularizers.L2(0.5))
        model = cls(inputs, layer(inputs), **kwargs)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    reference = build(keras.Model)
    model = build(keras_dist.DistributedModel, strategy=both_replica_counts)
    history_ref = reference.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
    assert max_weight_difference(reference, model) < TOL
    np.testing.assert_allclose(history["loss"], history_ref["loss"], rtol=1e-5)


def test_sample_weights_and_dataset_input(mirrored_1x3_cpu):
    import tensorflow as tf

    x, y = _data(19)
    weights = np.linspace(0.1, 2.0, 19).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(6)
    reference, model = _make_pair("functional", mirrored_1x3_cpu)
    reference.fit(ds, epochs=2, verbose=0)
    model.fit(ds, epochs=2, verbose=0)
    assert max_weight_difference(reference, model) < TOL
    np.testing.assert_allclose(model.evaluate(ds, verbose=0), reference.evaluate(ds, verbose=0), rtol=1e-5)
