"""Resolve `strategy=` (an instance or a name) to one `tf.distribute.Strategy` per process."""

import math
import os
import re

import tensorflow as tf

from keras_dist import _compat, _env
from keras_dist._process import is_keras_dist_command
from keras_dist._runtime import devices, multi_worker
from keras_dist.strategy import _cluster, _peer_errors

STRATEGY_NAMES = ("auto", "mirrored", "multi_worker", "tpu", "one_device")

_SUPPORTED = (
    tf.distribute.MirroredStrategy,
    tf.distribute.MultiWorkerMirroredStrategy,
    tf.distribute.OneDeviceStrategy,
    tf.distribute.TPUStrategy,
)

# One strategy object per name and process: TensorFlow allows one multi-worker
# strategy per process, and models that share data must share their strategy.
_RESOLVED: dict[str, tf.distribute.Strategy] = {}


def choose_strategy_name(*, tpu_available: bool, num_cluster_tasks: int, num_gpus: int, num_cpu_replicas: int) -> str:
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


def resolve_strategy(strategy: str | tf.distribute.Strategy = "auto") -> tf.distribute.Strategy:
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
        RuntimeError: `"tpu"` where TensorFlow cannot reach or initialize a TPU
            (the message says what was found and what to install).
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


def check_supported(strategy: tf.distribute.Strategy) -> None:
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
        '`strategy="multi_worker"` (synchronous data parallelism across workers) '
        'or `strategy="auto"`.'
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
        return _create_tpu()
    if name == "multi_worker":
        return _create_multi_worker(_cluster.cluster_from_environment())
    gpus = [f"/gpu:{i}" for i in range(len(devices.gpu_names()))]
    if name == "one_device":
        return tf.distribute.OneDeviceStrategy(gpus[0] if gpus else "/cpu:0")
    # "mirrored": all GPUs with NCCL, else every logical CPU device.
    if gpus:
        cross_device_ops = tf.distribute.NcclAllReduce() if len(gpus) > 1 else None
        return tf.distribute.MirroredStrategy(gpus, cross_device_ops=cross_device_ops)
    cpus = [f"/cpu:{i}" for i in range(devices.num_logical_cpus())]
    return tf.distribute.MirroredStrategy(cpus, cross_device_ops=tf.distribute.ReductionToOneDevice())


def _create_tpu():
    """Connects to the TPU and initializes it; raises `RuntimeError` saying what to do where there is none."""
    address = _tpu_address()
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address or "")
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, tf.errors.OpError) as e:
        raise RuntimeError(no_tpu_message(address, e)) from None
    return tf.distribute.TPUStrategy(resolver)


def no_tpu_message(address: str | None, error: Exception) -> str:
    """Returns what `strategy="tpu"` says when TensorFlow cannot connect to a TPU or initialize it.

    Args:
        address: String, the TPU address tried (`TPU_NAME`, `COLAB_TPU_ADDR`, `"local"`), or `None`
            (none found).
        error: The exception TensorFlow raised.
    """
    from importlib import metadata

    def installed(dist):
        name = re.sub(r"[-_.]+", "-", dist).lower()  # As pip spells it: tensorflow_tpu -> tensorflow-tpu.
        try:
            return f"{name} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            return f"no {name}"

    providers = dict.fromkeys(metadata.packages_distributions().get("tensorflow", []))
    tensorflow = ", ".join(installed(dist) for dist in providers) or f"tensorflow {tf.__version__}"
    libtpu = installed("libtpu")
    found = ", ".join(device.name.replace("/physical_device:", "") for device in tf.config.list_physical_devices())
    where = (
        f"the TPU at {address!r}"
        if address
        else "a TPU: TPU_NAME and COLAB_TPU_ADDR are unset and TensorFlow lists no TPU device"
    )
    detail = str(getattr(error, "message", None) or error).strip().splitlines()
    return (
        'strategy="tpu" needs a TPU that TensorFlow can reach. Expected: a Colab TPU runtime or Cloud TPU VM '
        "(TensorFlow lists its TPU devices), or TPU_NAME naming a Cloud TPU. "
        f"Received: TensorFlow could not connect to {where} (devices: {found}; installed: {tensorflow}, {libtpu}). "
        f"TensorFlow said: {type(error).__name__}: {detail[0][:300] if detail else ''} "
        "Fix: on Colab choose Runtime > Change runtime type > TPU and run the notebook's install cell "
        "(tensorflow-tpu and a libtpu that imports; docs/getting_started.md#tpu); on a Cloud TPU VM install "
        'tensorflow-tpu; on a machine without a TPU use strategy="auto".'
    )


def _tpu_address():
    """Returns the TPU address to connect to ("" for a local TPU VM), or `None`."""
    for var in ("TPU_NAME", "COLAB_TPU_ADDR"):
        if os.environ.get(var):
            return os.environ[var]
    if tf.config.list_physical_devices("TPU"):
        return "local"
    return None


def _num_cluster_tasks():
    """Returns the number of `chief` and `worker` tasks in the cluster (0 without one)."""
    info = _cluster.cluster_from_environment()
    return 0 if info.source == "local" else info.num_workers


def timeouts_from_environment(environ=None):
    """Returns the multi-worker timeouts, in seconds, from `KERAS_DIST_*_TIMEOUT` variables.

    Args:
        environ: Mapping of environment variables. Defaults to `os.environ`.

    Returns:
        Dict with `startup_timeout_seconds` (`KERAS_DIST_STARTUP_TIMEOUT`, default
        300: how long workers wait for each other at start),
        `heartbeat_timeout_seconds` (`KERAS_DIST_HEARTBEAT_TIMEOUT`, default 30:
        how long a worker may stop answering before the others fail) and
        `collective_timeout_seconds` (`KERAS_DIST_COLLECTIVE_TIMEOUT`, default 0
        = none: the longest one all-reduce may wait; TensorFlow starts a thread
        per collective to enforce it, so it is meant for debugging).

    Raises:
        ValueError: A variable is not a number, or is negative (0 is allowed
            only for the collective timeout).
    """
    environ = os.environ if environ is None else environ
    timeouts = {}
    for key, var, default, minimum in _TIMEOUTS:
        raw = environ.get(var, "").strip()
        try:
            value = float(raw) if raw else default
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < minimum:
            raise ValueError(
                f"`{var}` must be a number of seconds{' > 0' if minimum else ' >= 0'}. "
                f"Received: {var}={raw!r}. Fix: set it to e.g. {default:g}, or unset it."
            )
        timeouts[key] = value
    return timeouts


_TIMEOUTS = (
    ("startup_timeout_seconds", _env.STARTUP_TIMEOUT_ENV, 300.0, 1e-3),
    ("heartbeat_timeout_seconds", _env.HEARTBEAT_TIMEOUT_ENV, 30.0, 1.0),
    ("collective_timeout_seconds", _env.COLLECTIVE_TIMEOUT_ENV, 0.0, 0),
)


def _create_multi_worker(info):
    """Creates the process's `MultiWorkerMirroredStrategy`; blocks until every worker joined."""
    if info.source == "local":
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    else:
        num_gpus = len(devices.gpu_names())
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({kind: list(addresses) for kind, addresses in info.cluster.items()}),
            task_type=info.task_type,
            task_id=info.task_id,
            rpc_layer="grpc",
            num_accelerators={"GPU": num_gpus} if num_gpus else None,
        )
    timeouts = timeouts_from_environment()
    try:
        strategy = multi_worker.create_strategy(resolver, num_cpu_replicas=devices.num_logical_cpus(), **timeouts)
        if _compat.is_active("sigterm_default_action"):
            multi_worker.restore_default_sigterm()
        return strategy
    except RuntimeError as e:
        if "program startup" not in str(e):
            raise
        raise RuntimeError(
            f"[{info.task_name}] MultiWorkerMirroredStrategy must be created before TensorFlow "
            "runs its first operation, and TensorFlow already ran one in this process. "
            "Fix: put `import keras_dist` at the top of the script, before any code that creates "
            "a tensor, a dataset or a model (keras_dist then joins the cluster at import). "
            "See docs/troubleshooting.md#program-startup."
        ) from None
    except (tf.errors.DeadlineExceededError, tf.errors.UnavailableError) as e:
        raise _peer_errors.worker_unavailable_error(info, e.message, during="startup", timeouts=timeouts) from None


JOIN_AT_IMPORT_ENV = _env.JOIN_AT_IMPORT_ENV


def join_cluster_at_import(orig_argv=None, environ=None):
    """Creates the multi-worker strategy now when the environment describes a cluster.

    TensorFlow accepts `MultiWorkerMirroredStrategy` only before its first
    operation, so `import keras_dist` joins the cluster (`TF_CONFIG` or SLURM
    with more than one training task) at once; the script may then build data,
    reference models and DistributedModels in any order. Then Python, NumPy,
    TensorFlow and Keras are seeded with one seed shared by all workers (drawn
    on the chief), so unseeded shuffles agree and every example is seen once
    per epoch (a seed the script set with `keras.utils.set_random_seed` before
    the import is kept). Skipped in the `keras-dist` command itself and when
    `KERAS_DIST_JOIN_AT_IMPORT=0`.

    Args:
        orig_argv: List of strings, the interpreter's command line (defaults
            to `sys.orig_argv`).
        environ: Mapping of environment variables. Defaults to `os.environ`.

    Returns:
        The `tf.distribute.Strategy` created, or `None` when nothing was done.

    Raises:
        ValueError: `TF_CONFIG` is invalid, or a `KERAS_DIST_*_TIMEOUT` is not a number.
        RuntimeError: TensorFlow already ran an operation in this process.
        keras_dist.errors.WorkerUnavailableError: Some workers did not join
            within `KERAS_DIST_STARTUP_TIMEOUT` seconds.

    Distributed behavior:
        Collective: blocks until every worker of the cluster has joined.
    """
    environ = os.environ if environ is None else environ
    if environ.get(JOIN_AT_IMPORT_ENV, "1") == "0" or is_keras_dist_command(orig_argv):
        return None
    info = _cluster.cluster_from_environment(environ)
    timeouts_from_environment(environ)
    if info.source == "local" or info.num_workers < 2:
        return None
    strategy = resolve_strategy("multi_worker")
    try:
        multi_worker.share_random_seed(strategy)
    except (tf.errors.InternalError, tf.errors.InvalidArgumentError) as e:
        if "group" not in e.message:
            raise
        raise RuntimeError(
            f"[{info.task_name}] The workers have different numbers of replicas: this worker has "
            f"{len(strategy.extended.worker_devices)} and another worker a different number. "
            "Received from TensorFlow: "
            f"{e.message.strip().splitlines()[0][:300]} Fix: give every worker the same devices: the "
            f"same --cpu-replicas ({_env.CPU_REPLICAS_ENV}) and the same number of visible GPUs."
        ) from None
    return strategy
