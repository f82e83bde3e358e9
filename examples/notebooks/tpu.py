# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/keras-dist/keras-dist/blob/main/examples/notebooks/tpu.ipynb)
#
# # The same model on a Colab TPU
#
# Choose *Runtime > Change runtime type > TPU*. `DistributedModel`'s default `strategy="auto"`
# finds the TPU (`COLAB_TPU_ADDR` / `TPU_NAME`, or a TPU VM), initializes it and builds a
# `TPUStrategy`; the plan printed below says so. Elsewhere the same notebook runs on GPUs or CPU
# replicas. TPUs compile one program per input shape, so the batches have a static shape
# (`drop_remainder=True`).
#
# Not yet run on a real TPU by the project's CI (no TPU there): CI runs it in smoke mode on CPU.

# %%
import os
import subprocess
import sys

SMOKE = bool(os.environ.get("KERAS_DIST_SMOKE"))
if not SMOKE:  # Colab: install keras-dist from the repository.
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "git+https://github.com/keras-dist/keras-dist"], check=True
    )

# %%
import keras_dist

keras_dist.simulate_cpu_replicas(2)  # Only acts where there is neither TPU nor GPU.

import keras
import tensorflow as tf
from sklearn.datasets import load_digits

# %% [markdown]
# ## Model and plan: `strategy="auto"` picks the TPU when there is one

# %%
inputs = keras.Input((8, 8, 1))
x = keras.layers.Conv2D(32, 3, activation="relu", padding="same")(inputs)
x = keras.layers.Flatten()(x)
outputs = keras.layers.Dense(10)(x)
model = keras_dist.DistributedModel(inputs, outputs)  # prints the plan: TPUStrategy on a TPU runtime
model.compile(
    optimizer="adam",
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)
print(type(model.distribute_strategy).__name__, model.distribute_strategy.num_replicas_in_sync, "replicas")

# %% [markdown]
# ## Static-shape batches, then Keras' own `fit`

# %%
digits = load_digits()
images = (digits.images[..., None] / 16.0).astype("float32")
global_batch = 16 * model.distribute_strategy.num_replicas_in_sync
dataset = tf.data.Dataset.from_tensor_slices((images, digits.target)).shuffle(2_000, seed=0)
dataset = dataset.batch(global_batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
history = model.fit(dataset, epochs=1 if SMOKE else 10, verbose=2)
print(f"final training accuracy: {history.history['accuracy'][-1]:.4f}")
