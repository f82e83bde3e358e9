"""Worker script for the stall watchdog tests, started by `keras_dist.testing.run_workers`.

Usage: stall_worker.py SCENARIO [TASK]
  sleep     worker TASK sleeps 600 s in a callback's on_train_batch_end at batch 5 of epoch 0
  sigstop   worker TASK stops itself (SIGSTOP) at batch 5 of epoch 0
  slow      worker TASK sleeps 1.5 s in every on_train_batch_end (slow but progressing)
  evaluate  after fit, only the chief calls model.evaluate (the others sleep 600 s)
Prints `FINISHED` when fit ends normally.
"""

import os
import signal
import sys
import time

import keras
import numpy as np

import keras_dist

SCENARIO, TASK = "", 1  # Set by main() from the command line.


class Sleepy(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if keras_dist.task_id() != TASK:
            return
        if SCENARIO == "sleep" and batch == 5 and not getattr(self, "done", False):
            self.done = True
            time.sleep(600)
        elif SCENARIO == "sigstop" and batch == 5:
            os.kill(os.getpid(), signal.SIGSTOP)
        elif SCENARIO == "slow":
            time.sleep(1.5)


def main():
    global SCENARIO, TASK
    SCENARIO = sys.argv[1]
    TASK = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    rng = np.random.RandomState(0)
    x = rng.rand(256, 8).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    inputs = keras.Input((8,))
    model = keras_dist.DistributedModel(
        inputs, keras.layers.Dense(1)(keras.layers.Dense(16, activation="relu")(inputs))
    )
    model.compile(optimizer="adam", loss="mse")
    epochs = 2 if SCENARIO in ("slow", "evaluate") else 50
    model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, callbacks=[Sleepy()])
    print("FINISHED", flush=True)
    if SCENARIO == "evaluate":
        if keras_dist.is_chief():
            model.evaluate(x, y, batch_size=32, verbose=0)
        else:
            time.sleep(600)


if __name__ == "__main__":
    main()
