"""Mixed precision (keras.io/guides/mixed_precision): the guide's MNIST model, on 64 features.

One-line change: `keras.Model(inputs=inputs, outputs=outputs)` -> `keras_dist.DistributedModel(inputs=inputs, outputs=outputs)`.
`keras.mixed_precision.set_global_policy("mixed_float16")` before the layers are built (the
caller restores "float32" afterwards), float16 compute with float32 variables, the softmax in
float32 as the guide says, and the loss-scale optimizer `compile` wraps around RMSprop.
Covers: mixed_float16, LossScaleOptimizer, sparse categorical crossentropy, accuracy;
100 examples of 64 features at batch 32 (last batch 4).
"""

import keras
import numpy as np
from keras import layers

CHANGE = "functional"
# float16 keeps 11 significant bits (relative spacing 9.8e-4): each replica's gradients are
# rounded to float16 for half the batch, one device's for the whole batch, and the float16
# logits move by one spacing (1e-3 at 1.0) for weight differences far below 1e-4. Measured:
# weights 6.5e-05, predict 1.6e-04 apart. So this program compares at 1e-3.
TOLERANCE = 1e-3


def data():
    rs = np.random.RandomState(13)
    x = rs.rand(130, 64).astype("float32")
    y = (x[:, :8].sum(1) > 4).astype("int64") + 2 * (x[:, 8:16].sum(1) > 4)
    return (x[:100], y[:100]), (x[100:], y[100:])


def build(Model, distribute):
    keras.mixed_precision.set_global_policy("mixed_float16")
    inputs = keras.Input(shape=(64,), name="digits")
    num_units = 32  # guide: 4096 on a GPU, 64 on a CPU
    dense1 = layers.Dense(num_units, activation="relu", name="dense_1")
    x = dense1(inputs)
    dense2 = layers.Dense(num_units, activation="relu", name="dense_2")
    x = dense2(x)
    # CORRECT: softmax and model output are float32
    x = layers.Dense(10, name="dense_logits")(x)
    outputs = layers.Activation("softmax", dtype="float32", name="predictions")(x)
    # keras_dist: keras.Model(...) -> keras_dist.DistributedModel(...) (`Model` is either)
    model = Model(inputs=inputs, outputs=outputs)
    model.compile(
        loss="sparse_categorical_crossentropy",
        optimizer=keras.optimizers.RMSprop(),
        metrics=["accuracy"],
    )
    return model


def train(model, data):
    (x_train, y_train), (x_test, y_test) = data
    history = model.fit(x_train, y_train, batch_size=32, epochs=1, verbose=0)
    test_scores = model.evaluate(x_test, y_test, verbose=0)
    return {"history": history.history, "evaluate": test_scores, "predict": model.predict(x_test, verbose=0)}
