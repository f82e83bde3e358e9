"""What a strategy will do, in one short block printed once on the chief."""

import dataclasses
import functools
import os

import tensorflow as tf

from keras_dist import _env
from keras_dist._runtime import strategy_info
from keras_dist.strategy import _cluster

_ANNOUNCED: set[int] = set()


@dataclasses.dataclass(frozen=True)
class Plan:
    """The distribution plan of one process.

    Attributes:
        strategy: String, the `tf.distribute.Strategy` class name.
        num_workers: Integer, worker processes in the cluster.
        task_type: String, this worker's `TF_CONFIG` task type (`"worker"` alone).
        task_id: Integer, this worker's index among tasks of its type.
        num_replicas_in_sync: Integer, replicas in one synchronous step.
        devices: Tuple of strings, the devices of this worker's replicas.
        all_reduce: String, the gradient all-reduce implementation.
        communication: String, the `keras_dist.CommunicationOptions` of the
            first model announced (implementation, packing, timeout,
            compression), or `""`.
    """

    strategy: str
    num_workers: int
    task_type: str
    task_id: int
    num_replicas_in_sync: int
    devices: tuple
    all_reduce: str
    communication: str = ""

    def __str__(self) -> str:
        return "\n".join(
            [
                "keras-dist plan",
                f"  strategy:             {self.strategy}",
                f"  workers:              {self.num_workers} (this is {self.task_type}:{self.task_id})",
                f"  replicas in sync:     {self.num_replicas_in_sync}",
                f"  devices (this worker): {', '.join(self.devices)}",
                f"  all-reduce:           {self.all_reduce}",
            ]
            + ([f"  communication:        {self.communication}"] if self.communication else [])
        )


def cluster_info_of(strategy: tf.distribute.Strategy) -> _cluster.ClusterInfo:
    """Returns the `ClusterInfo` of the cluster `strategy` was created for (`LOCAL` without one)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return _cluster.LOCAL
    spec = resolver.cluster_spec().as_dict()
    return _cluster.ClusterInfo(
        cluster={kind: tuple(addresses) for kind, addresses in spec.items()},
        task_type=resolver.task_type,
        task_id=int(resolver.task_id or 0),
        source="strategy",
    )


def is_chief(strategy: tf.distribute.Strategy | None = None) -> bool:
    """Returns whether this process writes files and logs: task `chief`, or worker 0 without one.

    Args:
        strategy: A `tf.distribute.Strategy` whose cluster to ask, or `None`
            (the default) for the cluster `TF_CONFIG` or SLURM describes.

    Raises:
        ValueError: `strategy` is `None` and `TF_CONFIG` is set but invalid.
    """
    if strategy is None:
        return _cluster.cluster_from_environment().is_chief
    return cluster_info_of(strategy).is_chief


def describe(strategy: tf.distribute.Strategy, *, communication: str = "") -> Plan:
    """Returns the `Plan` of `strategy` for this process (`communication`: see `Plan`)."""
    info = cluster_info_of(strategy)
    return Plan(
        strategy=type(strategy).__name__.lstrip("_"),
        num_workers=info.num_workers,
        task_type=info.task_type,
        task_id=info.task_id,
        num_replicas_in_sync=strategy.num_replicas_in_sync,
        devices=tuple(strategy_info.worker_devices(strategy)),
        all_reduce=strategy_info.all_reduce_implementation(strategy),
        communication=communication,
    )


def announce(strategy, *, communication="", print_fn=None):
    """Prints the plan of `strategy` once per process, on the chief only.

    Set `KERAS_DIST_QUIET=1` to silence it.
    """
    if id(strategy) in _ANNOUNCED or not is_chief(strategy) or os.environ.get(_env.QUIET_ENV):
        return
    _ANNOUNCED.add(id(strategy))
    (print_fn or functools.partial(print, flush=True))(str(describe(strategy, communication=communication)))
