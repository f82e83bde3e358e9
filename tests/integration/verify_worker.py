"""Worker script for the multi-worker test of `keras_dist.verify`, started by `run_workers`.

Usage: verify_worker.py OUT_DIR
Writes OUT_DIR/<task_type>-<task_id>.json: each check's verdict, cause and largest difference, and
whether the model was left as it was.
"""

import json
import os
import sys

import keras
import numpy as np

import keras_dist  # keras_dist: joins the cluster before TensorFlow runs anything.


def build(middle=()):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu", use_bias=not middle)(inputs)
    for layer in middle:
        h = layer(h)
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(3)(h))
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def summary(report):
    return {
        "passed": report.passed,
        "likely_cause": report.likely_cause,
        "max_weight_difference": report.max_weight_difference,
        "num_workers": report.num_workers,
        "num_replicas": report.num_replicas,
        "reference_device": report.reference_device,
        "logs": [dict(step) for step in report.logs],
        "reference_logs": [dict(step) for step in report.reference_logs],
    }


def main(out_dir):
    rs = np.random.RandomState(0)
    x, y = rs.rand(48, 6).astype("float32"), rs.randint(0, 3, 48).astype("int32")
    info = keras_dist.cluster_info()
    results = {}

    model = build()
    before = [w.copy() for w in model.get_weights()]
    results["plain"] = summary(keras_dist.verify(model, x, y, batch_size=16))
    results["left_as_it_was"] = all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    results["optimizer_built"] = bool(model.optimizer.built)
    history = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history
    results["fit_after"] = {k: [float(v) for v in vs] for k, vs in history.items()}
    results["plain_after_fit"] = summary(keras_dist.verify(model, x, y, batch_size=16))

    norm = build([keras.layers.BatchNormalization()])
    results["batch_norm"] = summary(keras_dist.verify(norm, x, y, batch_size=16))

    try:  # Each worker passes other data: every worker must refuse.
        keras_dist.verify(build(), x + info.task_id, y, batch_size=16)
        results["different_data"] = "no error"
    except ValueError as e:
        results["different_data"] = str(e)

    with open(os.path.join(out_dir, f"{info.task_type}-{info.task_id}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
