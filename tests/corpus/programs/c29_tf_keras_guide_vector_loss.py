"""Customizing `fit()`, "going lower-level", as the tf.keras 2 guide wrote it (still widely copied).

One-line change: `class CustomModel(keras.Model)` -> `class CustomModel(keras_dist.DistributedModel)`,
built functionally: `CustomModel(inputs, outputs)`.
Covers: a loss that is one value per example (`keras.losses.mean_squared_error(y, y_pred)`, shape
`(batch,)`, which `tape.gradient` differentiates as its sum; on 2 replicas and 2 workers it trained
on about half of one device's gradient, weights 0.18 off with SGD), trackers at module level listed
in the `metrics` property and updated with that vector, `optimizer.apply_gradients`, SGD (the guide's Adam
hides a gradient's scale); 97 examples at batch 32, 3 epochs (last batch 1: on 2 replicas one
has no examples).
"""

import keras
import numpy as np
import tensorflow as tf

CHANGE = "subclass"


def make_custom_model_class(Model):
    loss_tracker = keras.metrics.Mean(name="loss")
    mae_metric = keras.metrics.MeanAbsoluteError(name="mae")

    # keras_dist: class ...(keras.Model) -> class ...(keras_dist.DistributedModel) (`Model` is either)
    class CustomModel(Model):
        def train_step(self, data):
            x, y = data

            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)  # Forward pass
                # Compute our own loss
                loss = keras.losses.mean_squared_error(y, y_pred)

            # Compute gradients
            trainable_vars = self.trainable_variables
            gradients = tape.gradient(loss, trainable_vars)

            # Update weights
            self.optimizer.apply_gradients(zip(gradients, trainable_vars))

            # Compute our own metrics
            loss_tracker.update_state(loss)
            mae_metric.update_state(y, y_pred)
            return {"loss": loss_tracker.result(), "mae": mae_metric.result()}

        @property
        def metrics(self):
            # We list our `Metric` objects here so that `reset_states()` can be
            # called automatically at the start of each epoch
            # or at the start of `evaluate()`.
            return [loss_tracker, mae_metric]

    return CustomModel


def data():
    rs = np.random.RandomState(29)
    x = rs.random((97, 32)).astype("float32")
    y = rs.random((97, 1)).astype("float32")
    return x, y


def build(Model, distribute):
    CustomModel = make_custom_model_class(Model)
    inputs = keras.Input(shape=(32,))
    outputs = keras.layers.Dense(1)(inputs)
    model = CustomModel(inputs, outputs)
    # We don't pass a loss or metrics here. (keras.io: "adam"; SGD shows the gradient's scale.)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.002))
    return model


def train(model, data):
    x, y = data
    # Just use `fit` as usual
    history = model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    return {"history": history.history, "predict": model.predict(x[:10], verbose=0)}
