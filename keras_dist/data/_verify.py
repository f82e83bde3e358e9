"""`verify_sharding`: which examples each worker and replica gets in one epoch."""

import collections
import dataclasses
import itertools
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf
from keras import tree

from keras_dist._runtime import iterator_release
from keras_dist._runtime import keras_internals as ki
from keras_dist.data import _creator, _distribute, _inputs, _sharding


@dataclasses.dataclass(frozen=True)
class ShardingReport:
    """What one epoch of an input looks like once distributed.

    Attributes:
        plan: The `InputPlan` the input was distributed with.
        examples_per_worker: Tuple of integers, examples each worker received.
        examples_per_replica: Tuple of integers, examples each replica
            received (`replica_id_in_sync_group` order).
        num_examples: Integer, examples received by all replicas together.
        expected_num_examples: Integer, examples in one undistributed pass
            (`None` for a `DatasetCreator`, which has no undistributed form).
        num_duplicated: Integer, examples received more often than they occur
            in the undistributed pass.
        num_missing: Integer, examples of the undistributed pass never received.
        comparison: String, how the examples were compared: `"whole pass"`
            (the received examples against one undistributed pass, in any
            order) or `"per step"` (each step's global batch on its own: no
            example more often than in the undistributed batch, none short).
            `"per step"` is used when `steps` cuts a pass of an input that
            selects other examples on each pass (a `shuffle` that reshuffles
            each iteration, before `repeat()` or `take`), where no two passes
            can be compared whole.
    """

    plan: _distribute.InputPlan
    examples_per_worker: tuple[int, ...]
    examples_per_replica: tuple[int, ...]
    num_examples: int
    expected_num_examples: int | None
    num_duplicated: int
    num_missing: int
    comparison: str = "whole pass"

    @property
    def every_example_once(self) -> bool:
        """Boolean: every example of the input was received exactly once."""
        return self.num_duplicated == 0 and self.num_missing == 0

    def __str__(self) -> str:
        expected = "" if self.expected_num_examples is None else f" of {self.expected_num_examples}"
        once = "every example once" + (" in its step" if self.comparison == "per step" else "")
        verdict = (
            once
            if self.every_example_once
            else (f"NOT {once}: {self.num_duplicated} duplicated, {self.num_missing} missing")
        )
        lines = [
            str(self.plan),
            f"  examples per worker:  {', '.join(map(str, self.examples_per_worker))}",
            f"  examples per replica: {', '.join(map(str, self.examples_per_replica))}",
            f"  one epoch:            {self.num_examples}{expected} examples, {verdict}",
        ]
        if self.comparison == "per step":
            lines.append(
                "  compared per step:    the input selects other examples on each pass (a shuffle that "
                "reshuffles each iteration, cut by `steps`), so each step's global batch was checked on "
                "its own; call without `steps` on a finite pass, or shuffle with "
                "reshuffle_each_iteration=False, to compare the whole pass"
            )
        return "\n".join(lines)


def verify_sharding(
    x: Any,
    y: Any = None,
    *,
    batch_size: int | None = None,
    example_id: Callable[[Any], tf.Tensor] | None = None,
    strategy: tf.distribute.Strategy | None = None,
    auto_shard_policy: str = "auto",
    steps: int | None = None,
) -> ShardingReport:
    """Runs one epoch of an input through the strategy and counts who got which example.

    The input is distributed exactly as `DistributedModel.fit` distributes it
    (same Keras data adapter, same auto-shard decision), then every replica's
    example ids are gathered and compared with one undistributed pass.

    Args:
        x: Anything `fit` accepts as `x`: NumPy arrays (or dicts of them), a
            `tf.data.Dataset`, a Python generator, a `keras.utils.PyDataset`,
            or a `keras_dist.data.DatasetCreator`.
        y: Optional targets, as for `fit`.
        batch_size: Integer global batch size for arrays (Keras' default 32).
            For a `tf.data.Dataset` it means the dataset yields single
            examples and is batched with it, as `fit(..., batch_size=)` does.
        example_id: Optional callable taking one batch as the dataset yields
            it (the whole element: `x`, `(x, y)` or `(x, y, sample_weight)`,
            global or per-replica) and returning an int64 tensor of shape
            `(batch_size,)` identifying each example. Defaults to a 64-bit
            fingerprint of each row of the first input (identical rows then
            count as one example seen twice; pass `example_id` when rows can
            repeat).
        strategy: A `tf.distribute.Strategy`; defaults to
            `keras_dist.resolve_strategy("auto")`.
        auto_shard_policy: String, `"auto"`, `"file"`, `"data"` or `"off"`, as
            for `DistributedModel`. Defaults to `"auto"`.
        steps: Integer steps in the epoch, for infinite inputs.

    Returns:
        A `ShardingReport` (identical on every worker).

    Raises:
        ValueError: `auto_shard_policy` is unknown, or Keras rejects the input.

    Distributed behavior:
        Collective: under multi-worker training every worker must call it with
        the same arguments. A generator is consumed: pass a fresh one.

    Example:
    >>> import numpy as np, keras_dist
    >>> from keras_dist.data import verify_sharding
    >>> report = verify_sharding(np.arange(37.0)[:, None], batch_size=8)
    >>> report.num_examples, report.every_example_once
    (37, True)
    """
    from keras_dist.strategy import resolve_strategy

    auto_shard_policy = _sharding.validate_auto_shard_policy(auto_shard_policy)
    strategy = strategy or resolve_strategy("auto")
    example_id = example_id or _fingerprint_rows
    source = _distribute.describe_source(x)
    reference_batches = make_dataset = None
    if isinstance(x, _creator.DatasetCreator):
        distributed = strategy.distribute_datasets_from_function(x, options=x.input_options)
        plan = _distribute.function_input_plan(strategy, "verify_sharding")
    else:
        make_dataset = _dataset_factory(x, y, strategy=strategy, batch_size=batch_size, steps=steps)
        reference_batches = _ids_of_dataset(make_dataset(), example_id, steps)
        dataset = make_dataset()
        distributed, plan = _distribute.distribute_dataset(
            strategy,
            dataset,
            usage="verify_sharding",
            source=source,
            distribute=strategy.experimental_distribute_dataset,
            auto_shard_policy=auto_shard_policy,
            batch_size=batch_size,
        )
    steps_ids, replicas = _gather_ids(strategy, distributed, example_id, steps)
    comparison = "whole pass"
    if steps is not None and make_dataset is not None:
        # Each pass of a reshuffling input cut by `steps` holds other examples: the
        # distributed pass can then only be compared with the reference step by step.
        again = _ids_of_dataset(make_dataset(), example_id, steps)
        if collections.Counter(_flat(again)) != collections.Counter(_flat(reference_batches)):
            comparison = "per step"
    return _report(plan, strategy, steps_ids, replicas, reference_batches, comparison)


def _first_input(batch):
    if isinstance(batch, tuple):
        batch = batch[0]
    return next(leaf for leaf in tree.flatten(batch) if leaf is not None)


def _fingerprint_rows(x):
    rows = _first_input(x)
    rows = tf.reshape(rows, [tf.shape(rows)[0], -1])
    if rows.dtype == tf.string:
        rows = tf.strings.to_hash_bucket_fast(tf.strings.reduce_join(rows, axis=1), 2**62)
        return tf.cast(rows, tf.int64)
    fingerprints = tf.fingerprint(tf.bitcast(tf.cast(rows, tf.float64), tf.uint8))
    return tf.bitcast(fingerprints, tf.int64)


def _dataset_factory(x, y, *, strategy, batch_size, steps):
    """Returns a function making the undistributed dataset of one epoch, as often as needed."""

    def adapt(inputs):
        prepared = _inputs.prepare(inputs, strategy=strategy, model=None, batch_size=batch_size)
        if isinstance(prepared, tf.data.Dataset) and batch_size:
            prepared = prepared.batch(batch_size)  # As fit batches a dataset of single examples.
        return ki.get_data_adapter(prepared, y, batch_size=batch_size, steps=steps).get_tf_dataset()

    if isinstance(x, types.GeneratorType):  # Consumed once: keep its batches for both passes.
        batches = list(itertools.islice(x, steps) if steps else x)
        return lambda: adapt(batch for batch in batches)
    dataset = adapt(x)
    return lambda: dataset


def _ids_of_dataset(dataset, example_id, steps=None):
    """Returns the example ids of each batch of one pass of `dataset`, as a list of lists."""
    return [
        np.asarray(example_id(_unwrap(batch))).reshape(-1).tolist()
        for batch in (dataset if steps is None else dataset.take(steps))
    ]


def _flat(batches):
    return [example for batch in batches for example in batch]


def _unwrap(batch):
    return tree.map_structure(lambda v: v.get_value() if isinstance(v, tf.experimental.Optional) else v, batch)


def _gather_ids(strategy, distributed, example_id, steps):
    """Each step's example ids (a list per step) and every replica's ids, one batch per call of a `tf.function`.

    The iterator is advanced inside the function, as Keras' own train step does:
    a multi-worker iterator decides whether any worker still has data with an
    all-reduce, which then runs in the graph instead of eagerly once per batch,
    and the function is traced once, not once per batch shape.
    """

    def replica_fn(batch):
        ids = tf.cast(tf.reshape(example_id(batch), [-1]), tf.int64)
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        return ids, tf.fill(tf.shape(ids), tf.cast(replica, tf.int64))

    @tf.function
    def step(iterator):
        ids, replicas = strategy.run(replica_fn, args=(next(iterator),))
        return strategy.gather(ids, axis=0), strategy.gather(replicas, axis=0)

    iterator = iter(distributed)
    if _inputs.releases_iterators_off_the_step(strategy):
        iterator_release.hold(iterator)  # Destroyed on a deleting thread, not in a later step of this one.
    all_ids, all_replicas = [], []
    for _ in itertools.count() if steps is None else range(steps):
        try:
            ids, replicas = step(iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            break
        all_ids.append(ids.numpy().tolist())
        all_replicas.extend(replicas.numpy().tolist())
    return all_ids, all_replicas


def _report(plan, strategy, steps_ids, replicas, reference_batches, comparison):
    num_replicas = strategy.num_replicas_in_sync
    per_replica = np.bincount(np.asarray(replicas, dtype=np.int64), minlength=num_replicas)[:num_replicas]
    per_worker = per_replica.reshape(plan.num_workers, -1).sum(axis=1)
    ids = _flat(steps_ids)
    received = collections.Counter(ids)
    if reference_batches is None:
        duplicated = sum(count - 1 for count in received.values() if count > 1)
        missing = 0
    elif comparison == "per step":
        duplicated = missing = 0
        for got, expected in itertools.zip_longest(steps_ids, reference_batches, fillvalue=[]):
            duplicated += max(0, (len(got) - len(set(got))) - (len(expected) - len(set(expected))))
            missing += max(0, len(set(expected)) - len(set(got)))
    else:
        reference_ids = collections.Counter(_flat(reference_batches))
        duplicated = sum((received - reference_ids).values())
        missing = sum((reference_ids - received).values())
    return ShardingReport(
        plan=plan,
        examples_per_worker=tuple(int(v) for v in per_worker),
        examples_per_replica=tuple(int(v) for v in per_replica),
        num_examples=len(ids),
        expected_num_examples=None if reference_batches is None else len(_flat(reference_batches)),
        num_duplicated=duplicated,
        num_missing=missing,
        comparison=comparison,
    )
