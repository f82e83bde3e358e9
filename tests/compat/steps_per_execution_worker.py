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
import tensorflow as tf

import keras_dist  # keras_dist: joins the cluster before TensorFlow runs anything.

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "integration"))
import mw_workload  # noqa: E402  (the multi-worker tests' model and data)

STEPS_PER_EXECUTION = 3


def _repeating(x, y=None):
    return tf.data.Dataset.from_tensor_slices(x if y is None else (x, y)).batch(mw_workload.GLOBAL_BATCH_SIZE).repeat()


def run(model_class, **kwargs):
    """Trains, evaluates and predicts `mw_workload`'s model with `model_class`; returns JSON-ready results."""
    model = mw_workload.build(model_class, steps_per_execution=STEPS_PER_EXECUTION, **kwargs)
    x, y = mw_workload.data(40, seed=0)
    x_val, y_val = mw_workload.data(24, seed=1)
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
