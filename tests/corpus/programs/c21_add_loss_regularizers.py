"""`add_loss` and weight regularizers (keras.io/guides/training_with_built_in_methods, "Handling losses and metrics that don't fit the standard signature").

The guide's `ActivityRegularizationLayer` (`self.add_loss(ops.sum(inputs) * 0.1)`, a loss that
depends on the batch's activations) between two Dense layers, plus an L2 `kernel_regularizer`
and an L1 `activity_regularizer` on Dense layers (losses on the weights and on activations).
One-line change: `keras.Model(inputs=inputs, outputs=outputs)` -> `keras_dist.DistributedModel(inputs=inputs, outputs=outputs)`.
Covers: add_loss, kernel and activity regularizers, from-logits sparse categorical
crossentropy, SGD with Nesterov momentum; 90 examples at batch 32 (last batch 26).
"""

import keras
import numpy as np
from keras import layers, ops

CHANGE = "functional"


class ActivityRegularizationLayer(layers.Layer):
    def call(self, inputs):
        self.add_loss(ops.sum(inputs) * 0.1)
        return inputs  # Pass-through layer.


def data():
    rs = np.random.RandomState(21)
    x = rs.rand(120, 16).astype("float32")
    y = np.argmax(x[:, :4], axis=1).astype("int64")
    return (x[:90], y[:90]), (x[90:], y[90:])


def build(Model, distribute):
    inputs = keras.Input(shape=(16,), name="digits")
    x = layers.Dense(16, activation="relu", name="dense_1")(inputs)
    # Insert activity regularization as a layer
    x = ActivityRegularizationLayer()(x)
    x = layers.Dense(
        16,
        activation="relu",
        name="dense_2",
        kernel_regularizer=keras.regularizers.l2(1e-3),
        activity_regularizer=keras.regularizers.l1(1e-4),
    )(x)
    outputs = layers.Dense(4, name="predictions")(x)
    # keras_dist: keras.Model(...) -> keras_dist.DistributedModel(...) (`Model` is either)
    model = Model(inputs=inputs, outputs=outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=1e-3, momentum=0.9, nesterov=True),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def train(model, data):
    (x_train, y_train), (x_test, y_test) = data
    # The displayed loss will be much higher than before
    # due to the regularization component.
    history = model.fit(x_train, y_train, batch_size=32, epochs=1, verbose=0)
    return {
        "history": history.history,
        "evaluate": model.evaluate(x_test, y_test, batch_size=32, verbose=0, return_dict=True),
        "predict": model.predict(x_test, batch_size=32, verbose=0),
    }
