"""Sample weights (keras.io/guides/training_with_built_in_methods, "Using sample weighting and class weighting").

The guide's `get_compiled_model()` (digits classifier, RMSprop, sparse categorical
crossentropy, sparse categorical accuracy), trained with a NumPy `sample_weight` that doubles
the weight of class 5, then evaluated with sample weights too.
One-line change: `keras.Model(inputs=inputs, outputs=outputs)` -> `keras_dist.DistributedModel(inputs=inputs, outputs=outputs)`.
Covers: `fit(..., sample_weight=...)`, `evaluate(..., sample_weight=...)`, `weighted_metrics`;
120 examples of 64 features at batch 32 (last batch 24).
"""

import keras
import numpy as np
from keras import layers

CHANGE = "functional"


def data():
    rs = np.random.RandomState(20)
    x = rs.rand(150, 64).astype("float32")
    y = np.argmax(x[:, :10] + 0.3 * rs.rand(150, 10), axis=1).astype("int64")
    return (x[:120], y[:120]), (x[120:], y[120:])


def get_uncompiled_model(Model):
    inputs = keras.Input(shape=(64,), name="digits")
    x = layers.Dense(32, activation="relu", name="dense_1")(inputs)
    x = layers.Dense(32, activation="relu", name="dense_2")(x)
    outputs = layers.Dense(10, activation="softmax", name="predictions")(x)
    # keras_dist: keras.Model(...) -> keras_dist.DistributedModel(...) (`Model` is either)
    model = Model(inputs=inputs, outputs=outputs)
    return model


def build(Model, distribute):
    model = get_uncompiled_model(Model)
    model.compile(
        optimizer="rmsprop",
        loss="sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
        weighted_metrics=["sparse_categorical_accuracy"],
    )
    return model


def train(model, data):
    (x_train, y_train), (x_test, y_test) = data
    sample_weight = np.ones(shape=(len(y_train),))
    sample_weight[y_train == 5] = 2.0
    history = model.fit(x_train, y_train, sample_weight=sample_weight, batch_size=32, epochs=1, verbose=0)
    test_weight = np.where(y_test == 5, 2.0, 1.0)
    return {
        "history": history.history,
        "evaluate": model.evaluate(x_test, y_test, sample_weight=test_weight, verbose=0, return_dict=True),
        "predict": model.predict(x_test, verbose=0),
    }
