"""Semantic segmentation scored with `MeanIoU` (keras.io/examples/vision/deeplabv3_plus and keras.io/api/metrics/segmentation_metrics).

A small fully convolutional network (Conv2D, BatchNormalization with `synchronized=True` as
keras-dist's README asks, a 1x1 classifier per pixel)
on 3-class masks, compiled with sparse categorical crossentropy from logits and
`keras.metrics.MeanIoU(num_classes=3, sparse_y_pred=False)`, then evaluated and used to predict.
One-line change: `keras.Model(inputs, outputs)` -> `keras_dist.DistributedModel(inputs, outputs)`.
Covers: a metric whose state is int64 (MeanIoU's confusion matrix) next to float32 ones (the
loss tracker): on 2 workers the metrics' state was summed in one pack, which cannot hold two
dtypes, and the first step crashed (found by a new-user probe); synchronized BatchNormalization; 60 images of
8x8 at batch 16 (last batch 12).
"""

import keras
import numpy as np
from keras import layers

CHANGE = "functional"


def data():
    rs = np.random.RandomState(27)
    x = rs.rand(76, 8, 8, 3).astype("float32")
    y = np.argmax(x + 0.2 * rs.rand(76, 8, 8, 3), axis=-1).astype("int64")  # a class per pixel
    return (x[:60], y[:60]), (x[60:], y[60:])


def build(Model, distribute):
    inputs = keras.Input(shape=(8, 8, 3))
    x = layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
    x = layers.BatchNormalization(synchronized=True)(x)
    x = layers.Activation("relu")(x)
    outputs = layers.Conv2D(3, 1, padding="same")(x)
    # keras_dist: keras.Model(...) -> keras_dist.DistributedModel(...) (`Model` is either)
    model = Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.MeanIoU(num_classes=3, sparse_y_pred=False, name="mean_iou")],
    )
    return model


def train(model, data):
    (x_train, y_train), (x_test, y_test) = data
    history = model.fit(x_train, y_train, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return {
        "history": history.history,
        "evaluate": model.evaluate(x_test, y_test, batch_size=16, verbose=0, return_dict=True),
        "predict": model.predict(x_test, batch_size=16, verbose=0),
    }
