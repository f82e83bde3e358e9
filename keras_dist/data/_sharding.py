"""Choosing the `tf.data` auto-shard policy that splits an input across workers.

Under `MultiWorkerMirroredStrategy` every worker builds the same input
pipeline and `tf.distribute` rewrites it so that each worker keeps its share
(TF guide "Distributed input", section "Sharding"):

- FILE: each worker reads a disjoint subset of the files. Cheapest, but needs
  at least one file per worker (otherwise TensorFlow fails on worker 0 and
  the other workers die in a collective, e.g. 1 TFRecord file for 2 workers).
- DATA: each worker reads everything and keeps every `num_workers`-th batch
  part. Always possible; costs each worker a full read of the input.
- OFF: no sharding; the pipeline must shard itself (e.g. with
  `tf.distribute.InputContext`), or every worker sees every example.
"""

import dataclasses
import warnings

import tensorflow as tf

from keras_dist import _compat, errors
from keras_dist._runtime import datasets as runtime_datasets

AUTO_SHARD_POLICIES = ("auto", "file", "data", "off")
_TF_POLICIES = {
    "auto": tf.data.experimental.AutoShardPolicy.AUTO,
    "file": tf.data.experimental.AutoShardPolicy.FILE,
    "data": tf.data.experimental.AutoShardPolicy.DATA,
    "off": tf.data.experimental.AutoShardPolicy.OFF,
}
_NAMES = {policy: name for name, policy in _TF_POLICIES.items()}
_WARNED: set[str] = set()


@dataclasses.dataclass(frozen=True)
class ShardingDecision:
    """The auto-shard policy chosen for one input, and why.

    Attributes:
        auto_shard_policy: String, `"file"`, `"data"` or `"off"` (never `"auto"`).
        num_files: Integer number of files the input reads, or `None` when it
            reads none (in-memory arrays, generators) or could not be counted.
        reason: String, one sentence for the plan.
        explicit: Boolean, whether the user chose the policy (no warning then).
        fix: String, what the user can change to get FILE sharding back (for
            the warning), or `""`.
    """

    auto_shard_policy: str
    num_files: int | None
    reason: str
    explicit: bool = False
    fix: str = ""


def validate_auto_shard_policy(policy: str | tf.data.experimental.AutoShardPolicy) -> str:
    """Returns `policy` lower-cased after checking it is a known policy name.

    Raises:
        ValueError: `policy` is not one of `"auto"`, `"file"`, `"data"`, `"off"`.
    """
    if isinstance(policy, tf.data.experimental.AutoShardPolicy):
        return _NAMES[policy]
    if not isinstance(policy, str) or policy.lower() not in AUTO_SHARD_POLICIES:
        raise ValueError(
            f"`auto_shard_policy` must be one of {AUTO_SHARD_POLICIES} (or a "
            f"tf.data.experimental.AutoShardPolicy). Received: auto_shard_policy={policy!r}."
        )
    return policy.lower()


def dataset_auto_shard_policy(dataset):
    """Returns the policy set in `dataset`'s `tf.data.Options`, as a string (`"auto"` if unset)."""
    return _NAMES[dataset.options().experimental_distribute.auto_shard_policy]


def choose_auto_shard_policy(dataset, num_workers, requested="auto", *, keep_order=False):
    """Chooses how `dataset` is split across `num_workers` workers.

    The rule: a policy set by the user (`requested`, else the dataset's own
    options) is kept, except FILE where it cannot give each example once,
    which becomes DATA. With AUTO, FILE is chosen when the dataset reads at
    least one file per worker and nothing after the files depends on stream
    position (`take`, `skip`, `zip`, ...) or caches in memory; DATA otherwise.
    `predict` (`keep_order=True`) always uses DATA, which keeps input order.

    Args:
        dataset: A `tf.data.Dataset`, as `fit` would receive it.
        num_workers: Integer, worker processes in the cluster.
        requested: String policy from `DistributedModel(auto_shard_policy=...)`;
            `"auto"` defers to the dataset's options. Defaults to `"auto"`.
        keep_order: Boolean, whether results must come back in input order
            (`predict`): FILE sharding reorders examples, DATA keeps them.

    Returns:
        A `ShardingDecision`.

    Raises:
        ValueError: `requested` is not a policy name.
    """
    requested = validate_auto_shard_policy(requested)
    policy = requested if requested != "auto" else dataset_auto_shard_policy(dataset)
    if policy in ("data", "off"):
        reason = {
            "data": "set by the user or by Keras for in-memory data",
            "off": "set by the user: the pipeline must shard itself",
        }[policy]
        return ShardingDecision(policy, None, reason, explicit=True)
    filenames = runtime_datasets.filenames_dataset(dataset)
    num_files = None if filenames is None else runtime_datasets.count_files(filenames)
    if filenames is not None and num_files is None:
        reason = "the list of files is unbounded (e.g. repeat() on the file names)"
        return ShardingDecision("data", None, reason)
    if num_files is not None and num_files >= num_workers:
        if keep_order:
            reason = "predict returns rows in input order; FILE sharding would reorder them"
            return ShardingDecision("data", num_files, reason, explicit=True)
        step = runtime_datasets.position_dependent_step(dataset)
        if step is not None:
            step = step.strip("_").replace("Dataset", "")
            reason = (
                f"the pipeline applies {step} after reading its files, which "
                "FILE sharding would apply to each worker's files separately"
            )
            fix = (
                "drop the repeat() (Keras then makes one pass over the data per epoch)"
                if step == "Repeat"
                else "apply take/skip/zip before reading the files (on the file names)"
            )
            return ShardingDecision("data", num_files, reason, fix=f"{fix}, or use a DatasetCreator")
        if _compat.is_active("file_sharding_cache") and runtime_datasets.has_cache_after_files(dataset):
            reason = (
                "the pipeline caches what it reads (`cache()`, or TFDS' autocache), and a filled "
                "cache would give every worker every example under FILE sharding"
            )
            fix = (
                "remove the cache(), or with TFDS pass read_config=tfds.ReadConfig(try_autocache=False), "
                "or read per worker with a keras_dist.data.DatasetCreator and tfds.ReadConfig(input_context=...)"
            )
            return ShardingDecision("data", num_files, reason, fix=fix)
        return ShardingDecision("file", num_files, f"{num_files} files for {num_workers} workers")
    if num_files is None:
        reason = "the input reads no files (in-memory data or a generator)"
    else:
        reason = f"FILE sharding needs at least one file per worker; {num_files} file(s) for {num_workers} workers"
    fix = f"write the data as at least {num_workers} files (several per worker is better)"
    return ShardingDecision("data", num_files, reason, fix=fix)


_RUN_WHOLE_PER_WORKER = ("Python generator", "keras.utils.PyDataset")


def warn_once(decision, num_workers, source):
    """Warns, once per process and reason, when each worker must read all of an input.

    Two cases: a file-based input sharded by DATA (each worker reads every
    file), and a generator or `PyDataset` (each worker runs it whole). DATA
    for in-memory arrays is what Keras does anyway: reported in the plan, not
    warned about. Nothing is said for a policy the user chose.

    Args:
        decision: The `ShardingDecision` for the input.
        num_workers: Integer, worker processes in the cluster.
        source: String, the kind of input (`InputPlan.source`).
    """
    if decision.explicit or decision.auto_shard_policy != "data":
        return
    if decision.num_files is not None:
        key = decision.reason
        message = (
            f"Sharding the input by DATA: {decision.reason}. Each of the {num_workers} workers reads "
            f"all {decision.num_files} file(s) and keeps 1/{num_workers} of the examples, so input "
            f"reading costs {num_workers}x what FILE sharding would. Every example is still used once "
            f"per epoch. Fix: {decision.fix}, or set auto_shard_policy='data' to say this is intended."
        )
    elif source in _RUN_WHOLE_PER_WORKER:
        key = source
        message = (
            f"Sharding a {source} by DATA: each of the {num_workers} workers runs the whole {source} "
            f"and keeps 1/{num_workers} of every batch (it must yield the same batches in the same "
            "order on every worker). Fix: to have each worker produce only its share, pass a "
            "`keras_dist.data.DatasetCreator` that builds a tf.data pipeline per worker, or set "
            "auto_shard_policy='data' to say this is intended."
        )
    else:
        return
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, errors.KerasDistWarning, stacklevel=3)


def with_auto_shard_policy(
    dataset: tf.data.Dataset, policy: str | tf.data.experimental.AutoShardPolicy
) -> tf.data.Dataset:
    """Returns `dataset` with its auto-shard policy option set to `policy`.

    Args:
        dataset: A `tf.data.Dataset`.
        policy: String, one of `"auto"`, `"file"`, `"data"`, `"off"`.

    Returns:
        A `tf.data.Dataset` with the same elements.

    Raises:
        ValueError: `policy` is not a policy name.

    Example:
    >>> import tensorflow as tf
    >>> from keras_dist.data import with_auto_shard_policy
    >>> ds = with_auto_shard_policy(tf.data.Dataset.range(4), "data")
    >>> ds.options().experimental_distribute.auto_shard_policy.name
    'DATA'
    """
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = _TF_POLICIES[validate_auto_shard_policy(policy)]
    return dataset.with_options(options)
