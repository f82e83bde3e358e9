"""Customizing `fit()`, "going lower-level" and "providing your own evaluation step" (same guide).

One-line change: `class CustomModel(keras.Model)` -> `class CustomModel(keras_dist.DistributedModel)`,
built functionally: `CustomModel(inputs, outputs)`.
Covers: `compile(optimizer=...)` only, a loss object of one's own (`self.loss_fn`, mean over the
replica's batch), `self.optimizer.apply`, a `Mean` loss tracker and a MeanAbsoluteError of one's
own listed in the `metrics` property, an overridden `test_step` for `evaluate`, SGD with
momentum; 100 examples at batch 32 (last batch 4).
"""

import keras
import numpy as np
import tensorflow as tf

CHANGE = "subclass"


def make_custom_model_class(Model):
    # keras_dist: class ...(keras.Model) -> class ...(keras_dist.DistributedModel) (`Model` is either)
    class CustomModel(Model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
            self.loss_fn = keras.losses.MeanSquaredError()

        def train_step(self, data):
            x, y = data

            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)  # Forward pass
                # Compute our own loss
                loss = self.loss_fn(y, y_pred)

            # Compute gradients
            trainable_vars = self.trainable_variables
            gradients = tape.gradient(loss, trainable_vars)

            # Update weights
            self.optimizer.apply(gradients, trainable_vars)

            # Compute our own metrics
            self.loss_tracker.update_state(loss)
            self.mae_metric.update_state(y, y_pred)
            return {
                "loss": self.loss_tracker.result(),
                "mae": self.mae_metric.result(),
            }

        def test_step(self, data):
            # Unpack the data
            x, y = data
            # Compute predictions
            y_pred = self(x, training=False)
            # Updates the metrics tracking the loss
            loss = self.loss_fn(y, y_pred)
            self.loss_tracker.update_state(loss)
            self.mae_metric.update_state(y, y_pred)
            # Return a dict mapping metric names to current value.
            return {m.name: m.result() for m in self.metrics}

        @property
        def metrics(self):
            # We list our `Metric` objects here so that `reset_states()` can be
            # called automatically at the start of each epoch
            # or at the start of `evaluate()`.
            return [self.loss_tracker, self.mae_metric]

    return CustomModel


def data():
    rs = np.random.RandomState(16)
    x = rs.random((130, 32)).astype("float32")
    y = rs.random((130, 1)).astype("float32")
    return (x[:100], y[:100]), (x[100:], y[100:])


def build(Model, distribute):
    CustomModel = make_custom_model_class(Model)
    # Construct an instance of CustomModel
    inputs = keras.Input(shape=(32,))
    outputs = keras.layers.Dense(1)(inputs)
    model = CustomModel(inputs, outputs)
    # We don't pass a loss or metrics here.
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9))
    return model


def train(model, data):
    (x, y), (x_test, y_test) = data
    # Just use `fit` as usual -- you can use callbacks, etc.
    history = model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    return {
        "history": history.history,
        "evaluate": model.evaluate(x_test, y_test, batch_size=32, verbose=0, return_dict=True),
        "predict": model.predict(x_test, verbose=0),
    }
