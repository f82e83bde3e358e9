# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/keras-dist/keras-dist/blob/main/examples/notebooks/mnist_tfds.ipynb)
#
# # MNIST from TFDS on every GPU of the runtime
#
# Plain Keras, with one change: `keras_dist.DistributedModel` instead of `keras.Model`. On Colab's
# GPU runtime the model is mirrored over the GPU(s); on a CPU runtime the CPU is split into 2
# replicas, so the same notebook shows a real all-reduce anywhere.
#
# `SMOKE` (set by the project's CI) trains a few steps on TFDS mock data, since CI cannot download.
#
# Written for Colab's GPU runtime (*Runtime > Change runtime type > GPU*) as published in August
# 2026: Python 3.13, keras 3.13.2, tensorflow 2.20.0, tensorflow-datasets 4.9.10. The first cell
# installs keras-dist alone and keeps that stack (`ci/stacks/check_install_cells.py` checks it with
# pip's dry run on a copy of the stack). Run by the project on CPU in smoke mode, not on Colab's GPU.

# %%
import os
import subprocess
import sys

SMOKE = bool(os.environ.get("KERAS_DIST_SMOKE"))
if not SMOKE:  # Colab: keras-dist alone; the runtime's TensorFlow, Keras and TFDS stay as they are.
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "git+https://github.com/keras-dist/keras-dist"], check=True
    )

# %%
import keras_dist

keras_dist.simulate_cpu_replicas(2)  # Only acts where there is no GPU; before TensorFlow runs anything.

import contextlib

import keras
import tensorflow as tf
import tensorflow_datasets as tfds

# %% [markdown]
# ## Data: TFDS, batched by the global batch size
#
# The batch you give is the **global** batch: keras-dist splits each one over the replicas.

# %%
GLOBAL_BATCH_SIZE = 128
data_context = tfds.testing.mock_data(num_examples=256) if SMOKE else contextlib.nullcontext()
with data_context:
    train, test = tfds.load("mnist", split=["train", "test"], as_supervised=True)


def prepare(images, labels):
    return tf.cast(images, tf.float32) / 255.0, labels


train = train.map(prepare).shuffle(10_000, seed=0).batch(GLOBAL_BATCH_SIZE).prefetch(tf.data.AUTOTUNE)
test = test.map(prepare).batch(GLOBAL_BATCH_SIZE).prefetch(tf.data.AUTOTUNE)

# %% [markdown]
# ## Model: `DistributedModel` in place of `keras.Model`
#
# Creating it prints the plan: the strategy, the replicas, and how gradients are all-reduced.

# %%
inputs = keras.Input((28, 28, 1))
x = keras.layers.Conv2D(32, 3, activation="relu")(inputs)
x = keras.layers.MaxPooling2D()(x)
x = keras.layers.Conv2D(64, 3, activation="relu")(x)
x = keras.layers.GlobalAveragePooling2D()(x)
outputs = keras.layers.Dense(10)(x)
model = keras_dist.DistributedModel(inputs, outputs)  # was: keras.Model(inputs, outputs)
model.compile(
    optimizer=keras.optimizers.Adam(1e-3),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)

# %% [markdown]
# ## Train and evaluate: Keras' own `fit` and `evaluate`

# %%
history = model.fit(train, epochs=1 if SMOKE else 3, steps_per_epoch=2 if SMOKE else None, verbose=2)
loss, accuracy = model.evaluate(test, verbose=0)
print(f"test accuracy: {accuracy:.4f}")
print(model.input_plan)
