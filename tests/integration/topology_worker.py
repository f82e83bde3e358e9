"""Worker script for the resume-on-another-topology tests, started by `keras_dist.testing.run_workers`.

Usage: topology_worker.py OUT_DIR SCENARIO
  none    trains 2 epochs of 8 steps (global batch 8) with BackupAndRestore(OUT_DIR/backup, save_freq=3,
          double_checkpoint=True)
  die     the same; every worker exits with status 3 after step 11 (the last backup: step 9, 1 step into epoch 1)
The model has a BatchNormalization layer (synchronized, so that N replicas compute the global
batch's moments, as one device does) and Adam; the topology is the cluster's (TF_CONFIG,
KERAS_DIST_CPU_REPLICAS). Writes OUT_DIR/<task_type>-<task_id>.json when training finished.
"""

import json
import os
import sys

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist  # Joins the cluster before TensorFlow runs anything.

DIE_AT_STEP = 11


class DieAtStep(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if int(np.asarray(self.model.optimizer.iterations)) == DIE_AT_STEP:
            os._exit(3)  # As a crash: no cleanup, no save.


def main(out_dir, scenario):
    keras.utils.set_random_seed(1)
    x = np.random.RandomState(0).rand(64, 3).astype("float32")
    y = x.sum(1, keepdims=True)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, use_bias=False)(inputs)  # A bias before BatchNormalization has no gradient.
    hidden = keras.layers.BatchNormalization(synchronized=True)(hidden)
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(hidden))
    # epsilon=1e-3: Adam divides by sqrt(v) + epsilon; near-zero gradients would turn float rounding into 1e-4.
    model.compile(optimizer=keras.optimizers.Adam(0.05, epsilon=1e-3), loss="mse")
    backup_dir = os.path.join(
        out_dir, "backup"
    )  # double_checkpoint=True: keeps the previous backup too, on any workers.
    callbacks = [keras.callbacks.BackupAndRestore(backup_dir, save_freq=3, double_checkpoint=True)]
    if scenario == "die":
        callbacks.append(DieAtStep())
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    info = keras_dist.cluster_info()
    with open(os.path.join(out_dir, f"{info.task_type}-{info.task_id}.json"), "w") as f:
        json.dump(
            {
                "iterations": int(np.asarray(model.optimizer.iterations)),
                "num_replicas_in_sync": model.distribute_strategy.num_replicas_in_sync,
                "weights": [w.tolist() for w in model.get_weights()],
                "optimizer": [np.asarray(v).tolist() for v in model.optimizer.variables],
            },
            f,
        )
    print("done", info.task_name, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
