"""Simulated CPU replicas: split the host CPU into N logical devices.

TensorFlow fixes its logical devices the first time it runs an op; after that
the split cannot change. Everything here therefore runs before any op, and
fails with a message saying what to move when it is too late.
"""

import os

import tensorflow as tf

from keras_dist._env import CPU_REPLICAS_ENV


def requested_cpu_replicas():
    """Returns the number of CPU replicas asked for with `KERAS_DIST_CPU_REPLICAS`.

    Returns:
        Integer >= 1, or `None` when the variable is unset or empty.

    Raises:
        ValueError: The variable is set to something other than a positive integer.
    """
    raw = os.environ.get(CPU_REPLICAS_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"`{CPU_REPLICAS_ENV}` must be a positive integer (the number of "
            f"simulated CPU replicas). Received: {CPU_REPLICAS_ENV}={raw!r}. "
            f"Fix: `export {CPU_REPLICAS_ENV}=2`, or unset it for one device."
        )
    return value


def simulate_cpu_replicas(num_replicas: int) -> list[str]:
    """Splits the first physical CPU into `num_replicas` logical devices.

    Calling it again with the same count is a no-op, so scripts and test
    fixtures may both call it.

    Args:
        num_replicas: Integer >= 1, the number of logical CPU devices
            (`/device:CPU:0` ... `/device:CPU:{num_replicas - 1}`).

    Returns:
        List of logical CPU device names, `num_replicas` long.

    Raises:
        ValueError: `num_replicas` is not a positive integer.
        RuntimeError: TensorFlow already initialized its devices with a
            different number of CPU devices.

    References:
        TensorFlow guide, "Logical device configuration",
        https://www.tensorflow.org/guide/gpu#using_multiple_gpus (same API on CPU).
    """
    _split_cpu(num_replicas)
    return _cpu_device_names()


def _split_cpu(num_replicas):
    """Configures `num_replicas` logical CPU devices without initializing TensorFlow's context."""
    if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
        raise ValueError(f"`num_replicas` must be a positive integer. Received: num_replicas={num_replicas!r}.")
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) == num_replicas:
        return
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * num_replicas)
    except RuntimeError as e:
        have = num_logical_cpus()  # this worker's devices, not the whole cluster's
        if have == num_replicas:
            return
        raise RuntimeError(
            f"Cannot split the CPU into {num_replicas} replicas: TensorFlow already "
            f"initialized its devices with {have} CPU device(s). The split must "
            "happen before the first TensorFlow op. Fix: call "
            f"`keras_dist.simulate_cpu_replicas({num_replicas})` right after "
            "`import keras_dist`, before building data or models, or set "
            f"`{CPU_REPLICAS_ENV}={num_replicas}` before starting Python. With several "
            f"workers, keras_dist joined the cluster at import: pass `--cpu-replicas {num_replicas}` "
            "to `keras-dist launch` (or set that variable for every worker) instead."
        ) from e


def apply_requested_cpu_replicas():
    """Applies `KERAS_DIST_CPU_REPLICAS` if set; called once when keras_dist is imported.

    Returns:
        The number of replicas applied, or `None` when none were requested.
    """
    requested = requested_cpu_replicas()
    if requested and requested > 1:
        _split_cpu(requested)
    return requested


def _cpu_device_names():
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def num_logical_cpus():
    """Returns the number of logical CPU devices TensorFlow has (or will have)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    configured = tf.config.get_logical_device_configuration(cpu)
    return len(configured) if configured else 1


def gpu_names():
    """Returns the physical GPU device names, e.g. `["/physical_device:GPU:0"]`."""
    return [d.name for d in tf.config.list_physical_devices("GPU")]


def onednn_enabled():
    """Returns whether TensorFlow runs its oneDNN CPU kernels in this process.

    `TF_ENABLE_ONEDNN_OPTS=1` turns them on, `0` off; unset, TensorFlow
    decides from the CPU (on for some recent x86 CPUs). Private API:
    `tensorflow.python.util._pywrap_util_port.IsMklEnabled`; where it is
    missing, the environment variable alone decides (unset counts as off).
    """
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:
        return os.environ.get("TF_ENABLE_ONEDNN_OPTS", "0").strip().lower() in ("1", "true")
    return bool(_pywrap_util_port.IsMklEnabled())
