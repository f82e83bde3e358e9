"""Read facts about a live `tf.distribute.Strategy` that TF keeps in private fields."""

import tensorflow as tf


def all_reduce_implementation(strategy):
    """Returns a short name for how `strategy` all-reduces gradients.

    Returns:
        String such as `"NcclAllReduce"`, `"ReductionToOneDevice"`,
        `"collective:RING"`, or `"none"` for one replica.
    """
    extended = strategy.extended
    options = getattr(extended, "_communication_options", None)
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and options is not None:
        return f"collective:{options.implementation.name}"
    if strategy.num_replicas_in_sync == 1:
        return "none"
    ops = getattr(extended, "_cross_device_ops", None) or getattr(extended, "_inferred_cross_device_ops", None)
    return type(ops).__name__ if ops is not None else "default"


def worker_devices(strategy):
    """Returns the device names this worker's replicas run on."""
    try:
        devices = strategy.extended.worker_devices
    except (RuntimeError, AttributeError):  # The default strategy has no device list.
        devices = None
    if devices:
        return list(devices)
    gpus = tf.config.list_logical_devices("GPU")
    return [(gpus or tf.config.list_logical_devices("CPU"))[0].name]
