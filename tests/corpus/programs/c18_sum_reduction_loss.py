"""A `keras.losses.Loss` subclass of one's own with `reduction="sum"` (guide: training & evaluation).

The guide's `CustomMSE(keras.losses.Loss)` (mse plus a regularization term, one value per
example), constructed with `reduction="sum"` so the batch loss is the sum over examples, as
users do to weight every example equally across batch sizes.
One-line change: `keras.Model(inputs, outputs)` -> `keras_dist.DistributedModel(inputs, outputs)`.
Covers: sum reduction, a Loss subclass with `get_config`, SGD with momentum (and a small rate,
as the sum scales the gradient), mae metric, 70 examples at batch 16 (last batch 6).
"""

import keras
import numpy as np
from keras import layers, ops

CHANGE = "functional"


class CustomMSE(keras.losses.Loss):
    def __init__(self, regularization_factor=0.1, name="custom_mse", reduction="sum_over_batch_size"):
        super().__init__(name=name, reduction=reduction)
        self.regularization_factor = regularization_factor

    def call(self, y_true, y_pred):
        mse = ops.mean(ops.square(y_true - y_pred), axis=-1)
        reg = ops.mean(ops.square(0.5 - y_pred), axis=-1)
        return mse + reg * self.regularization_factor

    def get_config(self):
        return {"regularization_factor": self.regularization_factor, "name": self.name, "reduction": self.reduction}


def data():
    rs = np.random.RandomState(18)
    x = rs.rand(100, 4).astype("float32")
    y = np.concatenate([x[:, :1] * x[:, 1:2], x[:, 2:3] - x[:, 3:]], axis=1).astype("float32")
    return (x[:70], y[:70]), (x[70:], y[70:])


def build(Model, distribute):
    inputs = keras.Input(shape=(4,))
    x = layers.Dense(8, activation="relu")(inputs)
    outputs = layers.Dense(2)(x)
    # keras_dist: keras.Model(...) -> keras_dist.DistributedModel(...) (`Model` is either)
    model = Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.005, momentum=0.9),
        loss=CustomMSE(reduction="sum"),
        metrics=["mae"],
    )
    return model


def train(model, data):
    (x, y), (x_test, y_test) = data
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return {
        "history": history.history,
        "evaluate": model.evaluate(x_test, y_test, batch_size=16, verbose=0, return_dict=True),
        "predict": model.predict(x_test, verbose=0),
    }
