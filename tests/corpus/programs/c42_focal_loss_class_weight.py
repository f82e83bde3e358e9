"""Imbalanced classification with a hand-written focal loss and class weights as sample weights.

Follows keras.io/examples/structured_data/imbalanced_classification (weights from the class
counts, Precision/Recall, Adam(1e-2)) with the binary focal loss as public scripts write it, a
function returning one number (`ops.mean` inside), and a second head, 3 kinds of transaction,
trained with such a function of `sparse_categorical_crossentropy`. Keras multiplies the number
by the batch mean of the sample weights: each replica used its own batch's mean (stop 53).
One-line change: `keras.Model(...)` -> `keras_dist.DistributedModel(...)`.
Covers: a two-output functional model with `loss_weights`; the class weights as per-output
`sample_weight` (a dict: Keras takes `class_weight` for one output only) in `fit` and
`evaluate`; `weighted_metrics`; 149 transactions at batch 32 (last batch 21: 11/10 on 2
replicas; keras.io: 2048).
"""

import keras
import numpy as np
from keras import ops

CHANGE = "functional"


def binary_focal_loss(y_true, y_pred, gamma=2.0, alpha=0.25):
    y_pred = ops.clip(y_pred, 1e-7, 1.0 - 1e-7)
    p_t = y_true * y_pred + (1.0 - y_true) * (1.0 - y_pred)
    alpha_t = y_true * alpha + (1.0 - y_true) * (1.0 - alpha)
    return ops.mean(-alpha_t * ops.power(1.0 - p_t, gamma) * ops.log(p_t))


def categorical_scalar_loss(y_true, y_pred):
    return ops.mean(keras.losses.sparse_categorical_crossentropy(y_true, y_pred))


def data():
    rs = np.random.RandomState(42)
    n = 149
    features = rs.randn(n, 12).astype("float32") * 3 + 1
    fraud = (features[:, 0] + 0.5 * features[:, 1] > 6).astype("float32")[:, None]
    kind = np.digitize(features[:, 2], [-1.0, 3.0]).astype("int32")[:, None]  # 3 classes
    features = (features - features.mean(axis=0)) / features.std(axis=0)
    return features, fraud, kind


def build(Model, distribute):
    inputs = keras.Input(shape=(12,), name="transactions")
    hidden = keras.layers.Dense(32, activation="relu")(inputs)  # keras.io: 256
    hidden = keras.layers.Dense(32, activation="relu")(hidden)
    fraud = keras.layers.Dense(1, activation="sigmoid", name="fraud")(hidden)
    kind = keras.layers.Dense(3, activation="softmax", name="kind")(hidden)
    model = Model(inputs, {"fraud": fraud, "kind": kind})  # keras_dist: keras.Model -> DistributedModel
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss={"fraud": binary_focal_loss, "kind": categorical_scalar_loss},
        loss_weights={"fraud": 1.0, "kind": 0.5},
        metrics={"fraud": [keras.metrics.Precision(name="precision"), keras.metrics.Recall(name="recall")]},
        weighted_metrics={"kind": ["accuracy"]},
    )
    return model


def train(model, data):
    features, fraud, kind = data
    counts = np.bincount(fraud[:, 0].astype("int64"))
    class_weight = {0: 1.0 / counts[0] * len(fraud) / 2.0, 1: 1.0 / counts[1] * len(fraud) / 2.0}
    fraud_weights = np.where(fraud[:, 0] > 0, class_weight[1], class_weight[0]).astype("float32")
    kind_weights = np.array([1.0, 2.0, 0.5], "float32")[kind[:, 0]]
    history = model.fit(
        features,
        {"fraud": fraud, "kind": kind},
        sample_weight={"fraud": fraud_weights, "kind": kind_weights},
        batch_size=32,
        epochs=2,
        verbose=0,
    )
    return {
        "history": history.history,
        "evaluate": model.evaluate(
            features,
            {"fraud": fraud, "kind": kind},
            sample_weight={"fraud": fraud_weights, "kind": kind_weights},
            batch_size=32,
            verbose=0,
            return_dict=True,
        ),
        "predict": model.predict(features, batch_size=32, verbose=0),
    }
