"""Ray Train runs examples/ray_train.py (the script docs/multi_worker.md shows) on 2 workers: one device's weights.

`ray.train.tensorflow.TensorflowTrainer` on a Ray cluster of this machine, started by the
script (2 CPUs, on loopback): Ray writes each worker's `TF_CONFIG`, `import keras_dist` joins
it, and the chief reports a checkpoint through `ray.train.report`. The checkpoint Ray keeps is
read back here and compared with single-device Keras on the same global batches. Newest stack
only (not in the `stacks` subset): Ray is in the `dev` extra, not in the stacks' files.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

from keras_dist import _process
from keras_dist.testing import clean_env

pytest.importorskip("ray.train.tensorflow", reason="needs Ray Train (`pip install -e '.[dev]'`)")

pytestmark = pytest.mark.multi_worker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "ray_train.py")


def _load_script():
    spec = importlib.util.spec_from_file_location("ray_train_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # Defines functions only; Ray and TensorFlow are imported in them.
    return module


@pytest.mark.timeout(170)
def test_tensorflow_trainer_on_two_workers_matches_one_device_and_checkpoints(tmp_path):
    script = _load_script()
    env = clean_env(
        KERAS_DIST_QUIET="1",
        RAY_USAGE_STATS_ENABLED="0",
        # Worker-group start took about 28 s on 2 idle cores; CI runs other tests beside this one.
        RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="120",
        RAY_DEDUP_LOGS="0",
    )
    process = subprocess.Popen(
        [sys.executable, SCRIPT, "--num-workers", "2", "--storage-path", str(tmp_path / "results")],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # Ray's processes (GCS, raylet, workers) join this group.
    )
    try:
        output, _ = process.communicate(timeout=160)
    except subprocess.TimeoutExpired:
        _process.stop_process_groups([process], grace_period=5)
        output, _ = process.communicate()
        pytest.fail(f"examples/ray_train.py did not finish in 160 s; its output:\n{output[-6000:]}")
    finally:
        _process.stop_process_groups([process], grace_period=5)  # What Ray left behind, if anything.
    assert process.returncode == 0, output[-6000:]

    metrics = json.loads(re.search(r"^metrics: (.*)$", output, re.M).group(1))
    checkpoint = re.search(r"^checkpoint: (.*)$", output, re.M).group(1)
    assert metrics["num_replicas_in_sync"] == 2, metrics  # One synchronous group, not two lone runs.
    assert checkpoint.startswith(str(tmp_path / "results")), checkpoint  # Kept in Ray's storage.
    # Ray's workers talked on loopback (TensorFlow's MultiWorkerMirroredStrategy log line).
    addresses = re.findall(r"cluster_spec = \{'worker': \[([^\]]*)\]", output)
    assert addresses and all(re.fullmatch(r"'127\.0\.0\.1:\d+', '127\.0\.0\.1:\d+'", a) for a in addresses), addresses

    reference = script.build_model(keras.Model)
    history = reference.fit(script.make_dataset(script.GLOBAL_BATCH_SIZE), epochs=script.EPOCHS, verbose=0)
    restored = script.build_model(keras.Model)
    restored.optimizer.build(restored.trainable_variables)  # So that its slots are read from the file too.
    restored.load_weights(checkpoint)
    for got, expected in zip(restored.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    for got, expected in zip(restored.optimizer.variables, reference.optimizer.variables, strict=True):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5, err_msg=got.path)
    np.testing.assert_allclose(metrics["loss"], history.history["loss"][-1], rtol=1e-5, atol=1e-5)
