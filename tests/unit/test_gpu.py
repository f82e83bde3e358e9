"""DistributedModel on GPUs against one GPU (marker `gpu`; skipped on machines without one).

Each case runs in a fresh interpreter: GPUs can be split into logical devices, and TensorFloat-32
turned off (on Ampere and later GPUs float32 matmuls and convolutions round to TF32 by default,
so two batch splits would differ by about 1e-3), only before TensorFlow initializes them.
"""

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not tf.config.list_physical_devices("GPU"), reason="needs at least one GPU"),
]

ENV = {k: v for k, v in os.environ.items() if k not in ("KERAS_DIST_CPU_REPLICAS", "TF_CONFIG")}

# argv: "every_gpu" (all physical GPUs, strategy="mirrored": NCCL between 2 or more) or
# "two_logical_gpus" (GPU 0 split in two, all-reduce through one device); number of examples.
PROGRAM = r"""
import json, sys
import numpy as np
import tensorflow as tf

mode, num_examples = sys.argv[1], int(sys.argv[2])
gpus = tf.config.list_physical_devices("GPU")
if mode == "two_logical_gpus":
    tf.config.set_logical_device_configuration(gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=2048)] * 2)
tf.config.experimental.enable_tensor_float_32_execution(False)
tf.config.experimental.enable_op_determinism()  # the same kernels (cuDNN algorithms) for both runs

import keras
import keras_dist
from keras_dist.testing import max_weight_difference

if mode == "two_logical_gpus":
    strategy = tf.distribute.MirroredStrategy(["/gpu:0", "/gpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice())
else:
    strategy = keras_dist.resolve_strategy("mirrored")

def build(cls, **kwargs):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((8, 3))
    hidden = keras.layers.Conv1D(4, 3, activation="relu")(inputs)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    outputs = keras.layers.Dense(1)(keras.layers.Dense(16, activation="relu")(hidden))
    model = cls(inputs, outputs, **kwargs)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return model

rs = np.random.RandomState(0)
x = rs.rand(num_examples, 8, 3).astype("float32")
y = x.sum(axis=(1, 2))[:, None] + rs.rand(num_examples, 1).astype("float32")
with tf.device("/gpu:0"):
    reference = build(keras.Model)
distributed = build(keras_dist.DistributedModel, strategy=strategy)
distributed.set_weights(reference.get_weights())
kwargs = dict(batch_size=8, epochs=3, shuffle=False, verbose=0)
expected = reference.fit(x, y, **kwargs).history
got = distributed.fit(x, y, **kwargs).history
print("RESULT " + json.dumps({
    "devices": list(strategy.extended.worker_devices),
    "cross_device_ops": type(strategy.extended._cross_device_ops).__name__,
    "max_weight_difference": max_weight_difference(reference, distributed),
    "expected": expected, "got": got,
    "evaluate": [reference.evaluate(x, y, batch_size=8, verbose=0), distributed.evaluate(x, y, batch_size=8, verbose=0)],
}))
"""


def _run(mode, num_examples):
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, mode, str(num_examples)],
        env={**ENV, "KERAS_DIST_QUIET": "1", "TF_CPP_MIN_LOG_LEVEL": "2"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def _assert_matches_one_gpu(result):
    assert result["max_weight_difference"] < 1e-5, result
    for name in ("loss", "mae"):
        assert result["got"][name] == pytest.approx(result["expected"][name], rel=1e-5, abs=1e-6), (name, result)
    assert result["evaluate"][1] == pytest.approx(result["evaluate"][0], rel=1e-5, abs=1e-6), result


@pytest.mark.timeout(300)
def test_every_visible_gpu_matches_one_gpu():
    """`strategy="mirrored"` takes every physical GPU (NCCL all-reduce between 2 or more); 37 examples at batch 8."""
    result = _run("every_gpu", 37)
    num_gpus = len(tf.config.list_physical_devices("GPU"))
    assert len(result["devices"]) == num_gpus and all("GPU" in d for d in result["devices"]), result
    if num_gpus > 1:
        assert result["cross_device_ops"] == "NcclAllReduce", result
    _assert_matches_one_gpu(result)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("num_examples", [37, 33], ids=["uneven_last_batch", "empty_replica_in_last_batch"])
def test_two_replicas_on_one_gpu_match_one_gpu(num_examples):
    """Two replicas on GPU 0 (split in two logical GPUs): the last batch of 5 splits 3/2, of 1 splits 1/0."""
    result = _run("two_logical_gpus", num_examples)
    assert len(result["devices"]) == 2, result
    _assert_matches_one_gpu(result)
