# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/keras-dist/keras-dist/blob/main/examples/notebooks/cifar10_mixed_precision.ipynb)
#
# # CIFAR-10 ResNet with mixed precision, and its throughput
#
# A small ResNet on CIFAR-10 from TFDS, under the `mixed_float16` policy (float16 compute, float32
# weights, dynamic loss scaling), on every GPU of the runtime. `ThroughputMonitor` adds examples per
# second (global and per replica) and step-time percentiles to each epoch's logs.
#
# With mixed precision, keras-dist sums the gradients over the replicas before the loss-scale
# optimizer checks them for overflow, so an overflow on any replica skips the step everywhere (plain
# Keras checks the first replica only: see the compatibility page, `sum_gradients_before_apply`).
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

keras_dist.simulate_cpu_replicas(2)  # Only acts where there is no GPU.

import contextlib

import keras
import tensorflow as tf
import tensorflow_datasets as tfds

from keras_dist.callbacks import ThroughputMonitor

keras.mixed_precision.set_global_policy("mixed_float16")

# %% [markdown]
# ## Data

# %%
GLOBAL_BATCH_SIZE = 64 if SMOKE else 256  # The smoke run (CI's CPU) takes 3 small steps on mock data.
data_context = tfds.testing.mock_data(num_examples=128) if SMOKE else contextlib.nullcontext()
with data_context:
    train, test = tfds.load("cifar10", split=["train", "test"], as_supervised=True)


def prepare(images, labels):
    return tf.cast(images, tf.float32) / 255.0, labels


def augment(images, labels):
    return tf.image.random_flip_left_right(images, seed=0), labels


train = train.map(prepare).shuffle(10_000, seed=0).map(augment).batch(GLOBAL_BATCH_SIZE).prefetch(tf.data.AUTOTUNE)
test = test.map(prepare).batch(GLOBAL_BATCH_SIZE).prefetch(tf.data.AUTOTUNE)

# %% [markdown]
# ## A small ResNet
#
# The last layer computes in float32 (`dtype="float32"`), as Keras' mixed-precision guide advises
# for the logits.


# %%
def residual_block(x, filters, stride):
    shortcut = x
    x = keras.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
    x = keras.layers.BatchNormalization()(x)
    if stride != 1 or shortcut.shape[-1] != filters:
        shortcut = keras.layers.Conv2D(filters, 1, strides=stride, use_bias=False)(shortcut)
        shortcut = keras.layers.BatchNormalization()(shortcut)
    return keras.layers.ReLU()(x + shortcut)


inputs = keras.Input((32, 32, 3))
x = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(inputs)
x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
for filters, stride in [(32, 1), (64, 2), (128, 2)]:
    x = residual_block(x, filters, stride)
x = keras.layers.GlobalAveragePooling2D()(x)
outputs = keras.layers.Dense(10, dtype="float32")(x)
model = keras_dist.DistributedModel(inputs, outputs)  # was: keras.Model(inputs, outputs)
model.compile(
    optimizer=keras.optimizers.SGD(0.1, momentum=0.9),  # compile wraps it in a LossScaleOptimizer
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)
print(type(model.optimizer).__name__)

# %% [markdown]
# ## Train, with the throughput in the logs

# %%
history = model.fit(
    train,
    epochs=1 if SMOKE else 10,
    steps_per_epoch=3 if SMOKE else None,
    callbacks=[ThroughputMonitor()],
    verbose=2,
)
for key in ("examples_per_second", "examples_per_second_per_replica", "step_seconds_p50", "step_seconds_p90"):
    print(f"{key}: {history.history[key][-1]:.4g}")
loss, accuracy = model.evaluate(test, verbose=0)
print(f"test accuracy: {accuracy:.4f}")
