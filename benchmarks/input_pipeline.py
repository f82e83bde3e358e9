"""Does the distributed input pipeline keep up with the training step?

A benchmark, not a test: it prints throughputs measured in this run and asserts
nothing about speed. It uses the main example's setup (`examples/digits_cnn.py`:
scikit-learn's 8x8 digits, the same small CNN as a `keras_dist.DistributedModel`,
the same optimizer, loss and `tf.data` pipeline). The example is a top-level
script (importing it would train), so its data, model and pipeline are
replicated here in a few lines; keep them in step with the example.

Measured in one process, after a warm-up, in examples per second:

  input      iterating `strategy.experimental_distribute_dataset(dataset)`,
             the distributed dataset exactly as `fit` gets it, with no model:
             how fast the pipeline alone can hand per-replica batches out.
  fit        `model.fit` on the same dataset (`steps_per_epoch`, one untimed
             epoch that traces the step, then timed epochs).
  fit-cached `model.fit` on `dataset.take(1).repeat()` (one batch already in
             memory): the compute ceiling of the step without the pipeline.

Reading it: `input / fit` is how many times faster the pipeline produces
examples than the step consumes them. Well above 1 (> 1.5 here) means the
input is not the bottleneck; near or below 1 means the step may starve (look
at `prefetch`, `cache`, parallel `map`). `fit` well below `fit-cached` with a
high ratio points at per-step overhead rather than the pipeline.

Timed spans cover whole passes over the training set (steps are rounded up),
so every epoch sees exactly the same examples, short last batch included.

    python benchmarks/input_pipeline.py [--cpu-replicas 2] [--global-batch-size 64] [--steps 46] [--epochs 5]
"""

import argparse
import math
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_DIST_QUIET", "1")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import keras_dist  # noqa: E402  (first: sets the Keras backend before keras loads)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--cpu-replicas", type=int, default=2)
parser.add_argument("--global-batch-size", type=int, default=64)
parser.add_argument("--steps", type=int, default=46, help="steps per timed epoch (rounded up to whole passes)")
parser.add_argument("--epochs", type=int, default=5, help="timed epochs (after one warm-up epoch)")
args = parser.parse_args()

# Before the first TensorFlow op, as in the example.
if not tf.config.list_physical_devices("GPU"):
    keras_dist.simulate_cpu_replicas(args.cpu_replicas)
keras.utils.set_random_seed(0)

# --- The example's data, pipeline and model (replicated from examples/digits_cnn.py).
digits = load_digits()
x = (digits.images / 16.0).astype("float32")[..., np.newaxis]
y = digits.target.astype("int32")
x_train, _, y_train, _ = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
B = args.global_batch_size
dataset = (
    tf.data.Dataset.from_tensor_slices((x_train, y_train))
    .shuffle(len(x_train), seed=0)
    .batch(B)
    .repeat()  # added: lets `steps_per_epoch` run whole passes back to back
)

inputs = keras.Input(shape=(8, 8, 1))
h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
h = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(h)
h = keras.layers.Flatten()(h)
h = keras.layers.Dropout(0.3)(h)
outputs = keras.layers.Dense(10)(h)
model = keras_dist.DistributedModel(inputs, outputs, name="digits_cnn")
model.compile(
    optimizer=keras.optimizers.Adam(learning_rate=2e-3),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)
strategy = model.distribute_strategy

batches_per_pass = math.ceil(len(x_train) / B)
passes = max(1, math.ceil(args.steps / batches_per_pass))
steps = passes * batches_per_pass
examples_per_epoch = passes * len(x_train)


def time_input(epochs):
    """Examples/s of iterating the distributed dataset, as `fit` receives it."""
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    for _ in range(steps):  # warm-up: one epoch's worth
        next(iterator)
    count, start = 0, time.perf_counter()
    for _ in range(epochs * steps):
        features, _ = next(iterator)
        count += sum(int(t.shape[0]) for t in strategy.experimental_local_results(features))
    return count / (time.perf_counter() - start), count


class EpochTimer(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self.start)


def time_fit(data, examples_each_epoch, epochs):
    """Examples/s of `model.fit`, the first (tracing) epoch excluded."""
    timer = EpochTimer()
    timer.seconds = []
    model.fit(data, epochs=epochs + 1, steps_per_epoch=steps, verbose=0, callbacks=[timer], shuffle=False)
    return examples_each_epoch * epochs / sum(timer.seconds[1:])


input_rate, counted = time_input(args.epochs)
assert counted == examples_per_epoch * args.epochs, (counted, examples_per_epoch)  # whole passes, not speed
fit_rate = time_fit(dataset, examples_per_epoch, args.epochs)
cached_rate = time_fit(dataset.take(1).cache().repeat(), steps * B, args.epochs)

replicas = strategy.num_replicas_in_sync
print(
    f"\ndigits_cnn: {replicas} replica(s) ({type(strategy).__name__}), global batch {B} "
    f"({B // replicas} per replica), {steps} steps x {args.epochs} timed epochs\n"
)
print(f"{'measured':<42}{'examples/s':>12}")
print(f"{'input pipeline alone (distributed dataset)':<42}{input_rate:>12,.0f}")
print(f"{'training step, model.fit on the pipeline':<42}{fit_rate:>12,.0f}")
print(f"{'training step, one cached batch (ceiling)':<42}{cached_rate:>12,.0f}")
ratio = input_rate / fit_rate
verdict = "input is not the bottleneck" if ratio > 1.5 else "input may starve the step"
print(f"\ninput / training = {ratio:.1f}x -> {verdict}")
print(f"training / cached ceiling = {fit_rate / cached_rate:.2f}")
