"""The training run the multi-worker tests compare with single-device Keras.

Imported by `mw_worker.py` and `tests/compat/steps_per_execution_worker.py` (in each worker process, after `import keras_dist`)
and by `test_multi_worker.py` (single-device reference, in the pytest process).
Uneven on purpose: 37 training examples in global batches of 8 (last batch 5),
13 validation examples, 11 rows to predict. `build_sparse` / `run_sparse`: sparse
gradients (token ids that repeat, a position embedding), Adam.
"""

import keras
import numpy as np
import tensorflow as tf

GLOBAL_BATCH_SIZE = 8


class ExampleCount(keras.metrics.Sum):
    """Counts the examples a metric sees (each must be counted once)."""

    def update_state(self, y_true, y_pred, sample_weight=None):
        return super().update_state(tf.ones_like(y_true[:, 0]))


def data(num_examples, seed):
    rs = np.random.RandomState(seed)
    x = rs.rand(num_examples, 4).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32") + 0.3 * rs.rand(num_examples, 1)).astype("float32")
    return x, y


def build(model_class, steps_per_execution=1, gradient_accumulation_steps=None, **kwargs):
    """Returns a compiled model with fixed initial weights; `model_class` is keras.Model or DistributedModel."""
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = model_class(inputs, keras.layers.Dense(1)(hidden), **kwargs)
    rs = np.random.RandomState(42)
    model.set_weights([rs.normal(0, 0.5, w.shape).astype("float32") for w in model.get_weights()])
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9, gradient_accumulation_steps=gradient_accumulation_steps),
        loss="mse",
        metrics=["mae", ExampleCount(name="count")],
        steps_per_execution=steps_per_execution,
    )
    return model


def run(model):
    """Trains, evaluates and predicts; returns everything as JSON-ready lists."""
    x, y = data(37, seed=0)
    x_val, y_val = data(13, seed=1)
    x_pred, _ = data(11, seed=2)
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH_SIZE)
    history = model.fit(train, epochs=2, validation_data=(x_val, y_val), verbose=0)
    # NumPy input, not shuffled, batch split across workers by keras-dist/TF.
    history_np = model.fit(x, y, batch_size=GLOBAL_BATCH_SIZE, epochs=1, shuffle=False, verbose=0)
    evaluation = model.evaluate(x_val, y_val, batch_size=4, return_dict=True, verbose=0)
    predictions = model.predict(x_pred, batch_size=4, verbose=0)
    return {
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "history_numpy": {k: [float(v) for v in vs] for k, vs in history_np.history.items()},
        "evaluate": {k: float(v) for k, v in evaluation.items()},
        "predictions": predictions.tolist(),
        "weights": [w.tolist() for w in model.get_weights()],
    }


class PositionEmbedding(keras.layers.Layer):
    """Adds an embedding looked up with `arange`: the same rows on every replica (keras.io's TokenAndPositionEmbedding)."""

    def __init__(self, length, dim, **kwargs):
        super().__init__(**kwargs)
        self.length = length
        self.embedding = keras.layers.Embedding(length, dim)

    def call(self, x):
        return x + self.embedding(keras.ops.arange(0, self.length))


def build_sparse(model_class, gradient_accumulation_steps=None, **kwargs):
    """Token ids (10 ids, 6 per example: most repeat in a batch) plus a position embedding, Adam (accumulating: k)."""
    inputs = keras.Input((6,), dtype="int32")
    hidden = PositionEmbedding(6, 4)(keras.layers.Embedding(10, 4)(inputs))
    outputs = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(hidden))
    model = model_class(inputs, outputs, **kwargs)
    rs = np.random.RandomState(42)
    model.set_weights([rs.normal(0, 0.5, w.shape).astype("float32") for w in model.get_weights()])
    model.compile(
        optimizer=keras.optimizers.Adam(0.01, gradient_accumulation_steps=gradient_accumulation_steps), loss="mse"
    )
    return model


def run_sparse(model):
    """Two epochs on 37 examples in global batches of 8; returns the weights as lists."""
    rs = np.random.RandomState(0)
    x = rs.randint(0, 10, (37, 6)).astype("int32")
    y = (x.mean(1, keepdims=True) / 10).astype("float32")
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH_SIZE), epochs=2, verbose=0)
    return {"weights": [w.tolist() for w in model.get_weights()]}
