"""Tabular regression with a `Normalization` layer adapted on the training features.

Style of keras.io's structured-data and "Training & evaluation with the built-in methods"
guides: `normalizer.adapt(x_train)` before the model is built, then a functional MLP.
One-line change: `keras.Model(inputs, outputs)` -> `keras_dist.DistributedModel(inputs, outputs)`.
Covers: Normalization.adapt (non-trainable mean/variance), SGD with momentum, mse + mae,
a metric function that returns one number per batch (the batch's largest error, as
tensorflow/tensorflow#39268 writes it; it crashed on 2 workers: labels straight from the
iterator have no device), 150 examples at batch 32 (last batch 22).
"""

import keras
import numpy as np
from keras import layers

CHANGE = "functional"


def max_abs_error(y_true, y_pred):
    """The batch's largest absolute error: one number per batch, not one per example."""
    return keras.ops.max(keras.ops.abs(y_true - y_pred))


def data():
    rs = np.random.RandomState(12)
    x = (rs.rand(200, 6) * [1, 10, 100, 0.1, 5, 50]).astype("float32")
    y = (x @ rs.randn(6, 1) * 0.05 + 1.0).astype("float32")
    return (x[:150], y[:150]), (x[150:], y[150:])


def build(Model, distribute):
    (x_train, _), _ = data()
    normalizer = layers.Normalization()
    normalizer.adapt(x_train)
    inputs = keras.Input(shape=(6,))
    x = normalizer(inputs)
    x = layers.Dense(16, activation="relu")(x)
    x = layers.Dense(16, activation="relu")(x)
    outputs = layers.Dense(1)(x)
    # keras_dist: keras.Model(...) -> keras_dist.DistributedModel(...) (`Model` is either)
    model = Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.01, momentum=0.9),
        loss="mean_squared_error",
        metrics=["mean_absolute_error", max_abs_error],
    )
    return model


def train(model, data):
    (x_train, y_train), (x_val, y_val) = data
    history = model.fit(x_train, y_train, batch_size=32, epochs=1, verbose=0)
    return {
        "history": history.history,
        "evaluate": model.evaluate(x_val, y_val, batch_size=32, verbose=0, return_dict=True),
        "predict": model.predict(x_val, batch_size=32, verbose=0),
    }
