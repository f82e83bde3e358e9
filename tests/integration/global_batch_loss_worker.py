"""Worker script for the multi-worker test of `keras_dist.global_batch` (issue 25 item 2), started by `run_workers`.

Usage: global_batch_loss_worker.py OUT_DIR
Reads OUT_DIR/initial.npz (the reference's starting weights) and OUT_DIR/data.npz, trains the two-tower
retrieval model of `tests/unit/test_global_batch_losses.py` (an in-batch softmax loss and an in-batch
top-1 metric, both wrapped in `keras_dist.global_batch`) under `MultiWorkerMirroredStrategy` (one CPU
replica per worker) with `fit` (batch 3 of 10 examples: parts 2/1, the last 1/0) and `evaluate`, and
writes OUT_DIR/worker-<task_id>.json: the final weights, fit's history and evaluate's results.
"""

import json
import os
import sys

import keras_dist  # keras_dist: joins the cluster before TensorFlow runs anything.


def build(model_class, **kwargs):
    """The two-tower model, compiled (also used by the test for the one-device reference)."""
    import keras
    from keras import ops

    def in_batch_softmax(y_true, y_pred):
        q, c = y_pred[:, :4], y_pred[:, 4:]
        logits = ops.matmul(q, ops.transpose(c)) / 0.5
        return keras.losses.sparse_categorical_crossentropy(ops.arange(ops.shape(q)[0]), logits, from_logits=True)

    def in_batch_top1(y_true, y_pred):
        q, c = y_pred[:, :4], y_pred[:, 4:]
        best = ops.argmax(ops.matmul(q, ops.transpose(c)), axis=1)
        return ops.cast(ops.equal(best, ops.arange(ops.shape(q)[0])), "float32")

    query, candidate = keras.Input((4,)), keras.Input((3,))
    q = keras.layers.Dense(4)(keras.layers.Dense(8, activation="tanh")(query))
    c = keras.layers.Dense(4)(keras.layers.Dense(8, activation="tanh")(candidate))
    model = model_class([query, candidate], keras.layers.Concatenate()([q, c]), **kwargs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras_dist.global_batch(in_batch_softmax),
        metrics=[keras_dist.global_batch(keras.metrics.MeanMetricWrapper(in_batch_top1, name="top1"))],
    )
    return model


def train(model, data):
    """Fits 2 epochs at batch 3 and evaluates; returns `{"history": ..., "evaluate": ...}` as floats."""
    x, y = [data["queries"], data["candidates"]], data["targets"]
    history = model.fit(x, y, batch_size=3, epochs=2, shuffle=False, verbose=0).history
    evaluated = model.evaluate(x, y, batch_size=3, verbose=0, return_dict=True)
    return {
        "history": {k: [float(v) for v in values] for k, values in history.items()},
        "evaluate": {k: float(v) for k, v in evaluated.items()},
    }


def main(out_dir):
    import numpy as np

    data = dict(np.load(os.path.join(out_dir, "data.npz")))
    initial = np.load(os.path.join(out_dir, "initial.npz"))
    model = build(keras_dist.DistributedModel)
    model.set_weights([initial[f"w{i}"] for i in range(len(initial.files))])
    results = train(model, data)
    results["weights"] = [w.tolist() for w in model.get_weights()]
    results["num_replicas_in_sync"] = model.distribute_strategy.num_replicas_in_sync
    with open(os.path.join(out_dir, f"worker-{keras_dist.task_id()}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
