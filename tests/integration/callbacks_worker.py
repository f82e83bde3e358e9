"""Worker script for the multi-worker callback tests, started by `keras-dist launch`.

Usage: callbacks_worker.py OUT_DIR SCENARIO
  standard   every standard Keras callback at once, writing under OUT_DIR/run
  stop_one   a user callback, passed on worker 1 only, sets stop_training there at batch 3 of epoch 1
  stop_at_epoch_begin   the same, set in on_epoch_begin of epoch 1 (Keras stops after that epoch's first batch)
Writes OUT_DIR/<task_type>-<task_id>.json with what this worker saw.
"""

import json
import os
import sys

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist  # Joins the cluster before TensorFlow runs anything.

CALLS = {"keras_save": 0, "keras_save_weights": 0, "csv_epoch_end": 0, "tensorboard_epoch_end": 0}


def spy(cls, name, key):
    original = getattr(cls, name)

    def wrapped(self, *args, **kwargs):
        CALLS[key] += 1
        return original(self, *args, **kwargs)

    setattr(cls, name, wrapped)


spy(keras.Model, "save", "keras_save")
spy(keras.Model, "save_weights", "keras_save_weights")
spy(keras.callbacks.CSVLogger, "on_epoch_end", "csv_epoch_end")
spy(keras.callbacks.TensorBoard, "on_epoch_end", "tensorboard_epoch_end")


class StopAtEpochBegin(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            self.model.stop_training = True


class StopOnOneWorker(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if keras_dist.task_id() == 1 and self.model.optimizer.iterations.numpy() == 8 + 3:
            self.model.stop_training = True


def main(out_dir, scenario):
    run = os.path.join(out_dir, "run")
    x = np.random.RandomState(0).rand(128, 4).astype("float32")
    y = x.sum(1, keepdims=True)
    inputs = keras.Input((4,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    if scenario == "standard":
        callbacks = [
            keras.callbacks.ModelCheckpoint(os.path.join(run, "ckpt-{epoch:02d}.keras")),
            keras.callbacks.ModelCheckpoint(
                os.path.join(run, "best.weights.h5"), save_weights_only=True, save_best_only=True, monitor="loss"
            ),
            keras.callbacks.ModelCheckpoint(os.path.join(run, "batch.weights.h5"), save_weights_only=True, save_freq=5),
            keras.callbacks.BackupAndRestore(os.path.join(run, "backup"), delete_checkpoint=False),
            keras.callbacks.CSVLogger(os.path.join(run, "log.csv")),
            keras.callbacks.TensorBoard(os.path.join(run, "tensorboard")),
            keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=10.0),  # stops after epoch 2
            keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=0, min_delta=10.0, factor=0.5),
            keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr),
            keras.callbacks.TerminateOnNaN(),
        ]
    elif scenario == "stop_one":
        callbacks = [StopOnOneWorker()] if keras_dist.task_id() == 1 else []  # Worker 0 has no batch-hook callback.
    else:  # stop_at_epoch_begin
        callbacks = [StopAtEpochBegin()] if keras_dist.task_id() == 1 else []
    history = model.fit(x, y, batch_size=16, epochs=4, callbacks=callbacks, verbose=0)
    if scenario == "standard":
        model.save(
            os.path.join(run, "final.keras")
        )  # Every worker calls save on one path (plain Keras: HDF5 lock errors, corrupt .keras files).
    info = keras_dist.cluster_info()
    result = {
        "calls": CALLS,
        "epochs": len(history.history["loss"]),
        "iterations": int(model.optimizer.iterations.numpy()),
        "weights": [w.tolist() for w in model.get_weights()],
        "learning_rate": float(np.asarray(model.optimizer.learning_rate)),
    }
    with open(os.path.join(out_dir, f"{info.task_type}-{info.task_id}.json"), "w") as f:
        json.dump(result, f)
    print("done", info.task_name, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
