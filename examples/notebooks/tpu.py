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
# Colab's TPU runtime has no TensorFlow, so the first cell installs it there: `tensorflow-tpu`
# 2.20.0 (the newest on the package index) with `libtpu` 0.0.14. Left to itself pip pairs
# tensorflow-tpu 2.20.0 with the newest libtpu (0.0.52, made for JAX), and then
# `import tensorflow` aborts (`ConfigureDistributedTpuOp_DoWork not available`). That libtpu
# replaces the runtime's own, so JAX may not work in this runtime afterwards. Where TensorFlow is
# installed (Colab's CPU and GPU runtimes), the cell installs keras-dist alone.
#
# What was run: CI runs this notebook in smoke mode on CPU, and the install cell's packages were
# installed on a CPU machine, where `import tensorflow` works (after `TPU_SKIP_MDS_QUERY=1`: off
# Google Cloud, libtpu otherwise waits minutes for the cloud metadata server) and
# `strategy="tpu"` says that no TPU was found. Not yet run on a real TPU.

# %%
import importlib.util
import os
import subprocess
import sys

SMOKE = bool(os.environ.get("KERAS_DIST_SMOKE"))
if not SMOKE:  # Colab: install keras-dist; the runtime's TensorFlow and Keras stay as they are.
    packages = ["git+https://github.com/keras-dist/keras-dist"]
    if importlib.util.find_spec("tensorflow") is None:  # Colab's TPU runtime: no TensorFlow.
        packages += ["tensorflow-tpu==2.20.0", "libtpu==0.0.14"]  # The newest libtpu's import aborts.
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *packages], check=True)

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
