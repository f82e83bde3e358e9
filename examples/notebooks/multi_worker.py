# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# [![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/keras-dist/keras-dist/blob/main/examples/notebooks/multi_worker.ipynb)
#
# # Two workers from a notebook
#
# `keras-dist launch` starts 2 worker processes on this machine, each with its own `TF_CONFIG`,
# joined by TensorFlow's `MultiWorkerMirroredStrategy` over gRPC on loopback. Both train the same
# model on their shard of every global batch, and all-reduce the gradients at every step, so their
# loss curves must coincide. Each worker writes its history; the plot shows both.

# %%
import os
import subprocess
import sys

SMOKE = bool(os.environ.get("KERAS_DIST_SMOKE"))
if not SMOKE:  # Colab: keras-dist alone; the runtime's TensorFlow, Keras and TFDS stay as they are.
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "git+https://github.com/keras-dist/keras-dist"], check=True
    )

# %% [markdown]
# ## The training script each worker runs
#
# Ordinary Keras, with `DistributedModel`; the history goes to `history-<worker>.json`.

# %%
SCRIPT = """
import json, sys
import keras_dist  # joins the cluster described by TF_CONFIG
import keras, numpy as np
from sklearn.datasets import load_digits

digits = load_digits()
x = (digits.images[..., None] / 16.0).astype("float32")
y = digits.target
inputs = keras.Input((8, 8, 1))
h = keras.layers.Flatten()(inputs)
h = keras.layers.Dense(64, activation="relu")(h)
model = keras_dist.DistributedModel(inputs, keras.layers.Dense(10)(h))
model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
epochs = int(sys.argv[1])
history = model.fit(x, y, batch_size=64, epochs=epochs, shuffle=False, verbose=0)
with open(f"history-{keras_dist.task_id()}.json", "w") as f:
    json.dump(history.history["loss"], f)
"""
with open("two_workers.py", "w") as f:
    f.write(SCRIPT)

# %% [markdown]
# ## Launch both workers
#
# Output lines are prefixed `[worker:i]`; the plan is printed by the chief.

# %%
epochs = "2" if SMOKE else "15"
result = subprocess.run(
    [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", "2", "two_workers.py", epochs],
    capture_output=True,
    text=True,
    timeout=600,
)
print(result.stdout[-3000:], result.stderr[-2000:])
assert result.returncode == 0

# %% [markdown]
# ## The two loss curves coincide

# %%
import json

import matplotlib

if SMOKE:
    matplotlib.use("Agg")
import matplotlib.pyplot as plt

curves = [json.load(open(f"history-{i}.json")) for i in range(2)]
for i, losses in enumerate(curves):
    plt.plot(range(1, len(losses) + 1), losses, marker="o" if i == 0 else "x", label=f"worker {i}")
plt.xlabel("epoch")
plt.ylabel("training loss")
plt.legend()
plt.show()
print("largest difference between the workers' losses:", max(abs(a - b) for a, b in zip(*curves)))
assert curves[0] == curves[1]
