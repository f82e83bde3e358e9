"""
Title: Handwritten digits with a small CNN on several replicas
Author: keras-dist team
Date created: 2026-11-30
Last modified: 2026-11-30
Description: Train a Keras CNN on scikit-learn's 8x8 digits with `keras_dist.DistributedModel`.
"""

"""
## Introduction

This is keras-dist's main example: a real synchronous data-parallel training
run on real data. It trains a small convolutional network on the handwritten
digits that ship with scikit-learn (1,797 images of 8x8 pixels, no download)
and checks that the test accuracy reaches 95%.

The script is ordinary Keras. The only model change is
`keras_dist.DistributedModel(inputs, outputs)` in place of
`keras.Model(inputs, outputs)`; `compile`, `fit` and `evaluate` are Keras' own.
Every line that differs from single-device Keras has a `# keras_dist:` comment
above it saying why.

Where it runs:

- **No GPU** (a laptop, a free CPU Colab): the host CPU is split into 2
  simulated replicas (`--cpu-replicas`), so you see a real `MirroredStrategy`
  with two replicas and a gradient all-reduce on every step.
- **GPUs**: `strategy="auto"` mirrors the model over all of them.

Flags: `--epochs` (20), `--global-batch-size` (64), `--cpu-replicas` (2),
`--seed` (0), `--smoke` (2 epochs, no accuracy check), and `--verify` (check
the numbers against one device before training, see docs/verify.md).
"""

"""
## Setup

Simulated CPU replicas must be requested before TensorFlow runs its first op:
after that, TensorFlow's list of devices is fixed. So we parse the flags and
split the CPU first, before touching any data or model.
"""

import argparse
import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

# keras_dist: importing it sets KERAS_BACKEND=tensorflow (if unset), applies
# KERAS_DIST_CPU_REPLICAS when that environment variable is set, and, when
# TF_CONFIG describes several workers (`keras-dist launch`), joins the cluster.
import keras_dist

parser = argparse.ArgumentParser(description="Train a CNN on the digits with keras-dist.")
parser.add_argument("--epochs", type=int, default=20)
parser.add_argument("--global-batch-size", type=int, default=64)
parser.add_argument(
    "--cpu-replicas", type=int, default=2, help="simulated CPU replicas when there is no GPU (default: 2)"
)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--smoke", action="store_true", help="2 epochs and no accuracy check (for CI)")
parser.add_argument("--verify", action="store_true", help="compare 3 steps with one device before training")
# In a notebook, sys.argv holds the kernel's own arguments: use the defaults.
args = parser.parse_args([] if "ipykernel" in sys.modules else None)
epochs = 2 if args.smoke else args.epochs
started = time.perf_counter()

# keras_dist: with no GPU, split the CPU into replicas so training is really
# distributed. This must run before the first TensorFlow op. An explicit
# KERAS_DIST_CPU_REPLICAS was already applied by `import keras_dist`, so it wins.
# Under `keras-dist launch` (several workers) `import keras_dist` has already
# joined the cluster; replicas per worker then come from `--cpu-replicas` there.
if (
    not tf.config.list_physical_devices("GPU")
    and args.cpu_replicas > 1
    and not os.environ.get("KERAS_DIST_CPU_REPLICAS")
    and keras_dist.num_workers() == 1
):
    keras_dist.simulate_cpu_replicas(args.cpu_replicas)

keras.utils.set_random_seed(args.seed)

"""
## The data

`load_digits()` returns 1,797 grayscale images with values 0-16. We scale them
to [0, 1], add a channel axis, and hold out a stratified 20% (360 images) for
testing.
"""

digits = load_digits()
x = (digits.images / 16.0).astype("float32")[..., np.newaxis]  # (1797, 8, 8, 1)
y = digits.target.astype("int32")
x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, stratify=y, random_state=args.seed)
print(f"train images: {len(x_train)}, test images: {len(x_test)}")

"""
## The model

A plain functional CNN: two 3x3 convolutions ("same" padding keeps all 8x8
positions), dropout, and a dense layer that outputs 10 logits. Building it with
`keras_dist.DistributedModel` resolves the strategy (`"auto"`), creates every
variable under the strategy's scope, and prints the plan: strategy, replicas
and devices.
"""

inputs = keras.Input(shape=(8, 8, 1))
h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
h = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(h)
h = keras.layers.Flatten()(h)
h = keras.layers.Dropout(0.3)(h)
outputs = keras.layers.Dense(10)(h)  # logits
# keras_dist: DistributedModel in place of keras.Model; strategy="auto" uses all
# GPUs, else the simulated CPU replicas, else one device.
model = keras_dist.DistributedModel(inputs, outputs, name="digits_cnn")
model.summary()

"""
## Batches

`global_batch_size` is the number of examples in one step, summed over all
replicas; each replica gets `global_batch_size // num_replicas_in_sync`. We
batch the dataset with the *global* size and the strategy splits each batch.
The last batch of an epoch is smaller and uneven across replicas; keras-dist
weights each replica's loss by its share of the examples, so the update is the
same as on one device.
"""

# keras_dist: the number of replicas taking part in each synchronous step.
num_replicas = model.distribute_strategy.num_replicas_in_sync
global_batch_size = args.global_batch_size
# keras_dist: each replica sees its slice of every global batch.
per_replica_batch_size = global_batch_size // num_replicas
print(
    f"num_replicas_in_sync: {num_replicas}, global_batch_size: {global_batch_size}, "
    f"per_replica_batch_size: {per_replica_batch_size}"
)

train_ds = (
    tf.data.Dataset.from_tensor_slices((x_train, y_train))
    .shuffle(len(x_train), seed=args.seed)
    .batch(global_batch_size)
)
test_ds = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(global_batch_size)

"""
## Training

`compile` and `fit` are unchanged Keras. The optimizer, its slots and the
metric state are created under the strategy's scope; gradients are all-reduced
across replicas on every step.
"""

model.compile(
    optimizer=keras.optimizers.Adam(learning_rate=2e-3),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)

"""
## Checking against one device (`--verify`)

`keras_dist.verify` trains the model 3 steps on one device and 3 steps under
the strategy, from the same weights and on the same global batches, compares
every weight and every logged value, and puts the model back as it was. This
model's Dropout draws other masks on each replica than on one device, so the
first check names it; the second switches Dropout off to check everything else.
"""

if args.verify:
    # keras_dist: compare with one device (every worker calls it; the chief prints).
    for random_layers in ("keep", "off"):
        report = keras_dist.verify(model, train_ds, random_layers=random_layers)
        if keras_dist.is_chief():
            print(report)

model.fit(train_ds, validation_data=test_ds, epochs=epochs, verbose=2)

"""
## Evaluation

`evaluate` counts every test image exactly once, whichever replica saw it.
"""

test_loss, test_accuracy = model.evaluate(test_ds, verbose=0)
print(f"test accuracy: {test_accuracy:.4f}")
print(f"wall time: {time.perf_counter() - started:.1f} s")

if not args.smoke and test_accuracy < 0.95:
    print(
        f"FAILED: test accuracy {test_accuracy:.4f} is below the 0.95 target "
        f"(epochs={epochs}, global_batch_size={global_batch_size}, "
        f"num_replicas_in_sync={num_replicas}).",
        file=sys.stderr,
    )
    sys.exit(1)
