"""Customizing what happens in `fit()` (keras.io/guides/custom_train_step_in_tensorflow), first example.

One-line change: `class CustomModel(keras.Model)` -> `class CustomModel(keras_dist.DistributedModel)`,
built functionally as the guide does: `CustomModel(inputs, outputs)`.
Covers: `self.compute_loss(y=y, y_pred=y_pred)`, `tape.gradient`, `self.optimizer.apply`,
the compiled loss tracker and metrics updated by hand through `self.metrics`, Adam, mse +
mae; 100 examples at the default batch size 32 (last batch 4).
"""

import keras
import numpy as np
import tensorflow as tf

CHANGE = "subclass"


def make_custom_model_class(Model):
    # keras_dist: class ...(keras.Model) -> class ...(keras_dist.DistributedModel) (`Model` is either)
    class CustomModel(Model):
        def train_step(self, data):
            # Unpack the data. Its structure depends on your model and
            # on what you pass to `fit()`.
            x, y = data

            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)  # Forward pass
                # Compute the loss value
                # (the loss function is configured in `compile()`)
                loss = self.compute_loss(y=y, y_pred=y_pred)

            # Compute gradients
            trainable_vars = self.trainable_variables
            gradients = tape.gradient(loss, trainable_vars)

            # Update weights
            self.optimizer.apply(gradients, trainable_vars)

            # Update metrics (includes the metric that tracks the loss)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)

            # Return a dict mapping metric names to current value
            return {m.name: m.result() for m in self.metrics}

    return CustomModel


def data():
    rs = np.random.RandomState(15)
    x = rs.random((130, 32)).astype("float32")
    y = rs.random((130, 1)).astype("float32")
    return (x[:100], y[:100]), (x[100:], y[100:])


def build(Model, distribute):
    CustomModel = make_custom_model_class(Model)
    # Construct and compile an instance of CustomModel
    inputs = keras.Input(shape=(32,))
    outputs = keras.layers.Dense(1)(inputs)
    model = CustomModel(inputs, outputs)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    return model


def train(model, data):
    (x, y), (x_test, y_test) = data
    # Just use `fit` as usual
    history = model.fit(x, y, epochs=1, verbose=0)
    return {
        "history": history.history,
        "evaluate": model.evaluate(x_test, y_test, verbose=0, return_dict=True),
        "predict": model.predict(x_test, verbose=0),
    }
