"""MixUp done in the model's own `train_step`, which then hands the mixed batch to `super().train_step`.

One-line change: `class MixUpModel(keras.Model)` -> `class MixUpModel(keras_dist.DistributedModel)`,
built functionally: `MixUpModel(inputs, outputs)`.
Covers: keras.io's "MixUp augmentation for image classification" (two zipped copies of the data, a
mixing weight per example) moved from the `tf.data` map into `train_step`, as public scripts write
it: the step makes the model's inputs itself, so the batches hold a tuple of two image batches and
the weights, not what the model takes. Then the compiled step (`super().train_step`): a small CNN
with BatchNormalization (`synchronized=True`, as keras-dist's README asks), categorical cross-
entropy on mixed one-hot labels, accuracy, Adam, and `evaluate` on plain images. Under a strategy
Keras pre-builds the model by calling it on the batch's inputs, which failed before training
('expects 1 named input(s) ... but it received 3 input tensors'); one device builds in the first
step. The convolution has no bias, as before a BatchNormalization: a bias the loss cannot see moves
with rounding noise under Adam. The weights come with the data (keras.io draws them from a Beta
distribution), so the run is deterministic. 90 examples at batch 16 (last batch 10), 2 epochs.
"""

import keras
import numpy as np

CHANGE = "subclass"


def make_mixup_model_class(Model):
    # keras_dist: class ...(keras.Model) -> class ...(keras_dist.DistributedModel) (`Model` is either)
    class MixUpModel(Model):
        def train_step(self, data):
            (images_one, images_two, weights), (labels_one, labels_two) = data
            images = weights[:, None, None, None] * images_one + (1 - weights[:, None, None, None]) * images_two
            labels = weights[:, None] * labels_one + (1 - weights[:, None]) * labels_two
            return super().train_step((images, labels))

    return MixUpModel


def data():
    rs = np.random.RandomState(33)
    images = rs.rand(90, 8, 8, 1).astype("float32")
    classes = (images[:, :4].mean(axis=(1, 2, 3)) > images[:, 4:].mean(axis=(1, 2, 3))).astype("int32")
    labels = np.eye(2, dtype="float32")[classes]
    partner = rs.permutation(90)  # keras.io zips two shuffled copies of the training set
    weights = rs.beta(0.2, 0.2, size=90).astype("float32")
    return images, labels, partner, weights


def build(Model, distribute):
    MixUpModel = make_mixup_model_class(Model)
    inputs = keras.Input(shape=(8, 8, 1))
    hidden = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(inputs)
    hidden = keras.layers.BatchNormalization(synchronized=True)(hidden)
    hidden = keras.layers.Activation("relu")(hidden)
    hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    outputs = keras.layers.Dense(2, activation="softmax")(hidden)
    model = MixUpModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="categorical_crossentropy", metrics=["accuracy"])
    return model


def train(model, data):
    images, labels, partner, weights = data
    x = (images, images[partner], weights)
    y = (labels, labels[partner])
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    evaluation = model.evaluate(images, labels, batch_size=16, verbose=0, return_dict=True)
    return {"history": history.history, "evaluate": evaluation, "predict": model.predict(images[:10], verbose=0)}
