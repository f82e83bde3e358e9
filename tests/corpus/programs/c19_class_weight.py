"""Imbalanced classification: credit card fraud (keras.io/examples/structured_data/imbalanced_classification).

One-line change: `model = keras_dist.distribute(model)` after building the Sequential model.
Dropout rate 0.0 for the comparison (keras.io: 0.3).
Covers: features normalized with NumPy mean/std, `class_weight` computed from the class
counts, FalseNegatives/FalsePositives/TrueNegatives/TruePositives/Precision/Recall metrics,
Adam(1e-2), binary crossentropy; 150 transactions at batch 64 (last
batch 22; keras.io: 2048).
"""

import keras
import numpy as np

CHANGE = "distribute"
DROPOUT_RATE = 0.0  # keras.io: 0.3


def data():
    rs = np.random.RandomState(19)
    n = 200
    features = rs.randn(n, 12).astype("float32") * 3 + 1
    targets = (features[:, 0] + 0.5 * features[:, 1] > 6).astype("float32")[:, None]
    num_val_samples = 50
    train_features, val_features = features[:-num_val_samples], features[-num_val_samples:]
    train_targets, val_targets = targets[:-num_val_samples], targets[-num_val_samples:]
    mean = np.mean(train_features, axis=0)
    train_features -= mean
    val_features -= mean
    std = np.std(train_features, axis=0)
    train_features /= std
    val_features /= std
    return (train_features, train_targets), (val_features, val_targets)


def build(Model, distribute):
    model = keras.Sequential(
        [
            keras.Input(shape=(12,)),
            keras.layers.Dense(32, activation="relu"),  # keras.io: 256
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dropout(DROPOUT_RATE),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dropout(DROPOUT_RATE),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model = distribute(model)  # keras_dist: the one line a user adds (the identity on one device)
    metrics = [
        keras.metrics.FalseNegatives(name="fn"),
        keras.metrics.FalsePositives(name="fp"),
        keras.metrics.TrueNegatives(name="tn"),
        keras.metrics.TruePositives(name="tp"),
        keras.metrics.Precision(name="precision"),
        keras.metrics.Recall(name="recall"),
    ]
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy", metrics=metrics)
    return model


def train(model, data):
    (train_features, train_targets), (val_features, val_targets) = data
    counts = np.bincount(train_targets[:, 0].astype("int64"))
    weight_for_0 = 1.0 / counts[0]
    weight_for_1 = 1.0 / counts[1]
    class_weight = {0: weight_for_0, 1: weight_for_1}
    history = model.fit(
        train_features,
        train_targets,
        batch_size=64,
        epochs=1,
        verbose=0,
        class_weight=class_weight,
    )
    return {
        "history": history.history,
        "evaluate": model.evaluate(val_features, val_targets, batch_size=64, verbose=0, return_dict=True),
        "predict": model.predict(val_features, batch_size=64, verbose=0),
    }
