"""Turning one input pipeline into per-replica batches, and saying how in the input plan.

Every Keras input (arrays, generators, `PyDataset`, `tf.data`, TFDS) reaches
`tf.distribute` as one `tf.data.Dataset` of global batches built by Keras' own
data adapters. `distribute_dataset` is the single place where keras-dist
chooses the auto-shard policy and hands the dataset to the strategy; `fit`,
`evaluate`, `predict` and `verify_sharding` all go through it.
"""

import dataclasses
import functools
import os
import types
from typing import cast

import keras
import tensorflow as tf

from keras_dist import _env
from keras_dist._runtime import datasets as runtime_datasets
from keras_dist.data import _creator, _sharding
from keras_dist.strategy import _plan

_PRINTED: set[str] = set()


@dataclasses.dataclass(frozen=True)
class InputPlan:
    """How one input is split across workers and replicas.

    Attributes:
        usage: String, what the input is for: `"fit"`, `"validation"`,
            `"evaluate"`, `"predict"` or `"verify_sharding"`.
        source: String, the kind of input (`"NumPy arrays"`, `"tf.data.Dataset"`, ...).
        num_workers: Integer, worker processes in the cluster.
        num_replicas_in_sync: Integer, replicas over all workers.
        auto_shard_policy: String, `"file"`, `"data"` or `"off"`; `None` with one worker.
        num_files: Integer, files the input reads, or `None` (none, or not counted).
        sharding_reason: String, why that policy.
        global_batch_size: Integer examples per step over all replicas, or
            `None` when the input sets it per batch (generators, unbatched shapes).
        per_replica_batch_sizes: Tuple of integers, examples per replica in a
            full global batch (they differ by at most one), or `None`.
    """

    usage: str
    source: str
    num_workers: int
    num_replicas_in_sync: int
    auto_shard_policy: str | None
    num_files: int | None
    sharding_reason: str
    global_batch_size: int | None
    per_replica_batch_sizes: tuple[int, ...] | None

    def __str__(self) -> str:
        if self.global_batch_size is None:
            batch = "set by each batch of the input (not known in advance)"
        else:
            split = ", ".join(map(str, cast(tuple, self.per_replica_batch_sizes)))  # set with global_batch_size
            batch = f"{self.global_batch_size} examples, per replica: {split}"
        lines = [f"keras-dist input ({self.usage}): {self.source}", f"  global batch size:   {batch}"]
        if self.auto_shard_policy is not None:
            lines.append(f"  worker sharding:     {self.auto_shard_policy.upper()} ({self.sharding_reason})")
        return "\n".join(lines)


def describe_source(x):
    """Returns a short name for the kind of Keras input `x` (for the plan and warnings)."""
    if isinstance(x, tf.data.Dataset):
        return "tf.data.Dataset"
    if isinstance(x, keras.utils.PyDataset):
        return "keras.utils.PyDataset"
    if isinstance(x, types.GeneratorType) or (hasattr(x, "__next__") and hasattr(x, "__iter__")):
        return "Python generator"
    if isinstance(x, dict):
        return "dict of arrays"
    if isinstance(x, (list, tuple)):
        return "arrays"
    if is_distributed(x):
        return "distributed dataset"
    return "NumPy arrays" if hasattr(x, "shape") else type(x).__name__


def is_distributed(x):
    """Returns whether `x` is already distributed (a `DatasetCreator`, or a tf.distribute dataset)."""
    return isinstance(x, _creator.DatasetCreator) or (
        type(x).__module__.startswith("tensorflow") and "Distributed" in type(x).__name__
    )


def function_input_plan(strategy, usage):
    """Returns the `InputPlan` of a `DatasetCreator`: no auto-sharding, batches set by the function."""
    return InputPlan(
        usage=usage,
        source="DatasetCreator",
        num_workers=_plan.cluster_info_of(strategy).num_workers,
        num_replicas_in_sync=strategy.num_replicas_in_sync,
        auto_shard_policy="off",
        num_files=None,
        sharding_reason="the input function shards itself",
        global_batch_size=None,
        per_replica_batch_sizes=None,
    )


def distribute_dataset(strategy, dataset, *, usage, source, distribute, auto_shard_policy="auto", batch_size=None):
    """Chooses the sharding of `dataset` and distributes it with `distribute`.

    Args:
        strategy: The `tf.distribute.Strategy`.
        dataset: A `tf.data.Dataset` of global batches.
        usage: String, see `InputPlan.usage`.
        source: String, see `InputPlan.source`.
        distribute: The strategy's own `experimental_distribute_dataset`.
        auto_shard_policy: String, the user's choice (`"auto"` to decide here).
        batch_size: Integer global batch size known to the caller (Keras'
            `batch_size` argument for arrays), used when the dataset's shape
            does not say it.

    Returns:
        `(distributed_dataset, InputPlan)`.

    Raises:
        ValueError: `auto_shard_policy` is not a policy name.

    Distributed behavior:
        Not a collective: every worker decides alone, from the same dataset
        and cluster, so all workers decide the same. Warnings are given on
        the chief only.
    """
    info = _plan.cluster_info_of(strategy)
    num_workers = info.num_workers
    decision = None
    if num_workers > 1:
        decision = _sharding.choose_auto_shard_policy(
            dataset, num_workers, auto_shard_policy, keep_order=usage == "predict"
        )
        dataset = _sharding.with_auto_shard_policy(dataset, decision.auto_shard_policy)
        if info.is_chief:
            _sharding.warn_once(decision, num_workers, source)
    global_batch_size = runtime_datasets.batch_size_of(dataset) or batch_size
    num_replicas = strategy.num_replicas_in_sync
    plan = InputPlan(
        usage=usage,
        source=source,
        num_workers=num_workers,
        num_replicas_in_sync=num_replicas,
        auto_shard_policy=None if decision is None else decision.auto_shard_policy,
        num_files=None if decision is None else decision.num_files,
        sharding_reason="" if decision is None else decision.reason,
        global_batch_size=global_batch_size,
        per_replica_batch_sizes=(
            runtime_datasets.replica_batch_sizes(global_batch_size, num_replicas) if global_batch_size else None
        ),
    )
    return distribute(dataset), plan


def announce(plan, strategy, *, print_fn=None):
    """Prints `plan` on the chief, once per process for each distinct plan (`KERAS_DIST_QUIET=1` silences it)."""
    text = str(plan)
    if text in _PRINTED or os.environ.get(_env.QUIET_ENV) or not _plan.is_chief(strategy):
        return
    _PRINTED.add(text)
    (print_fn or functools.partial(print, flush=True))(text)
