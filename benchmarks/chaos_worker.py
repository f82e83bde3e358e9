"""Worker script of the chaos run (`benchmarks/chaos.py`), started by `keras-dist launch`.

Usage: chaos_worker.py OUT_DIR PLAN_JSON

Trains a small regression model with (synchronized) BatchNormalization and Adam, the way a
keras.io script does (`DistributedModel`, `compile`, `fit` with a
`BackupAndRestore(save_freq=...)`), on fixed data in a fixed order. The plan
says the data size, the epochs, and the faults: at most one per start of the
workers (`KERAS_DIST_RESTART_COUNT` picks it; a fault of attempt "every" hits every
start), injected by the worker whose `KERAS_DIST_WORKER_SLOT` it names, after
that many steps of that start:

  sigkill         the worker SIGKILLs itself
  sigterm         the worker SIGTERMs itself (a preemption notice: every worker
                  saves at the agreed step and exits with status 75)
  sigstop         the worker freezes (SIGSTOP); the others' stall watchdog fails them
  corrupt_backup  the worker cuts the newest backup weights file in half, then SIGKILLs itself
  disk_full       the worker's files may grow no larger than a few hundred bytes
                  (RLIMIT_FSIZE, SIGXFSZ ignored), so its next save fails

Each start and each fault is appended to OUT_DIR/events.jsonl (one JSON object
per line: event, attempt, slot, step = the optimizer's iterations, time). When
`fit` ends, every worker writes OUT_DIR/result-<task_id>.json (iterations,
weights).
"""

import glob
import json
import os
import resource
import signal
import sys
import time

import keras
import numpy as np

import keras_dist


def _log(out_dir, **event):
    event["time"] = time.time()
    with open(os.path.join(out_dir, "events.jsonl"), "a") as f:
        f.write(json.dumps(event) + "\n")


class Faults(keras.callbacks.Callback):
    """Injects this start's fault (if it is this worker's) after `after_steps` steps."""

    def __init__(self, out_dir, backup_dir, fault, attempt, slot):
        super().__init__()
        self.out_dir, self.backup_dir, self.fault = out_dir, backup_dir, fault
        self.attempt, self.slot, self.steps = attempt, slot, 0

    def _step(self):
        return int(np.asarray(self.model.optimizer.iterations))

    def on_train_begin(self, logs=None):  # After BackupAndRestore (earlier in the list) restored the backup.
        _log(self.out_dir, event="start", attempt=self.attempt, slot=self.slot, step=self._step())

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        fault = self.fault
        if fault is None or fault["slot"] != self.slot or self.steps != fault["after_steps"]:
            return
        kind = fault["kind"]
        _log(self.out_dir, event="fault", kind=kind, attempt=self.attempt, slot=self.slot, step=self._step())
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)  # keras-dist's handler only raises its flag.
        elif kind == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "corrupt_backup":
            files = sorted(glob.glob(os.path.join(self.backup_dir, "**", "*.h5"), recursive=True), key=os.path.getmtime)
            if files:
                with open(files[-1], "r+b") as f:
                    f.truncate(os.path.getsize(files[-1]) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "disk_full":
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # A write past the limit then fails with EFBIG.
            resource.setrlimit(resource.RLIMIT_FSIZE, (512, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        else:
            raise ValueError(f"Unknown fault kind {kind!r}")


def main(out_dir, plan_path):
    with open(plan_path) as f:
        plan = json.load(f)
    attempt = int(os.environ.get("KERAS_DIST_RESTART_COUNT", "0"))
    slot = int(os.environ.get("KERAS_DIST_WORKER_SLOT", keras_dist.task_id()))
    fault = next((f for f in plan["faults"] if f["attempt"] in (attempt, "every")), None)

    rng = np.random.RandomState(0)
    x = rng.rand(plan["examples"], 8).astype("float32")
    y = (x @ rng.rand(8, 1) + 0.1 * rng.rand(plan["examples"], 1)).astype("float32")
    keras.utils.set_random_seed(1)  # The same initial weights on every start (the backup replaces them).
    inputs = keras.Input((8,))
    # No bias before BatchNormalization (it would only be cancelled), and the statistics of the global
    # batch (synchronized), so that a run with fewer workers (an elastic launch) trains alike.
    hidden = keras.layers.Dense(16, use_bias=False)(inputs)
    hidden = keras.layers.BatchNormalization(synchronized=True)(hidden)
    outputs = keras.layers.Dense(1)(keras.layers.Activation("relu")(hidden))
    model = keras_dist.DistributedModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    backup_dir = os.path.join(out_dir, "backup")
    callbacks = [
        # double_checkpoint: keep the previous backup too, so that a damaged newest one falls back to it.
        keras.callbacks.BackupAndRestore(backup_dir, save_freq=plan["save_freq"], double_checkpoint=True),
        Faults(out_dir, backup_dir, fault, attempt, slot),
    ]
    model.fit(x, y, batch_size=plan["batch_size"], epochs=plan["epochs"], shuffle=False, verbose=0, callbacks=callbacks)
    result = {
        "iterations": int(np.asarray(model.optimizer.iterations)),
        "weights": [w.tolist() for w in model.get_weights()],
    }
    with open(os.path.join(out_dir, f"result-{keras_dist.task_id()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
