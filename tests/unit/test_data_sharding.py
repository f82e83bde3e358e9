"""Inputs on one worker with N replicas: every example once, the plan, the auto-shard rule.

The multi-worker half (2x1, 2x2, the 1-file TFRecord case) is in
tests/integration/test_input_sharding.py.
"""

import keras
import numpy as np
import pytest
import sharding_workload
import tensorflow as tf

import keras_dist
from keras_dist.data import DatasetCreator, _sharding, verify_sharding, with_auto_shard_policy
from keras_dist.testing import assert_matches_single_device, max_weight_difference

KINDS_ONE_WORKER = [k for k in sharding_workload.INPUT_KINDS]


@pytest.mark.parametrize("kind", KINDS_ONE_WORKER)
def test_every_input_kind_sees_each_example_once_mirrored_1x2_cpu(kind, mirrored_1x2_cpu, tmp_path):
    counts = sharding_workload.seen_counts(keras_dist.DistributedModel, kind, str(tmp_path), strategy=mirrored_1x2_cpu)
    sharding_workload.assert_each_example_once(counts, kind)


@pytest.mark.parametrize("kind", ["numpy", "generator", "tfrecord_4_files"])
def test_uneven_split_over_3_replicas_sees_each_example_once(kind, mirrored_1x3_cpu, tmp_path):
    counts = sharding_workload.seen_counts(keras_dist.DistributedModel, kind, str(tmp_path), strategy=mirrored_1x3_cpu)
    sharding_workload.assert_each_example_once(counts, kind)


def test_input_plan_gives_global_and_per_replica_batch(mirrored_1x3_cpu, tmp_path):
    model, _ = sharding_workload.build(keras_dist.DistributedModel, "numpy", strategy=mirrored_1x3_cpu)
    x = sharding_workload.ids()
    model.fit(x, x, batch_size=8, epochs=1, verbose=0)
    plan = model.input_plan
    assert (plan.usage, plan.source, plan.global_batch_size) == ("fit", "NumPy arrays", 8)
    assert plan.per_replica_batch_sizes == (3, 3, 2)
    assert plan.auto_shard_policy is None  # one worker: nothing to shard across workers
    assert "8 examples, per replica: 3, 3, 2" in str(plan)
    model.evaluate(tf.data.Dataset.from_tensor_slices((x, x)).batch(6), verbose=0)
    assert (model.input_plan.usage, model.input_plan.global_batch_size) == ("evaluate", 6)


def test_unbatched_dataset_without_batch_size_is_refused(mirrored_1x2_cpu):
    model, _ = sharding_workload.build(keras_dist.DistributedModel, "dataset", strategy=mirrored_1x2_cpu)
    x = sharding_workload.ids()
    with pytest.raises(ValueError, match=r"yields single examples, not batches.*dataset.batch\(global_batch_size\)"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, x)), epochs=1, verbose=0)


def test_unbatched_dataset_with_batch_size_trains_like_batched(mirrored_1x2_cpu):
    x = np.random.RandomState(0).rand(37, 1).astype("float32")
    models = []
    for dataset, batch_size in [
        (tf.data.Dataset.from_tensor_slices((x, 2 * x)).batch(8), None),
        (tf.data.Dataset.from_tensor_slices((x, 2 * x)), 8),
    ]:
        inputs = keras.Input((1,))
        model = keras_dist.DistributedModel(
            inputs, keras.layers.Dense(1, kernel_initializer="ones")(inputs), strategy=mirrored_1x2_cpu
        )
        model.compile(optimizer="sgd", loss="mse")
        model.fit(dataset, batch_size=batch_size, epochs=2, verbose=0)
        models.append(model)
    assert max_weight_difference(*models) < 1e-6


def test_dataset_creator_matches_single_device(mirrored_1x2_cpu):
    x = np.random.RandomState(1).rand(32, 2).astype("float32")
    y = x @ np.array([[1.0], [-1.0]], "float32")

    def dataset_fn(input_context):
        batch = input_context.get_per_replica_batch_size(8)
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)

    def build(model_class, **kwargs):
        inputs = keras.Input((2,))
        model = model_class(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(inputs), **kwargs)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    reference = build(keras.Model)
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    model = build(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu)
    model.fit(DatasetCreator(dataset_fn), epochs=2, verbose=0)
    assert max_weight_difference(reference, model) < 1e-6
    assert model.input_plan.source == "DatasetCreator"


def test_dataset_creator_rejects_non_callables_and_non_datasets():
    with pytest.raises(TypeError, match="must be a callable"):
        DatasetCreator([1, 2])
    with pytest.raises(TypeError, match="must return a tf.data.Dataset. Received: list"):
        DatasetCreator(lambda context: [1, 2])(tf.distribute.InputContext())


def _OfPredictions(metric_class):
    class OfPredictions(metric_class):
        def update_state(self, y_true, y_pred, sample_weight=None):
            return super().update_state(y_pred, sample_weight=sample_weight)

    return OfPredictions


@pytest.mark.parametrize("num_examples", [1, 2, 5, 37])
def test_evaluate_and_predict_exact_on_any_size(num_examples, mirrored_1x3_cpu):
    """Sizes below the replica count included: sums, counts, means equal one device's; rows in order."""
    rs = np.random.RandomState(num_examples)
    x = rs.rand(num_examples, 3).astype("float32")
    y = rs.randint(0, 2, (num_examples, 1)).astype("float32")

    def build(model_class, **kwargs):
        inputs = keras.Input((3,))
        outputs = keras.layers.Dense(1, activation="sigmoid", kernel_initializer="glorot_uniform")(inputs)
        model = model_class(inputs, outputs, **kwargs)
        model.set_weights([np.full((3, 1), 0.3, "float32"), np.array([-0.2], "float32")])
        metrics = [
            "accuracy",
            "mae",
            _OfPredictions(keras.metrics.Sum)(name="sum"),
            _OfPredictions(keras.metrics.Mean)(name="mean"),
        ]
        model.compile(loss="binary_crossentropy", metrics=metrics)
        return model

    reference = build(keras.Model)
    model = build(keras_dist.DistributedModel, strategy=mirrored_1x3_cpu)
    for batch_size in (4, 8):
        expected = reference.evaluate(x, y, batch_size=batch_size, return_dict=True, verbose=0)
        got = model.evaluate(x, y, batch_size=batch_size, return_dict=True, verbose=0)
        for name, value in expected.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(
            model.predict(x, batch_size=batch_size, verbose=0),
            reference.predict(x, batch_size=batch_size, verbose=0),
            rtol=1e-6,
        )


# --------------------------------------------------------------- the auto-shard rule
def _tfrecord_dataset(tmp_path, num_files, pattern=False):
    files = sharding_workload.write_tfrecords(str(tmp_path), num_files)
    if pattern:
        names = tf.data.Dataset.list_files(str(tmp_path / f"ids-{num_files}-*.tfrecord"), shuffle=False)
    else:
        names = tf.data.Dataset.from_tensor_slices(files)
    return names.interleave(tf.data.TFRecordDataset, cycle_length=1).batch(4)


@pytest.mark.parametrize(
    "num_files, num_workers, policy",
    [(1, 2, "data"), (2, 2, "file"), (4, 2, "file"), (3, 4, "data")],
)
def test_file_policy_needs_one_file_per_worker(tmp_path, num_files, num_workers, policy):
    decision = _sharding.choose_auto_shard_policy(_tfrecord_dataset(tmp_path, num_files), num_workers)
    assert (decision.auto_shard_policy, decision.num_files) == (policy, num_files)
    if policy == "data":
        assert f"{num_files} file(s) for {num_workers} workers" in decision.reason


@pytest.mark.parametrize(
    "make",
    [
        lambda files: tf.data.TFRecordDataset(files),
        lambda files: tf.data.TFRecordDataset(files, num_parallel_reads=2).map(lambda r: r).batch(2),
        lambda files: tf.data.Dataset.from_tensor_slices(files).interleave(tf.data.TFRecordDataset).batch(2),
        lambda files: tf.data.Dataset.from_tensor_slices(files).shuffle(3).flat_map(tf.data.TFRecordDataset),
        lambda files: tf.data.TextLineDataset(files).batch(2).prefetch(1),
    ],
    ids=["reader", "parallel_reads_map_batch", "interleave", "shuffle_flat_map", "text_lines"],
)
def test_files_are_counted_in_common_pipelines(tmp_path, make):
    files = sharding_workload.write_tfrecords(str(tmp_path), 3)
    assert _sharding.choose_auto_shard_policy(make(files), 2).num_files == 3


def test_files_from_a_glob_are_counted(tmp_path):
    assert _sharding.choose_auto_shard_policy(_tfrecord_dataset(tmp_path, 4, pattern=True), 2).num_files == 4


def test_in_memory_data_is_sharded_by_data_without_files():
    decision = _sharding.choose_auto_shard_policy(tf.data.Dataset.range(10).batch(2), 2)
    assert (decision.auto_shard_policy, decision.num_files) == ("data", None)


def test_user_choice_is_kept_except_impossible_file(tmp_path):
    dataset = _tfrecord_dataset(tmp_path, 4)
    assert _sharding.choose_auto_shard_policy(with_auto_shard_policy(dataset, "data"), 2).auto_shard_policy == "data"
    assert _sharding.choose_auto_shard_policy(dataset, 2, requested="off").auto_shard_policy == "off"
    one_file = with_auto_shard_policy(_tfrecord_dataset(tmp_path, 1), "file")
    assert _sharding.choose_auto_shard_policy(one_file, 2).auto_shard_policy == "data"


def test_unknown_policy_is_refused():
    with pytest.raises(
        ValueError, match=r"must be one of \('auto', 'file', 'data', 'off'\).*Received: auto_shard_policy='rows'"
    ):
        keras_dist.DistributedModel(auto_shard_policy="rows")


# --------------------------------------------------------------- verify_sharding
@pytest.mark.parametrize("kind", ["numpy", "dataset", "generator_views", "pydataset", "dataset_creator"])
def test_verify_sharding_counts_every_example_once(kind, mirrored_1x2_cpu, tmp_path):
    args, kwargs = sharding_workload.inputs_for(kind, str(tmp_path))
    report = verify_sharding(
        *args,
        batch_size=kwargs.get("batch_size"),
        strategy=mirrored_1x2_cpu,
        example_id=lambda x: tf.cast(tf.reshape(x[0] if isinstance(x, tuple) else x, [-1]), tf.int64),
    )
    assert report.num_examples == 37 and report.every_example_once, str(report)
    assert sum(report.examples_per_replica) == 37 and len(report.examples_per_replica) == 2
    assert report.examples_per_worker == (37,)
    assert "every example once" in str(report)


def test_verify_sharding_finds_duplicates():
    """An input function that ignores its InputContext feeds every replica the same data.

    Its own strategy: TensorFlow keeps PER_REPLICA input mode on a strategy object, and
    later `experimental_distribute_dataset` calls on it then replicate instead of split.
    """
    from conftest import mirrored

    strategy = mirrored(2)

    def dataset_fn(input_context):
        return tf.data.Dataset.range(10).batch(5)

    per_replica = tf.distribute.InputOptions(
        experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA
    )
    report = verify_sharding(DatasetCreator(dataset_fn, per_replica), strategy=strategy, example_id=lambda x: x)
    assert report.num_examples == 20 and report.num_duplicated == 10 and not report.every_example_once
    assert "NOT every example once: 10 duplicated" in str(report)


def test_verify_sharding_default_ids_fingerprint_rows(mirrored_1x2_cpu):
    x = np.random.RandomState(0).rand(21, 3).astype("float32")
    report = verify_sharding(x, batch_size=4, strategy=mirrored_1x2_cpu)
    assert report.every_example_once and report.expected_num_examples == 21


def test_position_dependent_steps_after_the_files_use_data(tmp_path):
    files = sharding_workload.write_tfrecords(str(tmp_path), 4)
    for dataset in [
        tf.data.TFRecordDataset(files).take(3).batch(2),
        tf.data.TFRecordDataset(files).skip(1).batch(2),
        tf.data.TFRecordDataset(files).enumerate().batch(2),
        tf.data.TFRecordDataset(files).shuffle(8).repeat().batch(2),  # each worker would cycle its own files
    ]:
        decision = _sharding.choose_auto_shard_policy(dataset, 2)
        assert decision.auto_shard_policy == "data" and "after reading its files" in decision.reason, decision
    # take() on the file names, before reading, is per worker by design: FILE stays.
    names = tf.data.Dataset.from_tensor_slices(files).take(2)
    assert (
        _sharding.choose_auto_shard_policy(names.interleave(tf.data.TFRecordDataset).batch(2), 2).auto_shard_policy
        == "file"
    )


def test_predict_keeps_input_order_so_never_file(tmp_path):
    dataset = tf.data.TFRecordDataset(sharding_workload.write_tfrecords(str(tmp_path), 4)).batch(2)
    assert _sharding.choose_auto_shard_policy(dataset, 2, keep_order=True).auto_shard_policy == "data"


def test_plan_labels_each_input_of_fit(mirrored_1x2_cpu):
    x = sharding_workload.ids()

    def creator_fn(input_context):
        return tf.data.Dataset.from_tensor_slices((x, x)).batch(input_context.get_per_replica_batch_size(8))

    model, _ = sharding_workload.build(keras_dist.DistributedModel, "numpy", strategy=mirrored_1x2_cpu)
    model.fit(DatasetCreator(creator_fn), validation_data=(x, x), validation_batch_size=5, epochs=1, verbose=0)
    plan = model.input_plan
    assert (plan.usage, plan.source, plan.global_batch_size) == ("validation", "NumPy arrays", 5)

    model.fit(x, x, batch_size=8, validation_split=0.25, epochs=1, verbose=0)
    assert (model.input_plan.usage, model.input_plan.source) == ("validation", "NumPy arrays")

    def generator():
        for start in range(0, 10, 5):
            yield x[start : start + 5], x[start : start + 5]

    model.fit(x, x, batch_size=8, validation_data=generator(), epochs=1, verbose=0)
    assert (model.input_plan.source, model.input_plan.global_batch_size) == ("Python generator", None)


def test_unbatched_validation_data_names_validation_batch_size(mirrored_1x2_cpu):
    model, _ = sharding_workload.build(keras_dist.DistributedModel, "numpy", strategy=mirrored_1x2_cpu)
    x = sharding_workload.ids()
    with pytest.raises(ValueError, match="pass `validation_batch_size=`"):
        model.fit(x, x, batch_size=8, validation_data=tf.data.Dataset.from_tensor_slices((x, x)), verbose=0)


def test_verify_sharding_batches_unbatched_dataset_and_checks_policy(mirrored_1x2_cpu):
    x = np.random.RandomState(0).rand(37, 4).astype("float32")
    report = verify_sharding(tf.data.Dataset.from_tensor_slices(x), batch_size=8, strategy=mirrored_1x2_cpu)
    assert (report.num_examples, report.plan.global_batch_size) == (37, 8) and report.every_example_once
    with pytest.raises(ValueError, match="auto_shard_policy"):
        verify_sharding(x, batch_size=8, strategy=mirrored_1x2_cpu, auto_shard_policy="nonsense")


def test_per_element_steps_keep_file_sharding(tmp_path):
    files = sharding_workload.write_tfrecords(str(tmp_path), 4)
    for dataset in [
        tf.data.TFRecordDataset(files).map(sharding_workload._parse).batch(3).unbatch().batch(2),
        tf.data.TFRecordDataset(files).map(sharding_workload._parse).padded_batch(2),
        tf.data.TFRecordDataset(files).map(sharding_workload._parse).ragged_batch(2),
    ]:
        assert _sharding.choose_auto_shard_policy(dataset, 2).auto_shard_policy == "file"


def test_unbounded_file_list_is_sharded_by_data_and_says_why(tmp_path):
    files = sharding_workload.write_tfrecords(str(tmp_path), 4)
    dataset = tf.data.Dataset.from_tensor_slices(files).repeat().interleave(tf.data.TFRecordDataset).batch(2)
    decision = _sharding.choose_auto_shard_policy(dataset, 2)
    assert decision.auto_shard_policy == "data" and "unbounded" in decision.reason


def test_warnings_once_per_reason_and_never_for_a_chosen_policy(monkeypatch):
    monkeypatch.setattr(_sharding, "_WARNED", set())
    too_few = _sharding.ShardingDecision("data", 1, "1 file(s) for 2 workers", fix="write more files")
    with pytest.warns(keras_dist.errors.KerasDistWarning, match="reads all 1 file.*Fix: write more files"):
        _sharding.warn_once(too_few, 2, "tf.data.Dataset")
    with pytest.warns(
        keras_dist.errors.KerasDistWarning, match="each of the 2 workers runs the whole Python generator"
    ):
        _sharding.warn_once(_sharding.ShardingDecision("data", None, "no files"), 2, "Python generator")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _sharding.warn_once(too_few, 2, "tf.data.Dataset")  # said already
        _sharding.warn_once(_sharding.ShardingDecision("data", None, "no files"), 2, "NumPy arrays")
        _sharding.warn_once(_sharding.ShardingDecision("data", 1, "chosen", explicit=True), 2, "tf.data.Dataset")


def test_batch_count_hint_fixes_what_keras_batches_arrays_by():
    from keras_dist.data import _inputs

    x = np.zeros((257, 3), "float32")
    hint = _inputs._batch_count_hint
    assert hint(x, 32, 0.0, 0) == (257, 32, 0, 0)
    assert hint({"a": x, "b": x}, None, 0.2, 1) == (257, 0, round(0.2 * 2**30), 1)
    # Each thing Keras batches the arrays by changes the hint.
    assert len({hint(x, 32, 0.0, 0), hint(x[:256], 32, 0.0, 0), hint(x, 16, 0.0, 0), hint(x, 32, 0.1, 0)}) == 4
    assert hint(x, 32, 0.0, 0) != hint(x, 32, 0.0, 1)
    # Inputs whose number of batches is not set by a length: no hint.
    assert hint(tf.data.Dataset.from_tensor_slices(x).batch(8), None, 0.0, 0) == ()
    assert hint(iter([x]), None, 0.0, 0) == ()


def test_skipping_the_per_step_check_leaves_the_strategy_as_it_was(mirrored_1x2_cpu):
    from keras_dist._runtime import distribute_dataset

    extended = mirrored_1x2_cpu.extended
    before = {k: v for k, v in vars(extended).items() if "get_next_as_optional" in k or "partial_batch" in k}
    dataset = tf.data.Dataset.range(10).batch(4)
    assert distribute_dataset.asks_every_step(mirrored_1x2_cpu.experimental_distribute_dataset(dataset))
    with distribute_dataset.without_per_step_agreement(mirrored_1x2_cpu):
        skipped = mirrored_1x2_cpu.experimental_distribute_dataset(dataset)
    assert not distribute_dataset.asks_every_step(skipped)
    assert {k: v for k, v in vars(extended).items() if "get_next_as_optional" in k or "partial_batch" in k} == before
    assert distribute_dataset.asks_every_step(mirrored_1x2_cpu.experimental_distribute_dataset(dataset))
    # Without the check the replicas still see every example of the partial last batch, in order.
    seen = [v.numpy().tolist() for batch in skipped for v in mirrored_1x2_cpu.experimental_local_results(batch)]
    assert sum(seen, []) == list(range(10))


def test_step_functions_are_traced_again_for_iterators_that_check_otherwise(mirrored_1x2_cpu):
    # TensorFlow's iterator type leaves out whether it asks the other workers before each step; a function
    # traced for one kind is rebuilt for the other (tests/integration/test_end_of_data_check.py: the hang).
    inputs = keras.Input((3,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy=mirrored_1x2_cpu)
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
    repeated = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()  # never asks
    model.fit(repeated, steps_per_epoch=2, verbose=0)
    first = model.train_function
    model.fit(repeated, steps_per_epoch=2, verbose=0)
    assert model.train_function is first  # the same kind: kept
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4), verbose=0)  # finite, unknown batch shape: asks
    assert model.train_function is not first


def test_verify_sharding_steps_of_a_reshuffling_input_compare_each_step(mirrored_1x2_cpu):
    """`steps` over a shuffle that reshuffles each pass: each pass holds other examples.

    The reference pass and the distributed pass are two iterations of the same
    dataset; compared whole they differed (211 "duplicated" and 211 "missing"
    of 640 before), though the split was right.
    """
    x = np.arange(1000, dtype="float32")[:, None]
    dataset = tf.data.Dataset.from_tensor_slices(x).shuffle(1024, seed=1).batch(64).repeat()
    report = verify_sharding(dataset, steps=10, strategy=mirrored_1x2_cpu)
    assert report.comparison == "per step" and report.every_example_once, str(report)
    assert report.num_examples == report.expected_num_examples == 640
    assert "every example once in its step" in str(report) and "compared per step" in str(report)
    # An input whose passes agree is still compared whole.
    fixed = tf.data.Dataset.from_tensor_slices(x).shuffle(1024, seed=1, reshuffle_each_iteration=False)
    report = verify_sharding(fixed.batch(64).repeat(), steps=10, strategy=mirrored_1x2_cpu)
    assert report.comparison == "whole pass" and report.every_example_once, str(report)


def test_verify_sharding_per_step_counts_what_a_step_repeats_or_lacks(mirrored_1x2_cpu):
    from keras_dist.data import _verify

    plan = _verify._distribute.function_input_plan(mirrored_1x2_cpu, "verify_sharding")
    reference = [[1, 2, 3, 4], [5, 6, 7, 8]]
    got = [[1, 2, 1, 2], [5, 6, 7, 8]]  # Step 1: both replicas got the first half.
    report = _verify._report(plan, mirrored_1x2_cpu, got, [0, 0, 1, 1] * 2, reference, "per step")
    assert (report.num_duplicated, report.num_missing) == (2, 2) and not report.every_example_once
    assert "NOT every example once in its step: 2 duplicated, 2 missing" in str(report)


def test_a_batched_dataset_of_feature_columns_is_not_taken_for_single_examples(mirrored_1x2_cpu):
    """keras.io's structured data classification: one `keras.Input(shape=(1,))` per feature, batches of `(batch,)`.

    A new-user probe: refused as "single examples", and batched again with `batch_size=` as the
    message said, it failed. Keras adds the last dimension of 1 itself; single examples of those
    inputs, `(1,)`, are still batched with `batch_size=`, or refused without it.
    """
    rs = np.random.RandomState(90)
    features = {"age": rs.rand(37).astype("float32"), "chol": rs.rand(37).astype("float32")}
    labels = (features["age"] + features["chol"] > 1).astype("float32")

    def build(model_class, **kwargs):
        age, chol = keras.Input(shape=(1,), name="age"), keras.Input(shape=(1,), name="chol")
        hidden = keras.layers.Dense(4, activation="relu")(keras.layers.concatenate([age, chol]))
        model = model_class([age, chol], keras.layers.Dense(1, activation="sigmoid")(hidden), **kwargs)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy", metrics=["accuracy"])
        return model

    def train(model):
        dataset = tf.data.Dataset.from_tensor_slices((features, labels)).batch(8)
        history = model.fit(dataset, epochs=2, verbose=0)
        return {"history": history.history, "evaluate": model.evaluate(dataset, verbose=0, return_dict=True)}

    assert_matches_single_device(build, strategy=mirrored_1x2_cpu, train=train, atol=1e-6, rtol=0.0)
    single = tf.data.Dataset.from_tensor_slices(({k: v[:, None] for k, v in features.items()}, labels))
    with pytest.raises(ValueError, match="yields single examples, not batches"):
        build(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu).fit(single, epochs=1, verbose=0)


def _cycle_batch(k):
    """Batch `k` of a 7-batch cycle of 37 rows (six of 6, one of 1): `y = 2x + k`, so each batch has its own loss."""
    rows = 1 if k % 7 == 6 else 6
    x = np.random.RandomState(k % 7).rand(rows, 1).astype("float32")
    return x, 2 * x + float(k % 7)


def _endless_generator():
    k = 0
    while True:
        yield _cycle_batch(k)
        k += 1


class _CyclePyDataset(keras.utils.PyDataset):
    def __len__(self):
        return 7

    def __getitem__(self, index):
        return _cycle_batch(index)


def _cycle_input(kind):
    if kind == "generator":
        return _endless_generator()
    if kind == "py_dataset":
        return _CyclePyDataset()
    spec = tf.TensorSpec((None, 1), tf.float32)
    return tf.data.Dataset.from_generator(
        lambda: (_cycle_batch(k) for k in range(7)), output_signature=(spec, spec)
    ).repeat()


@pytest.mark.parametrize(
    "validation_kind, validation_steps", [("repeated_dataset", 3), ("py_dataset", 3), ("generator", 2)]
)
def test_each_epoch_trains_and_validates_on_the_batches_keras_takes(
    validation_kind, validation_steps, multi_replica_strategy
):
    """An endless training generator with `steps_per_epoch` and a validation input with `validation_steps`.

    Keras keeps the training iterator across epochs (epoch 2 starts at batch
    5 of the cycle), but `evaluate` resets the cached validation iterator
    each epoch (`epoch_iterator.reset()`): a repeated dataset or a
    `PyDataset` starts again at its first batch, a generator first replays
    the 2 batches Keras peeked at. Later batches of a validation generator
    are not compared: where it goes on depends on how far tf.data's prefetch
    read it before the reset, on one device as under a strategy (1 or 2
    batches past those used, from run to run, in a probe of Keras 3.15.1).
    """

    def build(Model, **kwargs):
        inputs = keras.Input((1,))
        model = Model(inputs, keras.layers.Dense(1)(inputs), **kwargs)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=["mae"])
        return model

    def train(model):
        return model.fit(
            _endless_generator(),
            steps_per_epoch=5,
            validation_data=_cycle_input(validation_kind),
            validation_steps=validation_steps,
            epochs=4,
            shuffle=False,
            verbose=0,
        )

    result = assert_matches_single_device(build, strategy=multi_replica_strategy, train=train, atol=1e-6, rtol=1e-6)
    assert len(set(np.round(result.reference_results["loss"], 4))) == 4  # Each epoch trained on other batches.
