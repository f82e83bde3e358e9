"""Simple MNIST convnet (keras.io/examples/vision/mnist_convnet), on 8x8 digit-like images.

One-line change: `model = keras_dist.distribute(model)` after building the Sequential model.
For the comparison the Dropout rate is 0.0 (keras.io uses 0.5): each replica draws its own
dropout mask, as the examples of one batch do, so a rate > 0 cannot match one device.
Covers: Sequential, Conv2D/MaxPooling2D, Dropout, categorical crossentropy on one-hot labels,
`validation_split`, Adam, accuracy; 90 training examples at batch 32 (last batch 26).
"""

import keras
import numpy as np
from keras import layers

CHANGE = "distribute"
num_classes = 10
input_shape = (8, 8, 1)
DROPOUT_RATE = 0.0  # keras.io: 0.5


def data():
    rs = np.random.RandomState(0)
    x_train = rs.rand(100, 8, 8, 1).astype("float32")
    y_train = keras.utils.to_categorical(rs.randint(0, num_classes, 100), num_classes)
    x_test = rs.rand(30, 8, 8, 1).astype("float32")
    y_test = keras.utils.to_categorical(rs.randint(0, num_classes, 30), num_classes)
    return (x_train, y_train), (x_test, y_test)


def build(Model, distribute):
    model = keras.Sequential(
        [
            keras.Input(shape=input_shape),
            layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Conv2D(16, kernel_size=(2, 2), activation="relu"),
            layers.Flatten(),
            layers.Dropout(DROPOUT_RATE),
            layers.Dense(num_classes, activation="softmax"),
        ]
    )
    model = distribute(model)  # keras_dist: the one line a user adds (the identity on one device)
    model.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"])
    return model


def train(model, data):
    (x_train, y_train), (x_test, y_test) = data
    batch_size = 32
    epochs = 2
    history = model.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, validation_split=0.1, verbose=0)
    score = model.evaluate(x_test, y_test, verbose=0, return_dict=True)
    return {"history": history.history, "evaluate": score, "predict": model.predict(x_test, verbose=0)}
