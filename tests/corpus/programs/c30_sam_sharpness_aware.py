"""Sharpness-aware minimization as public Keras ports write it (Sayak Paul's `SAMModel`, after davda54's SAM).

One-line change: `class SAMModel(keras.Model)` -> `class SAMModel(keras_dist.DistributedModel)`; the
wrapped classifier stays a plain `keras.Sequential`.
Covers: two forward/backward passes per step, the weights moved by hand along the first
gradient scaled by its global norm (`param.assign_add(e_w)`, then `assign_sub` back), the second
gradient applied with `optimizer.apply_gradients`, Keras 3's `self.compute_loss` (the tf.keras
original calls `self.compiled_loss`), `compute_metrics` for accuracy, a `test_step` of its own,
SGD with momentum, BatchNormalization (synchronized, see tests/corpus/README.md). Before keras-dist
summed `tape.gradient` over the replicas, each replica moved its weights along its own gradient's
norm and the second gradients were taken at different points. 90 examples at batch 32 (last
batch 26), 2 epochs.
"""

import keras
import numpy as np
import tensorflow as tf

CHANGE = "subclass"


def make_sam_model_class(Model):
    # keras_dist: class SAMModel(keras.Model) -> class SAMModel(keras_dist.DistributedModel) (`Model` is either)
    class SAMModel(Model):
        def __init__(self, inner_model, rho=0.05):
            super().__init__()
            self.inner_model = inner_model
            self.rho = rho

        def call(self, inputs, training=False):
            return self.inner_model(inputs, training=training)

        def train_step(self, data):
            (images, labels) = data
            e_ws = []
            with tf.GradientTape() as tape:
                predictions = self.inner_model(images, training=True)
                loss = self.compute_loss(y=labels, y_pred=predictions)
            trainable_params = self.inner_model.trainable_variables
            gradients = tape.gradient(loss, trainable_params)
            grad_norm = self._grad_norm(gradients)
            scale = self.rho / (grad_norm + 1e-12)

            for grad, param in zip(gradients, trainable_params):
                e_w = grad * scale
                param.assign_add(e_w)
                e_ws.append(e_w)

            with tf.GradientTape() as tape:
                predictions = self.inner_model(images, training=True)
                loss = self.compute_loss(y=labels, y_pred=predictions)

            sam_gradients = tape.gradient(loss, trainable_params)
            for param, e_w in zip(trainable_params, e_ws):
                param.assign_sub(e_w)

            self.optimizer.apply_gradients(zip(sam_gradients, trainable_params))

            return self.compute_metrics(images, labels, predictions)

        def test_step(self, data):
            (images, labels) = data
            predictions = self.inner_model(images, training=False)
            self.compute_loss(y=labels, y_pred=predictions)
            return self.compute_metrics(images, labels, predictions)

        def _grad_norm(self, gradients):
            norm = tf.norm(tf.stack([tf.norm(grad) for grad in gradients if grad is not None]))
            return norm

    return SAMModel


def data():
    rs = np.random.RandomState(30)
    x = rs.random((120, 8, 8, 1)).astype("float32")
    y = rs.randint(0, 4, size=(120,)).astype("int32")
    return (x[:90], y[:90]), (x[90:], y[90:])


def build(Model, distribute):
    SAMModel = make_sam_model_class(Model)
    inner = keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),  # keras.io: a ResNet-20
            keras.layers.BatchNormalization(synchronized=True),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(4),
        ]
    )
    model = SAMModel(inner)
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model(np.zeros((1, 8, 8, 1), "float32"))
    return model


def train(model, data):
    (x, y), (x_test, y_test) = data
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    return {
        "history": history.history,
        "evaluate": model.evaluate(x_test, y_test, batch_size=32, verbose=0, return_dict=True),
        "predict": model.predict(x_test, verbose=0),
    }
