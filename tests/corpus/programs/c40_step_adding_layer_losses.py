"""Two keras.io guides together: "Making new layers and models via subclassing" and "Customizing what happens in `fit()`".

One-line change: `class CustomModel(keras.Model)` -> `class CustomModel(keras_dist.DistributedModel)`.
The first guide's `ActivityRegularizationLayer` adds `1e-2 * ops.sum(inputs)` with `add_loss` (a
sum over the batch); the guide's training loop adds `sum(model.losses)` to the loss, which a new
user writes into the second guide's `train_step` as `loss + ops.sum(self.losses)`. Before, the
sum over the batch counted by each replica's share of the examples in a step of one's own (1.9e-2
off one device in the weights on 2 replicas). A Dense with `kernel_regularizer` adds the other
kind of `self.losses` (a weight penalty, not over the batch), and the step also logs the mean
absolute error with a `keras.metrics.MeanAbsoluteError` object.
Dense regression, SGD with momentum; 70 examples at batch 16 (last batch 6), 2 epochs, `evaluate`.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import ops

CHANGE = "subclass"


class ActivityRegularizationLayer(keras.layers.Layer):
    def __init__(self, rate=1e-2):
        super().__init__()
        self.rate = rate

    def call(self, inputs):
        self.add_loss(self.rate * ops.sum(inputs))
        return inputs


def make_custom_model_class(Model):
    # keras_dist: class CustomModel(keras.Model) -> class CustomModel(keras_dist.DistributedModel)
    class CustomModel(Model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = keras.losses.mean_squared_error(y, y_pred)
                loss = ops.mean(loss) + ops.sum(self.losses)
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
            self.loss_tracker.update_state(loss)
            self.mae_metric.update_state(y, y_pred)
            return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

        def test_step(self, data):
            x, y = data
            y_pred = self(x, training=False)
            self.loss_tracker.update_state(ops.mean(keras.losses.mean_squared_error(y, y_pred)))
            self.mae_metric.update_state(y, y_pred)
            return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

        @property
        def metrics(self):
            return [self.loss_tracker, self.mae_metric]

    return CustomModel


def data():
    rs = np.random.RandomState(40)
    x = rs.rand(90, 6).astype("float32")
    y = (x @ rs.randn(6, 1) + 0.3).astype("float32")
    return (x[:70], y[:70]), (x[70:], y[70:])


def build(Model, distribute):
    CustomModel = make_custom_model_class(Model)
    inputs = keras.Input(shape=(6,))
    hidden = keras.layers.Dense(8, activation="relu", kernel_regularizer=keras.regularizers.l2(1e-3))(inputs)
    hidden = ActivityRegularizationLayer()(hidden)
    outputs = keras.layers.Dense(1)(hidden)
    model = CustomModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.02, momentum=0.9))
    return model


def train(model, data):
    (x, y), (x_test, y_test) = data
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    return {
        "history": history.history,
        "evaluate": model.evaluate(x_test, y_test, batch_size=16, verbose=0, return_dict=True),
        "predict": model.predict(x_test, batch_size=16, verbose=0),
    }
