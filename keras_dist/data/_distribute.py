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
from keras_dist._runtime import distribute_dataset as runtime_distribute_dataset
from keras_dist._runtime import multi_worker as runtime_multi_worker
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
        per_step_check: String, with several workers: why TensorFlow does or
            does not ask the other workers before each step whether any still
            has data (one collective per step); empty with one worker.
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
    per_step_check: str = ""

    def __str__(self) -> str:
        if self.global_batch_size is None:
            batch = "set by each batch of the input (not known in advance)"
        else:
            split = ", ".join(map(str, cast(tuple, self.per_replica_batch_sizes)))  # set with global_batch_size
            batch = f"{self.global_batch_size} examples, per replica: {split}"
        lines = [f"keras-dist input ({self.usage}): {self.source}", f"  global batch size:   {batch}"]
        if self.auto_shard_policy is not None:
            lines.append(f"  worker sharding:     {self.auto_shard_policy.upper()} ({self.sharding_reason})")
        if self.per_step_check:
            lines.append(f"  end-of-data check:   {self.per_step_check}")
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


def distribute_dataset(
    strategy, dataset, *, usage, source, distribute, auto_shard_policy="auto", batch_size=None, batch_count_hint=None
):
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
        batch_count_hint: Tuple of integers that fixes the dataset's number of
            batches when its cardinality is unknown (Keras' arrays: their
            length and the arguments that split and batch them), or `None`.
            With several workers, `None` on every worker makes this call
            skip the agreement below; give it on all workers or on none.

    Returns:
        `(distributed_dataset, InputPlan)`.

    Raises:
        ValueError: `auto_shard_policy` is not a policy name.

    Distributed behavior:
        The sharding is decided by every worker alone, from the same dataset
        and cluster, so all workers decide the same. Warnings are given on
        the chief only. Under several workers with `batch_count_hint` given,
        one collective (`same_number_of_batches`): every worker must make the
        call, in the same order.
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
    if decision is None or batch_count_hint is None:
        return distribute(dataset), plan
    same, why = same_number_of_batches(strategy, dataset, decision.auto_shard_policy, batch_count_hint)
    if same:
        with runtime_distribute_dataset.without_per_step_agreement(strategy):
            distributed = distribute(dataset)
    else:
        distributed = distribute(dataset)
    if runtime_distribute_dataset.asks_every_step(distributed):
        check = f"one collective per step ({why})"
    else:
        check = f"none ({why})"
    return distributed, dataclasses.replace(plan, per_step_check=check)


def same_number_of_batches(strategy, dataset, auto_shard_policy, batch_count_hint=()):
    """Returns whether every worker's share of `dataset` has the same number of batches, and why.

    Sharded by DATA, each worker reads the whole dataset, and TensorFlow
    splits every global batch into one per-replica batch for each replica of
    every worker, an empty one where the global batch runs short (the
    legacy rebatch its auto-sharding puts in; `tests/integration/
    test_end_of_data_check.py` checks it on real workers). So each worker gets
    `num_replicas_per_worker` batches per global batch, and the workers
    have as many batches as each other exactly when their datasets have as
    many global batches: when the cardinality is known and the same
    everywhere, or, for Keras' arrays (cardinality unknown), when the arrays'
    length and the arguments that batch them are. Files sharded by FILE,
    unknown cardinalities (`filter`, generators, `PyDataset`) and
    `DatasetCreator`s give no such guarantee.

    Args:
        strategy: The multi-worker `tf.distribute.Strategy`.
        dataset: The `tf.data.Dataset` of global batches, as it will be distributed.
        auto_shard_policy: String, `"file"`, `"data"` or `"off"`.
        batch_count_hint: Tuple of integers that fixes the number of batches
            when the cardinality is unknown, or empty.

    Returns:
        `(same, reason)`: a boolean, the same on every worker, and a short
        reason for the input plan.

    Distributed behavior:
        Collective (one all-gather of a few integers): every worker must call
        it at the same point, with a hint of the same length.
    """
    size = 2 + _HINT_LENGTH
    hint = tuple(batch_count_hint or ())
    if len(hint) > _HINT_LENGTH:
        raise ValueError(f"batch_count_hint has at most {_HINT_LENGTH} integers. Received: {hint!r}.")
    cardinality = int(dataset.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY:
        key, why = (0,) * size, "the input repeats without end"
    elif auto_shard_policy != "data":
        key, why = (0,) * size, f"sharded by {auto_shard_policy.upper()}: the workers' batch counts may differ"
    elif cardinality >= 0:
        key, why = (1, cardinality) + (0,) * _HINT_LENGTH, f"every worker has {cardinality} global batches"
    elif hint:
        key, why = (
            (2, 0) + hint + (0,) * (_HINT_LENGTH - len(hint)),
            "every worker's arrays have the same length and batch size",
        )
    else:
        key, why = (0,) * size, "the number of batches is not known in advance"
    same = runtime_multi_worker.same_on_every_worker(strategy, key)
    if key[0] and not same:
        why = "the workers' inputs differ in length"
    return bool(key[0]) and same, why


_HINT_LENGTH = 4


def announce(plan, strategy, *, print_fn=None):
    """Prints `plan` on the chief, once per process for each distinct plan (`KERAS_DIST_QUIET=1` silences it)."""
    text = str(plan)
    if text in _PRINTED or os.environ.get(_env.QUIET_ENV) or not _plan.is_chief(strategy):
        return
    _PRINTED.add(text)
    (print_fn or functools.partial(print, flush=True))(text)
