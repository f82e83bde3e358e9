"""Worker script for the resume tests, started by `keras-dist launch`.

Usage: resume_worker.py OUT_DIR SCENARIO
  none     trains 3 epochs of 12 steps with BackupAndRestore(save_freq=5)
  kill     the same; on the first start worker 1 SIGKILLs itself after step 17
  sigterm  the same; on the first run worker 0 sends SIGTERM to the launcher after step 17
Writes OUT_DIR/<task_type>-<task_id>.json when training finished.
"""

import json
import os
import signal
import sys
import time

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist  # Joins the cluster before TensorFlow runs anything.
from keras_dist.callbacks import _resume  # noqa: E402


class AtStep(keras.callbacks.Callback):
    def __init__(self, step, action):
        super().__init__()
        self.step, self.action = step, action

    def on_train_batch_end(self, batch, logs=None):
        if int(np.asarray(self.model.optimizer.iterations)) == self.step:
            self.action()


def main(out_dir, scenario):
    x = np.random.RandomState(0).rand(96, 4).astype("float32")
    y = x.sum(1, keepdims=True)
    inputs = keras.Input((4,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(inputs))
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    callbacks = [keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"), save_freq=5)]
    first_start = os.environ.get("KERAS_DIST_RESTART_COUNT") == "0"
    marker = os.path.join(out_dir, "sigterm-sent")
    if scenario == "kill" and first_start and keras_dist.task_id() == 1:
        callbacks.append(AtStep(17, lambda: os.kill(os.getpid(), signal.SIGKILL)))
    if scenario == "sigterm" and keras_dist.task_id() == 0 and not os.path.exists(marker):

        def preempt():
            open(marker, "w").close()
            os.kill(os.getppid(), signal.SIGTERM)  # The launcher forwards it to every worker, as a scheduler would.
            deadline = time.monotonic() + 60
            while not _resume.PREEMPTION.requested and time.monotonic() < deadline:
                time.sleep(0.05)  # Until the forwarded SIGTERM reached this worker: the agreement is then at step 17.

        callbacks.append(AtStep(17, preempt))
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    info = keras_dist.cluster_info()
    with open(os.path.join(out_dir, f"{info.task_type}-{info.task_id}.json"), "w") as f:
        json.dump(
            {
                "iterations": int(np.asarray(model.optimizer.iterations)),
                "weights": [w.tolist() for w in model.get_weights()],
            },
            f,
        )
    print("done", info.task_name, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
