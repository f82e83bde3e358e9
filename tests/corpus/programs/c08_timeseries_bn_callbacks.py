"""Timeseries classification from scratch (keras.io/examples/timeseries/timeseries_classification_from_scratch).

One-line change: `keras.models.Model(inputs=input_layer, outputs=output_layer)` ->
`keras_dist.DistributedModel(inputs=input_layer, outputs=output_layer)`.
BatchNormalization is `synchronized=True` (keras-dist's README: plain BatchNormalization
normalizes with each replica's half of the batch, by design), and the Conv1D layers before
it have `use_bias=False`: keras.io's biases there have a true gradient of zero (the
normalization cancels them), so what they get is rounding noise, which Adam divides by its
own root mean square into steps of +-learning_rate; one device and 2 replicas round
differently and these biases alone differed by 1.8e-4 after 20 steps.
Callbacks as keras.io gives them, with patience scaled to a few epochs: ModelCheckpoint
(`save_best_only`, into a temporary folder), ReduceLROnPlateau(patience=1) and
EarlyStopping(patience=2) on `val_loss`, both with `min_delta=0.01` so that they act here (the
validation loss improves by about 0.002 an epoch): the learning rate halves after the second
epoch and training stops after the third of 4; then the best model is loaded back and evaluated, as
keras.io does. Covers: Conv1D, BatchNormalization moving statistics, GlobalAveragePooling1D,
`validation_split`, the `learning_rate` history entry, early stopping, `load_model`;
90 series at batch 16 with validation_split=0.2 (72 training series: last batch 8), 32
test series.
"""

import os
import tempfile

import keras
import numpy as np

CHANGE = "functional"
num_classes = 2


def data():
    rs = np.random.RandomState(8)
    t = np.linspace(0, 1, 24)
    y = rs.randint(0, num_classes, 130)
    x = np.sin(2 * np.pi * (3 + 2 * y[:, None]) * t) + 0.8 * rs.randn(130, 24)
    x = x.reshape((x.shape[0], x.shape[1], 1)).astype("float32")
    return (x[:90], y[:90]), (x[90:122], y[90:122])


def build(Model, distribute):
    input_layer = keras.layers.Input((24, 1))

    conv1 = keras.layers.Conv1D(filters=8, kernel_size=3, padding="same", use_bias=False)(input_layer)
    conv1 = keras.layers.BatchNormalization(synchronized=True)(conv1)
    conv1 = keras.layers.ReLU()(conv1)

    conv2 = keras.layers.Conv1D(filters=8, kernel_size=3, padding="same", use_bias=False)(conv1)
    conv2 = keras.layers.BatchNormalization(synchronized=True)(conv2)
    conv2 = keras.layers.ReLU()(conv2)

    conv3 = keras.layers.Conv1D(filters=8, kernel_size=3, padding="same", use_bias=False)(conv2)
    conv3 = keras.layers.BatchNormalization(synchronized=True)(conv3)
    conv3 = keras.layers.ReLU()(conv3)

    gap = keras.layers.GlobalAveragePooling1D()(conv3)

    output_layer = keras.layers.Dense(num_classes, activation="softmax")(gap)

    # keras_dist: keras.Model(...) -> keras_dist.DistributedModel(...) (`Model` is either)
    model = Model(inputs=input_layer, outputs=output_layer)
    model.compile(
        optimizer="adam",
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
    )
    return model


def train(model, data):
    (x_train, y_train), (x_test, y_test) = data
    epochs = 4  # keras.io: 500
    batch_size = 16  # keras.io: 32
    folder = tempfile.mkdtemp(prefix="corpus_c08_")
    callbacks = [
        keras.callbacks.ModelCheckpoint(
            os.path.join(folder, "best_model.keras"), save_best_only=True, monitor="val_loss"
        ),
        keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1, min_lr=0.0001, min_delta=0.01),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, verbose=0, min_delta=0.01),
    ]
    history = model.fit(
        x_train,
        y_train,
        batch_size=batch_size,
        epochs=epochs,
        callbacks=callbacks,
        validation_split=0.2,
        verbose=0,
    )
    best = keras.models.load_model(os.path.join(folder, "best_model.keras"))
    test_loss, test_acc = best.evaluate(x_test, y_test, verbose=0)
    return {
        "history": history.history,
        "evaluate": {"loss": test_loss, "sparse_categorical_accuracy": test_acc},
        "predict": best.predict(x_test, verbose=0),
    }
