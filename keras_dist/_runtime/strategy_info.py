"""Read facts about a live `tf.distribute.Strategy` that TF keeps in private fields."""

import threading

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


def in_nested_graph_of_replica():
    """Whether the code running now is in a graph nested in the replica function's (a branch, a loop body).

    TensorFlow's mirrored replica threads remember the graph the replica
    function is traced in (`_MirroredReplicaThread.graph`) and refuse
    `merge_call` from any other (`mirrored_run._merge_call`): the branches of
    `tf.cond`, the bodies of `tf.while_loop` and nested `tf.function`s each
    trace in a graph of their own. `False` outside a mirrored replica thread
    (one replica, eager code, other strategies).
    """
    replica_graph = getattr(threading.current_thread(), "graph", None)
    if replica_graph is None or tf.executing_eagerly():
        return False
    return tf.compat.v1.get_default_graph() is not replica_graph
