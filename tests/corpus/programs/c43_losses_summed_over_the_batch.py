"""Compiled loss functions that sum over the batch: TensorFlow's global-batch scaling and a sum of squares.

The classification head's loss is TensorFlow's "Custom training with tf.distribute.Strategy"
guide's, moved into `compile`: `tf.nn.compute_average_loss(per_example_loss,
global_batch_size=GLOBAL_BATCH_SIZE)`, a sum over the batch divided by a constant. The
regression head's is a sum of squared errors, `ops.sum(ops.square(y_true - y_pred))`, as
many public scripts write `K.sum(K.square(...))`. One device's value of either is the global
batch's sum: each replica's sum was weighted by its share of the examples, and the
first-batch check warned (stop 54).
One-line change: `keras.Model(...)` -> `keras_dist.DistributedModel(...)`.
Covers: a two-output functional model with Conv2D, synchronized BatchNormalization and `loss_weights`;
metrics per output; SGD with momentum (Adam hides a scale common to the whole gradient: with
Adam the weights were 1e-5 off and only the logged losses half of one device's); 150 8x8
images at batch 64 (last batch 22: 11/11 on 2 replicas; the guide: Fashion-MNIST at 64 per
replica). Before the fix, on 2 replicas: weights 0.078 off, contrast_loss logged 89.3 vs 152.3.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import ops

CHANGE = "functional"
GLOBAL_BATCH_SIZE = 64


def classification_loss(labels, logits):
    per_example_loss = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    return tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)


def sum_squared_error(y_true, y_pred):
    return ops.sum(ops.square(y_true - y_pred))


def data():
    rs = np.random.RandomState(43)
    images = rs.rand(150, 8, 8, 1).astype("float32")
    brightness = images.mean(axis=(1, 2, 3))
    labels = np.digitize(brightness, np.quantile(brightness, [0.33, 0.66])).astype("int32")
    contrast = images.std(axis=(1, 2, 3))[:, None].astype("float32") * 10.0
    return images, labels, contrast


def build(Model, distribute):
    inputs = keras.Input(shape=(8, 8, 1))
    x = keras.layers.Conv2D(8, 3, activation="relu")(inputs)
    x = keras.layers.BatchNormalization(synchronized=True)(x)  # plain BN: per-replica statistics (README)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(16, activation="relu")(x)
    logits = keras.layers.Dense(3, name="label")(x)
    contrast = keras.layers.Dense(1, name="contrast")(x)
    model = Model(inputs, {"label": logits, "contrast": contrast})  # keras_dist: keras.Model -> DistributedModel
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.01, momentum=0.9),
        loss={"label": classification_loss, "contrast": sum_squared_error},
        loss_weights={"label": 1.0, "contrast": 0.01},
        metrics={"label": ["sparse_categorical_accuracy"], "contrast": ["mae"]},
    )
    return model


def train(model, data):
    images, labels, contrast = data
    history = model.fit(
        images, {"label": labels, "contrast": contrast}, batch_size=GLOBAL_BATCH_SIZE, epochs=2, verbose=0
    )
    return {
        "history": history.history,
        "evaluate": model.evaluate(
            images, {"label": labels, "contrast": contrast}, batch_size=GLOBAL_BATCH_SIZE, verbose=0, return_dict=True
        ),
        "predict": model.predict(images, batch_size=GLOBAL_BATCH_SIZE, verbose=0),
    }
