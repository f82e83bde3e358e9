"""Resolve `strategy=` (an instance or a name) to one `tf.distribute.Strategy` per process."""

import json
import os

import tensorflow as tf

from keras_dist._runtime import devices

STRATEGY_NAMES = ("auto", "mirrored", "multi_worker", "tpu", "one_device")

_SUPPORTED = (
    tf.distribute.MirroredStrategy,
    tf.distribute.MultiWorkerMirroredStrategy,
    tf.distribute.OneDeviceStrategy,
    tf.distribute.TPUStrategy,
)

# One strategy object per name and process: TensorFlow allows one multi-worker
# strategy per process, and models that share data must share their strategy.
_RESOLVED = {}


def choose_strategy_name(*, tpu_available, num_cluster_tasks, num_gpus, num_cpu_replicas):
    """Chooses what `strategy="auto"` means from facts about this machine.

    The order: a reachable TPU; `"multi_worker"` when the cluster has more than
    one task; `"mirrored"` over 2+ GPUs or 2+ simulated CPU replicas; otherwise
    `"default"` (TensorFlow's default strategy, one device).

    Args:
        tpu_available: Boolean, whether a TPU is reachable.
        num_cluster_tasks: Integer, the `chief` and `worker` tasks in `TF_CONFIG`
            (0 when unset).
        num_gpus: Integer, physical GPUs visible to this process.
        num_cpu_replicas: Integer, logical CPU devices (simulated replicas).

    Returns:
        One of `"tpu"`, `"multi_worker"`, `"mirrored"`, `"default"`.
    """
    if tpu_available:
        return "tpu"
    if num_cluster_tasks > 1:
        return "multi_worker"
    if num_gpus >= 2 or (num_gpus == 0 and num_cpu_replicas >= 2):
        return "mirrored"
    return "default"


def resolve_strategy(strategy="auto"):
    """Returns the `tf.distribute.Strategy` that `strategy` names.

    Args:
        strategy: A `tf.distribute.Strategy`, or one of `"auto"`, `"mirrored"`,
            `"multi_worker"`, `"tpu"`, `"one_device"`. Defaults to `"auto"`
            (see `choose_strategy_name` for the order).

    Returns:
        `tf.distribute.Strategy`. Names resolve to the same object every time
        in one process; `"auto"` inside `with some_strategy.scope():` is
        `some_strategy`.

    Raises:
        ValueError: An unknown name, or a strategy keras-dist cannot train with
            (`ParameterServerStrategy`, `CentralStorageStrategy`).
        TypeError: `strategy` is neither a string nor a strategy.
    """
    if isinstance(strategy, tf.distribute.Strategy):
        check_supported(strategy)
        return strategy
    if not isinstance(strategy, str):
        raise TypeError(
            "`strategy` must be a `tf.distribute.Strategy` or one of "
            f"{STRATEGY_NAMES}. Received: strategy={strategy!r} of type {type(strategy).__name__}."
        )
    if strategy not in STRATEGY_NAMES:
        raise ValueError(
            f"Unknown strategy name. Expected one of {STRATEGY_NAMES}. Received: "
            f"strategy={strategy!r}. Fix: pass one of these names or a "
            "`tf.distribute.Strategy` instance."
        )
    if strategy == "auto" and tf.distribute.has_strategy():
        current = tf.distribute.get_strategy()
        check_supported(current)
        return current
    name = _auto_name() if strategy == "auto" else strategy
    if name not in _RESOLVED:
        _RESOLVED[name] = _create(name)
    return _RESOLVED[name]


def check_supported(strategy):
    """Raises `ValueError` unless keras-dist can train with `strategy`.

    Keras 3 `fit` does not support parameter-server training
    (keras-team/keras#18624) and `CentralStorageStrategy` is experimental and
    untested with Keras 3.
    """
    if isinstance(strategy, _SUPPORTED) or _is_default(strategy):
        return
    raise ValueError(
        "keras-dist trains with MirroredStrategy, MultiWorkerMirroredStrategy, "
        "TPUStrategy, OneDeviceStrategy or the default strategy. Received: "
        f"strategy={type(strategy).__name__}. Keras 3 `fit` does not support "
        "parameter-server training (keras-team/keras#18624). Fix: use "
        "`strategy=\"multi_worker\"` (synchronous data parallelism across workers) "
        "or `strategy=\"auto\"`."
    )


def _is_default(strategy):
    return type(strategy).__name__ == "_DefaultDistributionStrategy"


def _auto_name():
    return choose_strategy_name(
        tpu_available=_tpu_address() is not None,
        num_cluster_tasks=_num_cluster_tasks(),
        num_gpus=len(devices.gpu_names()),
        num_cpu_replicas=devices.num_logical_cpus(),
    )


def _create(name):
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "tpu":
        address = _tpu_address()
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address or "")
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
        return tf.distribute.TPUStrategy(resolver)
    if name == "multi_worker":
        return tf.distribute.MultiWorkerMirroredStrategy()
    gpus = [f"/gpu:{i}" for i in range(len(devices.gpu_names()))]
    if name == "one_device":
        return tf.distribute.OneDeviceStrategy(gpus[0] if gpus else "/cpu:0")
    # "mirrored": all GPUs with NCCL, else every logical CPU device.
    if gpus:
        cross_device_ops = tf.distribute.NcclAllReduce() if len(gpus) > 1 else None
        return tf.distribute.MirroredStrategy(gpus, cross_device_ops=cross_device_ops)
    cpus = [f"/cpu:{i}" for i in range(devices.num_logical_cpus())]
    return tf.distribute.MirroredStrategy(cpus, cross_device_ops=tf.distribute.ReductionToOneDevice())


def _tpu_address():
    """Returns the TPU address to connect to ("" for a local TPU VM), or `None`."""
    for var in ("TPU_NAME", "COLAB_TPU_ADDR"):
        if os.environ.get(var):
            return os.environ[var]
    if tf.config.list_physical_devices("TPU"):
        return "local"
    return None


def _num_cluster_tasks():
    """Returns the number of `chief` and `worker` tasks in `TF_CONFIG` (0 when unset)."""
    raw = os.environ.get("TF_CONFIG", "").strip()
    if not raw:
        return 0
    try:
        cluster = json.loads(raw).get("cluster", {})
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(
            "`TF_CONFIG` must be a JSON object like "
            '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": 0}}. '
            f"Received: TF_CONFIG={raw[:200]!r}. Fix: repair or unset TF_CONFIG."
        ) from e
    return sum(len(cluster.get(kind, [])) for kind in ("chief", "worker"))
