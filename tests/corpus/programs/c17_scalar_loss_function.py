"""A loss function of one's own that returns one scalar, as public bug reports and tutorials write it.

`def custom_loss(y_true, y_pred): return tf.reduce_mean(tf.square(y_true - y_pred))` (no
`axis`: the mean over the whole batch, not one value per example), with an extra scalar
penalty term, given to `compile(loss=custom_loss)`. One-line change: `keras.Model(inputs, outputs)` -> `keras_dist.DistributedModel(inputs, outputs)`.
Covers: a scalar-returning loss function, SGD with momentum and an `ExponentialDecay` schedule
(not Adam: Adam divides a gradient scaled by a constant by its own scale, hiding it),
110 examples at batch 32 (last batch 14).
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers

CHANGE = "functional"


def custom_loss(y_true, y_pred):
    mse = tf.reduce_mean(tf.square(y_true - y_pred))
    penalty = 0.1 * tf.reduce_mean(tf.abs(y_pred))
    return mse + penalty


def data():
    rs = np.random.RandomState(17)
    x = rs.randn(150, 5).astype("float32")
    y = (np.sin(x[:, :1]) + 0.5 * x[:, 1:2] ** 2).astype("float32")
    return (x[:110], y[:110]), (x[110:], y[110:])


def build(Model, distribute):
    inputs = keras.Input(shape=(5,))
    x = layers.Dense(16, activation="tanh")(inputs)
    outputs = layers.Dense(1)(x)
    # keras_dist: keras.Model(...) -> keras_dist.DistributedModel(...) (`Model` is either)
    model = Model(inputs, outputs)
    lr_schedule = keras.optimizers.schedules.ExponentialDecay(initial_learning_rate=1e-2, decay_steps=4, decay_rate=0.9)
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=lr_schedule, momentum=0.9), loss=custom_loss, metrics=["mae"]
    )
    return model


def train(model, data):
    (x, y), (x_val, y_val) = data
    history = model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    return {
        "history": history.history,
        "evaluate": model.evaluate(x_val, y_val, batch_size=32, verbose=0, return_dict=True),
        "predict": model.predict(x_val, verbose=0),
    }
