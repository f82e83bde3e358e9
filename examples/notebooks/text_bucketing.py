# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/keras-dist/keras-dist/blob/main/examples/notebooks/text_bucketing.ipynb)
#
# # Variable-length text: bucketing, padding and traces
#
# IMDB movie reviews from TFDS (25,000 for training), from a few words to a few thousand. Batching
# them means padding every review of a batch to one length. Two pipelines, the same model
# (`DistributedModel` on every GPU of the runtime, or on 2 CPU replicas):
#
# - **naive**: `padded_batch`, each batch padded to its own longest review, so almost every batch
#   has a new shape;
# - **bucketed**: `keras_dist.data.bucket_by_length`, reviews of similar length batched together
#   and padded to their bucket's length, so a few shapes and little padding.
#
# For each we print the padding fraction, the traces of the train function counted by
# `keras_dist.callbacks.RetracingMonitor`, and the time per epoch.
#
# `SMOKE` (set by the project's CI, which cannot download) reads TFDS mock data instead: 1,024
# synthetic reviews with IMDB-like lengths.

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
import time

import keras
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from keras_dist.callbacks import RetracingMonitor, ThroughputMonitor
from keras_dist.data import bucket_by_length

# %% [markdown]
# ## Data: reviews from TFDS, as token ids of variable length
#
# In smoke mode `tfds.testing.mock_data` replaces the reader: its default random strings are a few
# characters long, so we give it synthetic reviews (words `w0` ... `w199`, lengths drawn like IMDB's:
# median about 170 words, a long tail), with a label the words predict.


# %%
def synthetic_reviews(builder, *args, **kwargs):
    rng = np.random.default_rng(0)

    def reviews():
        for _ in range(1024):
            label = int(rng.integers(2))
            length = int(np.clip(rng.lognormal(5.15, 0.65), 10, 2500))
            words = rng.integers(0, 100, length) * 2 + (
                rng.random(length) < 0.4 + 0.2 * label
            )  # More odd words: positive.
            yield {"text": " ".join(f"w{w}" for w in words), "label": label}

    signature = {"text": tf.TensorSpec([], tf.string), "label": tf.TensorSpec([], tf.int64)}
    return tf.data.Dataset.from_generator(reviews, output_signature=signature)


data_context = tfds.testing.mock_data(as_dataset_fn=synthetic_reviews) if SMOKE else contextlib.nullcontext()
with data_context:
    train, test = tfds.load("imdb_reviews", split=["train", "test"], as_supervised=True)

# %% [markdown]
# `TextVectorization` maps each review to token ids (0 is reserved for padding). Applied to one
# review at a time it returns a 1-D tensor of that review's length; we cut reviews at 1,024 tokens.

# %%
MAX_LENGTH = 1024
vectorize = keras.layers.TextVectorization(max_tokens=20_000)
vectorize.adapt(train.map(lambda text, label: text).batch(1024))


def to_token_ids(text, label):
    return vectorize(text)[:MAX_LENGTH], label


train_ids = train.map(to_token_ids, num_parallel_calls=tf.data.AUTOTUNE).cache()
test_ids = test.map(to_token_ids, num_parallel_calls=tf.data.AUTOTUNE).cache()
lengths = np.array([len(ids) for ids, _ in train_ids.as_numpy_iterator()])
print(
    f"{len(lengths)} reviews, tokens per review: min {lengths.min()}, median {np.median(lengths):.0f}, "
    f"max {lengths.max()}"
)

# %% [markdown]
# ## Two pipelines over the same examples
#
# The batch is the **global** batch: keras-dist splits each one over the replicas.
# `bucket_by_length` pads each batch to its bucket's upper boundary - 1 (here 63, 95, ..., 1024), so
# every review must be shorter than the last boundary, 1025.

# %%
GLOBAL_BATCH_SIZE = 32
BOUNDARIES = [64, 96, 128, 160, 192, 256, 320, 384, 512, 768, 1025]

naive = train_ids.shuffle(25_000, seed=0).padded_batch(GLOBAL_BATCH_SIZE).prefetch(tf.data.AUTOTUNE)
# keras_dist: similar lengths batched together, padded to a few lengths.
bucketed = bucket_by_length(
    train_ids.shuffle(25_000, seed=0), boundaries=BOUNDARIES, global_batch_size=GLOBAL_BATCH_SIZE
).prefetch(tf.data.AUTOTUNE)


def describe(batches):
    """Batches, distinct batch shapes, and the share of batched tokens that are padding."""
    shapes, tokens, cells = set(), 0, 0
    for ids, _ in batches.as_numpy_iterator():
        shapes.add(ids.shape)
        tokens += int(np.count_nonzero(ids))
        cells += ids.size
    return {"shapes": len(shapes), "padding": 1 - tokens / cells, "cells": cells}


pipelines = {"naive": naive, "bucketed": bucketed}
stats = {name: describe(batches) for name, batches in pipelines.items()}
for name, s in stats.items():
    print(f"{name:>8}: {s['shapes']:3d} distinct batch shapes, {s['padding']:.1%} of the batched tokens are padding")

# %% [markdown]
# ## The model: an embedding that masks the padding
#
# `Embedding(mask_zero=True)` makes a mask from the padding (id 0); `GlobalAveragePooling1D` averages
# over the real tokens only, so the padding changes the work, not the result.


# %%
def build_model():
    keras.utils.set_random_seed(0)  # The same initial weights for both pipelines.
    inputs = keras.Input((None,), dtype="int64")
    x = keras.layers.Embedding(vectorize.vocabulary_size(), 32, mask_zero=True)(inputs)
    x = keras.layers.Dense(64, activation="relu")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(1)(x)
    model = keras_dist.DistributedModel(inputs, outputs)  # was: keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


class EpochTimer(keras.callbacks.Callback):
    """Adds `epoch_seconds` and `steps` (training only) to each epoch's logs."""

    def on_epoch_begin(self, epoch, logs=None):
        self.start, self.steps = time.perf_counter(), 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1

    def on_epoch_end(self, epoch, logs=None):
        logs["epoch_seconds"] = time.perf_counter() - self.start
        logs["steps"] = self.steps


# %% [markdown]
# ## Train on each pipeline, counting traces
#
# `RetracingMonitor` reads `tf.function`'s own tracing count of the train function (Keras' outer
# function over the iterator and its inner step: 2 after the first epoch) and adds `train_traces`,
# the new traces of each epoch, to the logs.

# %%
EPOCHS = 2 if SMOKE else 3
histories, models = {}, {}
for name, batches in pipelines.items():
    models[name] = build_model()
    monitor = RetracingMonitor()
    callbacks = [monitor, ThroughputMonitor(), EpochTimer()]  # ThroughputMonitor: step-time percentiles.
    history = models[name].fit(batches, epochs=EPOCHS, callbacks=callbacks, verbose=0)
    histories[name] = history.history
    print(
        f"{name:>8}: traces per epoch {history.history['train_traces']}, train_function traced "
        f"{monitor.traces['train_function']} times in all; accuracy {history.history['accuracy'][-1]:.3f}"
    )

# %% [markdown]
# ## Padding, traces and time, side by side
#
# The first epoch includes tracing, so the times are those of the later epochs (the fastest one,
# the least disturbed by anything else running on the machine).

# %%
seconds = {}
for name in pipelines:
    h = histories[name]
    seconds[name] = min(h["epoch_seconds"][1:])
    print(
        f"{name:>8}: padding {stats[name]['padding']:.1%}, traces {sum(h['train_traces'])}, "
        f"epoch {seconds[name]:.2f} s for {h['steps'][-1]} steps, "
        f"median step {1000 * min(h['step_seconds_p50'][1:]):.1f} ms"
    )
print(
    f"bucketed / naive: {stats['bucketed']['cells'] / stats['naive']['cells']:.2f}x the batched tokens, "
    f"{seconds['bucketed'] / seconds['naive']:.2f}x the time per epoch"
)

# %% [markdown]
# **What the trace counts say.** Both pipelines trace the train function the same number of times:
# Keras 3's `fit` traces its step for the dataset's *element spec*, and for both pipelines the
# batch and length dimensions there are `None` (a padded batch's length is only known at run time).
# So under `fit`, a new length per batch does **not** retrace; the gain of bucketing is the padding
# that is no longer computed, and the step time.
#
# Shapes do matter elsewhere: a `tf.function` of your own (a custom training loop, `predict` on
# arrays of changing shapes) traces once per new input shape, and a TPU or XLA compiles one program
# per shape. There bucketing bounds the number of traces by the number of distinct shapes:

# %%
for name, batches in pipelines.items():
    model = models[name]
    forward = tf.function(lambda ids, model=model: model(ids, training=False))  # Default tracing: no relaxed shapes.
    shapes = set()
    for ids, _ in batches:  # One epoch (reshuffled: its shapes differ a little from the count above).
        forward(ids)
        shapes.add(tuple(ids.shape))
    print(
        f"{name:>8}: {len(shapes)} distinct batch shapes, a plain tf.function traced "
        f"{forward.experimental_get_tracing_count()} times"
    )

# %% [markdown]
# ## Evaluate, bucketed
#
# `evaluate` counts every test review exactly once, whichever replica saw it.

# %%
test_batches = bucket_by_length(test_ids, boundaries=BOUNDARIES, global_batch_size=GLOBAL_BATCH_SIZE)
loss, accuracy = models["bucketed"].evaluate(test_batches, verbose=0)
print(f"test accuracy: {accuracy:.4f}")
