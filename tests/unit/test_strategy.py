"""Strategy resolution, the plan, and simulated CPU replicas (no processes started)."""

import json

import pytest
import tensorflow as tf

import keras_dist
from keras_dist._runtime import devices
from keras_dist.strategy import _plan, _resolve, choose_strategy_name


@pytest.mark.parametrize(
    "facts,expected",
    [
        (dict(tpu_available=True, num_cluster_tasks=2, num_gpus=8, num_cpu_replicas=1), "tpu"),
        (dict(tpu_available=False, num_cluster_tasks=2, num_gpus=8, num_cpu_replicas=1), "multi_worker"),
        (dict(tpu_available=False, num_cluster_tasks=1, num_gpus=2, num_cpu_replicas=1), "mirrored"),
        (dict(tpu_available=False, num_cluster_tasks=0, num_gpus=0, num_cpu_replicas=2), "mirrored"),
        (dict(tpu_available=False, num_cluster_tasks=0, num_gpus=1, num_cpu_replicas=4), "default"),
        (dict(tpu_available=False, num_cluster_tasks=0, num_gpus=0, num_cpu_replicas=1), "default"),
    ],
)
def test_auto_order(facts, expected):
    assert choose_strategy_name(**facts) == expected


def test_auto_uses_the_simulated_cpu_replicas():
    strategy = keras_dist.resolve_strategy("auto")
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    assert strategy.num_replicas_in_sync == 4
    assert keras_dist.resolve_strategy("auto") is strategy
    assert keras_dist.resolve_strategy("mirrored") is strategy


def test_one_device_and_instances():
    one = keras_dist.resolve_strategy("one_device")
    assert isinstance(one, tf.distribute.OneDeviceStrategy) and one.num_replicas_in_sync == 1
    mine = tf.distribute.OneDeviceStrategy("/cpu:1")
    assert keras_dist.resolve_strategy(mine) is mine


def test_unknown_names_and_types_are_refused():
    with pytest.raises(ValueError, match="Unknown strategy name. Expected one of .*Received: strategy='horovod'"):
        keras_dist.resolve_strategy("horovod")
    with pytest.raises(TypeError, match="Received: strategy=3 of type int"):
        keras_dist.resolve_strategy(3)


@pytest.mark.parametrize(
    "cls", [tf.distribute.experimental.ParameterServerStrategy, tf.distribute.experimental.CentralStorageStrategy]
)
def test_unsupported_strategies_are_refused_up_front(cls):
    """`fit` under ParameterServerStrategy (unsupported in Keras 3, keras-team/keras#18624) failed with an opaque dataset error: now refused before any dataset or step, naming what works."""
    strategy = object.__new__(cls)  # isinstance is all the check needs; no cluster is started.
    with pytest.raises(ValueError, match=f"Received: strategy={cls.__name__}.*keras-team/keras#18624"):
        keras_dist.resolve_strategy(strategy)
    with pytest.raises(ValueError, match="parameter-server training"):
        keras_dist.DistributedModel(strategy=strategy)


def test_malformed_tf_config_is_refused(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{cluster: nope")
    with pytest.raises(ValueError, match="Invalid TF_CONFIG.*Received: TF_CONFIG='\\{cluster: nope'"):
        _resolve._num_cluster_tasks()
    cluster = {"chief": ["a:1"], "worker": ["b:1", "c:1"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 1}}))
    assert _resolve._num_cluster_tasks() == 3


def test_plan_describes_the_strategy(mirrored_1x2_cpu):
    plan = keras_dist.describe(mirrored_1x2_cpu)
    assert plan.strategy == "MirroredStrategy"
    assert (plan.num_workers, plan.task_type, plan.task_id, plan.num_replicas_in_sync) == (1, "worker", 0, 2)
    assert [d.split("/")[-1] for d in plan.devices] == ["device:CPU:0", "device:CPU:1"]
    assert plan.all_reduce == "ReductionToOneDevice"
    text = str(plan)
    assert "replicas in sync:     2" in text and "all-reduce:" in text
    assert keras_dist.is_chief(mirrored_1x2_cpu)


def test_plan_printed_once_per_strategy(monkeypatch, mirrored_1x2_cpu):
    monkeypatch.delenv("KERAS_DIST_QUIET", raising=False)
    monkeypatch.setattr(_plan, "_ANNOUNCED", set())
    printed = []
    _plan.announce(mirrored_1x2_cpu, print_fn=printed.append)
    _plan.announce(mirrored_1x2_cpu, print_fn=printed.append)
    assert len(printed) == 1 and printed[0].startswith("keras-dist plan")


def test_cpu_split_after_initialization_says_what_to_move():
    assert devices.simulate_cpu_replicas(4) == [d.name for d in tf.config.list_logical_devices("CPU")]
    with pytest.raises(
        RuntimeError, match=r"Cannot split the CPU into 2 replicas: TensorFlow already initialized .* with 4 CPU"
    ):
        keras_dist.simulate_cpu_replicas(2)
    with pytest.raises(ValueError, match="must be a positive integer. Received: num_replicas=0"):
        keras_dist.simulate_cpu_replicas(0)


@pytest.mark.parametrize("raw", ["two", "0", "-1"])
def test_cpu_replicas_env_must_be_positive(monkeypatch, raw):
    monkeypatch.setenv("KERAS_DIST_CPU_REPLICAS", raw)
    with pytest.raises(ValueError, match=f"Received: KERAS_DIST_CPU_REPLICAS='{raw}'"):
        devices.requested_cpu_replicas()


def test_non_tensorflow_backend_is_refused():
    with pytest.raises(ImportError, match="Received: KERAS_BACKEND='jax'. Fix: set KERAS_BACKEND=tensorflow"):
        keras_dist._require_tensorflow_backend("jax")
