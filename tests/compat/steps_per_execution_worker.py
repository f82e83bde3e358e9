"""Worker script for test_multi_worker_steps_per_execution, started by `keras-dist launch`.

Usage: steps_per_execution_worker.py OUT_DIR
Writes OUT_DIR/<task_type>-<task_id>.json with what `run` returned on this worker.
The test also calls `run(keras.Model)`: the one-device reference.

`compile(steps_per_execution=3)` with step counts that are not multiples of 3, on
repeating inputs: Keras runs whole executions, so `steps_per_epoch=5` runs 6 steps
an epoch, `validation_steps=2` and `evaluate(steps=4)` 3 and 6, `predict(steps=4)`
6 batches.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

import keras_dist  # keras_dist: joins the cluster before TensorFlow runs anything.

STEPS_PER_EXECUTION = 3
GLOBAL_BATCH_SIZE = 8


def _data(num_examples, seed):
    rs = np.random.RandomState(seed)
    x = rs.rand(num_examples, 4).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32") + 0.3 * rs.rand(num_examples, 1)).astype("float32")
    return x, y


def _repeating(x, y=None):
    return tf.data.Dataset.from_tensor_slices(x if y is None else (x, y)).batch(GLOBAL_BATCH_SIZE).repeat()


def run(model_class, **kwargs):
    """Trains, evaluates and predicts a fixed model with `model_class`; returns JSON-ready results."""
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = model_class(inputs, keras.layers.Dense(1)(hidden), **kwargs)
    rs = np.random.RandomState(42)
    model.set_weights([rs.normal(0, 0.5, w.shape).astype("float32") for w in model.get_weights()])
    model.compile(
        optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"], steps_per_execution=STEPS_PER_EXECUTION
    )
    x, y = _data(40, seed=0)
    x_val, y_val = _data(24, seed=1)
    history = model.fit(
        _repeating(x, y),
        epochs=2,
        steps_per_epoch=5,
        validation_data=_repeating(x_val, y_val),
        validation_steps=2,
        verbose=0,
    )
    evaluation = model.evaluate(_repeating(x_val, y_val), steps=4, return_dict=True, verbose=0)
    predictions = model.predict(_repeating(x), steps=4, verbose=0)
    return {
        "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "evaluate": {k: float(v) for k, v in evaluation.items()},
        "predictions": predictions.ravel().tolist(),
        "weights": [w.ravel().tolist() for w in model.get_weights()],
    }


def main(out_dir):
    info = keras_dist.cluster_info()
    results = run(keras_dist.DistributedModel)
    with open(os.path.join(out_dir, f"{info.task_type}-{info.task_id}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
