"""Single-process behaviours that need a fresh interpreter (device set-up happens once per process)."""

import os
import subprocess
import sys

import pytest
import tensorflow as tf

from keras_dist.testing import clean_env

ENV = clean_env()


def _run(code, timeout=110, **env):
    result = subprocess.run(
        [sys.executable, "-c", code], env={**ENV, **env}, capture_output=True, text=True, timeout=timeout
    )
    return result


@pytest.mark.timeout(120)
def test_env_var_splits_cpu_and_auto_mirrors_over_it():
    code = (
        "import keras, keras_dist\n"
        "inputs = keras.Input((2,))\n"
        "m = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs))\n"
        "print('REPLICAS', m.distribute_strategy.num_replicas_in_sync)\n"
    )
    result = _run(code, KERAS_DIST_CPU_REPLICAS="3")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "REPLICAS 3" in result.stdout
    assert result.stdout.count("keras-dist plan") == 1
    assert "replicas in sync:     3" in result.stdout


@pytest.mark.timeout(120)
def test_single_device_default_prints_its_plan():
    code = (
        "import keras, keras_dist\n"
        "inputs = keras.Input((2,))\n"
        "m = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs))\n"
        "m.compile(optimizer='sgd', loss='mse')\n"
        "m.fit(keras.ops.ones((4, 2)), keras.ops.ones((4, 1)), verbose=0)\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "strategy:             DefaultDistributionStrategy" in result.stdout
    assert "replicas in sync:     1" in result.stdout


@pytest.mark.timeout(300)
def test_main_example_smoke_run():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run(
        [sys.executable, os.path.join(root, "examples", "digits_cnn.py"), "--smoke"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "keras-dist plan" in result.stdout
    if not tf.config.list_physical_devices("GPU"):  # 2 simulated CPU replicas by default
        assert "replicas in sync:     2" in result.stdout
    assert "test accuracy" in result.stdout


@pytest.mark.timeout(60)
def test_launcher_process_does_not_load_tensorflow(tmp_path):
    command = [sys.executable, "-X", "importtime", "-m", "keras_dist.cli", "launch", "--num-workers", "0", "x.py"]
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=50)
    assert result.returncode == 2 and "`--num-workers` must be an integer >= 1" in result.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "import time:" in line]
    assert "keras_dist.cli.launch" in imported
    assert not [name for name in imported if name.split(".")[0] in ("tensorflow", "keras")]
