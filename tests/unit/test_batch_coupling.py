"""A compiled loss or metric that couples the examples of a batch is named once, with the fix (issue 25 item 3).

Every built-in per-example Keras loss, with sample weights and with a Keras
mask, trains on 2 replicas without a warning (keras-dist turns its own
warnings into errors in tests); a batch-coupled compiled loss or metric gets
exactly one warning each, naming it and `keras_dist.global_batch`; `verify`
names it as the cause of a difference.
"""

import contextlib
import io
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import keras_dist
from keras_dist import errors
from keras_dist._model import coupling
from keras_dist._runtime import batch_coupling

RS = np.random.RandomState(0)
X = RS.rand(12, 4).astype("float32")
WEIGHTS = RS.uniform(0.5, 2.0, size=(12,)).astype("float32")
PROBABILITIES = RS.dirichlet(np.ones(3), size=12).astype("float32")
LABELS = RS.randint(0, 3, size=(12,)).astype("int32")
BINARY = (RS.rand(12, 3) > 0.5).astype("float32")
SIGNS = 2.0 * BINARY - 1.0
POSITIVE = RS.uniform(0.1, 2.0, size=(12, 3)).astype("float32")

# name -> (loss, activation of its 3 outputs, targets)
PER_EXAMPLE = {
    "mse": (keras.losses.MeanSquaredError(), None, POSITIVE),
    "mae": (keras.losses.MeanAbsoluteError(), None, POSITIVE),
    "mape": (keras.losses.MeanAbsolutePercentageError(), None, POSITIVE),
    "msle": (keras.losses.MeanSquaredLogarithmicError(), "softplus", POSITIVE),
    "huber": (keras.losses.Huber(delta=0.5), None, POSITIVE),
    "log_cosh": (keras.losses.LogCosh(), None, POSITIVE),
    "cosine": (keras.losses.CosineSimilarity(), None, POSITIVE),
    "poisson": (keras.losses.Poisson(), "softplus", POSITIVE),
    "kld": (keras.losses.KLDivergence(), "softmax", PROBABILITIES),
    "hinge": (keras.losses.Hinge(), "tanh", SIGNS),
    "squared_hinge": (keras.losses.SquaredHinge(), "tanh", SIGNS),
    "categorical_hinge": (keras.losses.CategoricalHinge(), "softmax", PROBABILITIES),
    "bce": (keras.losses.BinaryCrossentropy(label_smoothing=0.1), "sigmoid", BINARY),
    "bce_logits": (keras.losses.BinaryCrossentropy(from_logits=True), None, BINARY),
    "binary_focal": (keras.losses.BinaryFocalCrossentropy(), "sigmoid", BINARY),
    "cce": (keras.losses.CategoricalCrossentropy(), "softmax", PROBABILITIES),
    "categorical_focal": (keras.losses.CategoricalFocalCrossentropy(), "softmax", PROBABILITIES),
    "generalized_ce": (keras.losses.CategoricalGeneralizedCrossEntropy(), "softmax", LABELS),
    "scce": (keras.losses.SparseCategoricalCrossentropy(from_logits=True), None, LABELS),
    "scce_ignore": (keras.losses.SparseCategoricalCrossentropy(ignore_class=0), "softmax", LABELS),
    "dice_per_example": (keras.losses.Dice(axis=-1), "sigmoid", BINARY),
    "tversky_per_example": (keras.losses.Tversky(axis=-1), "sigmoid", BINARY),
}


def _per_example_model(strategy):
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(6, activation="tanh")(inputs)
    outputs = {
        name: keras.layers.Dense(3, activation=act, name=name)(hidden) for name, (_, act, _) in PER_EXAMPLE.items()
    }
    model = keras_dist.DistributedModel(inputs, outputs, strategy=strategy)
    model.compile(
        optimizer="sgd",
        loss={name: loss for name, (loss, _, _) in PER_EXAMPLE.items()},
        metrics={"mse": ["mae", keras.metrics.AUC(name="auc")], "cce": ["accuracy"], "scce": ["accuracy"]},
    )
    return model


def test_no_per_example_keras_loss_is_taken_for_a_coupled_one(mirrored_1x2_cpu):
    model = _per_example_model(mirrored_1x2_cpu)
    targets = {name: target for name, (_, _, target) in PER_EXAMPLE.items()}
    batch = (X[:6], {k: v[:6] for k, v in targets.items()}, WEIGHTS[:6])
    assert batch_coupling.find_coupled(model, batch, 2) == []  # Each loss's values, directly.
    y_pred = model(batch[0])
    for name, (loss, _, _) in PER_EXAMPLE.items():  # Each was computed (a failing loss is not checked).
        assert batch_coupling._loss_values(loss, batch[1][name], y_pred[name]).shape[0] == 6, name
    # And through fit and evaluate, with sample weights (a KerasDistWarning would be an error here).
    model.fit(X, targets, sample_weight=WEIGHTS, batch_size=6, epochs=1, verbose=0)
    model.evaluate(X, targets, sample_weight=WEIGHTS, batch_size=6, verbose=0)
    assert model.__dict__["_keras_dist_coupling_checked"]


def test_with_a_keras_mask_and_ignore_class_no_warning_either(mirrored_1x2_cpu):
    tokens = RS.randint(1, 7, size=(12, 5)).astype("int32")
    tokens[:, 3:] = 0
    inputs = keras.Input((5,), dtype="int32")
    hidden = keras.layers.Embedding(7, 4, mask_zero=True)(inputs)
    outputs = {
        "tags": keras.layers.Dense(3, activation="softmax", name="tags")(hidden),
        "values": keras.layers.Dense(2, name="values")(hidden),
    }
    model = keras_dist.DistributedModel(inputs, outputs, strategy=mirrored_1x2_cpu)
    model.compile(
        optimizer="sgd",
        loss={"tags": keras.losses.SparseCategoricalCrossentropy(ignore_class=0), "values": "huber"},
        metrics={"tags": ["accuracy"]},
        weighted_metrics={"values": ["mae"]},
    )
    targets = {"tags": RS.randint(0, 3, size=(12, 5)), "values": RS.rand(12, 5, 2).astype("float32")}
    per_token = RS.uniform(0.5, 2.0, size=(12, 5)).astype("float32")  # As Keras needs it with ignore_class.
    weights = {"tags": per_token, "values": per_token}
    model.fit(tokens, targets, sample_weight=weights, batch_size=6, epochs=1, verbose=0)
    assert model.__dict__["_keras_dist_coupling_checked"]


class BatchMax(keras.metrics.Metric):
    """A metric class of one's own that keeps the largest batch mean (not a sum of per-example state)."""

    def __init__(self, name="batch_max", **kwargs):
        super().__init__(name=name, **kwargs)
        self.largest = self.add_variable((), "zeros", name="largest")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.largest.assign(ops.maximum(self.largest, ops.mean(ops.abs(y_true - y_pred))))

    def result(self):
        return self.largest


def _warnings_of(strategy, loss, metrics, x=X, y=POSITIVE, **fit_kwargs):
    inputs = keras.Input((4,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(3, activation="sigmoid")(inputs), strategy=strategy)
    model.compile(optimizer="sgd", loss=loss, metrics=metrics)
    with pytest.warns(errors.KerasDistWarning) as seen:
        model.fit(x, y, epochs=1, verbose=0, **fit_kwargs)
        model.evaluate(
            x, y, verbose=0, **({"batch_size": fit_kwargs["batch_size"]} if "batch_size" in fit_kwargs else {})
        )
    return [str(w.message) for w in seen if issubclass(w.category, errors.KerasDistWarning)]


def test_a_batch_wide_keras_loss_and_a_metric_class_of_ones_own_warn_once_each(mirrored_1x2_cpu):
    messages = _warnings_of(mirrored_1x2_cpu, keras.losses.Dice(), [BatchMax(), "mae"], batch_size=6)
    assert len(messages) == 2, messages
    assert "The compiled loss 'dice' couples the examples of a batch" in messages[0]
    assert "compile(loss=keras_dist.global_batch(keras.losses.Dice(...)))" in messages[0]
    assert "The compiled metric 'batch_max'" in messages[1]
    assert "compile(metrics=[keras_dist.global_batch(BatchMax(...))])" in messages[1]


class MeanOfBatchMeans(keras.metrics.Metric):
    """A new-user probe's metric: adds one batch mean and one count per batch (8.6e-3 off on 2 replicas, unwarned)."""

    def __init__(self, name="mean_of_batch_means", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable((), "zeros", name="total")
        self.count = self.add_variable((), "zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(ops.mean(ops.abs(y_true - y_pred)))
        self.count.assign_add(1.0)

    def result(self):
        return self.total / self.count


class SummedAbsoluteError(MeanOfBatchMeans):
    """The same mean kept as sums over the examples: exact on any split."""

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(ops.sum(ops.mean(ops.abs(y_true - y_pred), axis=-1)))
        self.count.assign_add(ops.cast(ops.shape(y_true)[0], "float32"))


def test_a_metric_adding_batch_means_is_named_where_the_first_batch_splits_evenly(mirrored_1x2_cpu):
    """Batches of 6 on 2 replicas (3 and 3): the check also splits the first batch 4 and 2, as a last batch splits."""
    messages = _warnings_of(mirrored_1x2_cpu, "mse", [MeanOfBatchMeans(), SummedAbsoluteError()], batch_size=6)
    assert len(messages) == 1, messages
    assert "The compiled metric 'mean_of_batch_means'" in messages[0]
    assert "or unevenly, as a last batch is" in messages[0]


class RunningMax(keras.metrics.Metric):
    """A new-user probe's metric: the largest absolute error so far, in a variable of another aggregation.

    With `aggregation="mean"` the replicas' maxima are averaged when it is
    read (5.9e-2 off on 2 replicas, unwarned before).
    """

    def __init__(self, aggregation="mean", name="running_max", **kwargs):
        super().__init__(name=name, **kwargs)
        self.largest = self.add_variable((), "zeros", name="largest", aggregation=aggregation)

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.largest.assign(ops.maximum(self.largest, ops.max(ops.abs(y_true - y_pred))))

    def result(self):
        return self.largest


class SummedErrorCountingBatches(SummedAbsoluteError):
    """Exact sums, and a batch counter kept the same on every replica (`"mean"`): read as one device reads it."""

    def __init__(self, name="summed_error_counting_batches", **kwargs):
        super().__init__(name=name, **kwargs)
        self.batches = self.add_variable((), "zeros", name="batches", aggregation="mean")

    def update_state(self, y_true, y_pred, sample_weight=None):
        super().update_state(y_true, y_pred, sample_weight)
        self.batches.assign_add(1.0)


@pytest.mark.parametrize("aggregation", ["mean", "only_first_replica"])
def test_a_metric_variable_averaged_or_taken_from_one_replica_is_read_as_the_replicas_read_it(
    mirrored_1x2_cpu, aggregation
):
    largest_in_the_second_part = POSITIVE.copy()
    largest_in_the_second_part[4] += 50.0  # In the first batch's second part on every split the check tries.
    messages = _warnings_of(
        mirrored_1x2_cpu,
        "mse",
        [RunningMax(aggregation), SummedErrorCountingBatches()],
        y=largest_in_the_second_part,
        batch_size=6,
    )
    assert len(messages) == 1, messages
    assert "The compiled metric 'running_max'" in messages[0]
    assert "compile(metrics=[keras_dist.global_batch(RunningMax(...))])" in messages[0]


def test_the_named_fix_gives_a_running_max_one_device_gives(mirrored_1x2_cpu):
    inputs = keras.Input((4,))
    with mirrored_1x2_cpu.scope():
        model = keras_dist.DistributedModel(inputs, keras.layers.Dense(3)(inputs), strategy=mirrored_1x2_cpu)
    model.compile(optimizer="sgd", loss="mse", metrics=[keras_dist.global_batch(RunningMax())])
    result = model.evaluate(X, POSITIVE, batch_size=6, verbose=0, return_dict=True)
    expected = np.max(np.abs(POSITIVE - model.predict(X, verbose=0)))
    np.testing.assert_allclose(result["running_max"], expected, rtol=1e-6)


@pytest.mark.parametrize(
    "loss, targets",
    [
        (keras.losses.Dice(), BINARY),
        (keras.losses.dice, BINARY),
        (keras.losses.Tversky(axis=(0, 1)), BINARY),
        (keras.losses.Circle(), LABELS),
    ],
    ids=["Dice", "dice_function", "Tversky_over_the_batch", "Circle"],
)
def test_keras_losses_over_the_batch_are_named_even_where_this_batch_hides_it(mirrored_1x2_cpu, loss, targets):
    """A new-user probe: `keras.losses.Dice()` trained 1.7e-2 off in 2 epochs without a warning.

    On the first batch the whole batch's Dice and its halves' mean agreed to 8e-6 (under the
    check's tolerance) while the gradients differed. Here the halves are the same examples, so
    the values agree exactly: Keras' losses over the batch are named by what they are.
    """
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(3, activation="sigmoid")(inputs)
    model = keras_dist.DistributedModel(inputs, outputs, strategy=mirrored_1x2_cpu)
    model.compile(optimizer="sgd", loss=loss)
    with batch_coupling.suppressed():  # Builds the compiled loss; no check.
        model.evaluate(X, targets, batch_size=6, verbose=0)
    twice = (np.concatenate([X[:3], X[:3]]), np.concatenate([targets[:3], targets[:3]]), None)
    (found,) = batch_coupling.find_coupled(model, twice, 2)
    assert found.by_definition and found.kind == "loss"


def test_a_dataset_of_memory_is_checked_a_shuffled_one_is_not_touched(mirrored_1x2_cpu):
    dataset = tf.data.Dataset.from_tensor_slices((X, BINARY)).map(lambda x, y: (x * 2.0, y)).batch(6)
    messages = _warnings_of(mirrored_1x2_cpu, keras.losses.Dice(), [], x=dataset, y=None)
    assert len(messages) == 1 and "'dice'" in messages[0]
    # A shuffled dataset: a fresh iterator would move its seed on (another order in training): not taken.
    assert batch_coupling.first_batch(dataset.shuffle(12), None, None, None) is None
    assert batch_coupling.first_batch(dataset, None, None, None) is not None
    assert (
        batch_coupling.first_batch(tf.data.Dataset.from_tensor_slices(X).map(tf.random.shuffle), None, None, None)
        is None
    )


def test_the_check_changes_no_state_and_runs_only_on_several_replicas(mirrored_1x2_cpu):
    inputs = keras.Input((4,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(3)(inputs), strategy=mirrored_1x2_cpu)
    auc = keras.metrics.AUC(name="auc")
    model.compile(optimizer="sgd", loss="mse", metrics=[auc, BatchMax()])
    with batch_coupling.suppressed():  # Builds the compiled metrics; no check.
        model.evaluate(X, POSITIVE, batch_size=6, verbose=0)
    before = [np.array(v) for v in [*model.weights, *auc.variables]]
    assert [c.name for c in batch_coupling.find_coupled(model, (X, POSITIVE, None), 2)] == ["batch_max"]
    assert all(np.array_equal(a, np.array(b)) for a, b in zip(before, [*model.weights, *auc.variables]))
    one = keras_dist.DistributedModel(inputs, keras.layers.Dense(3)(inputs), strategy="one_device")
    one.compile(optimizer="sgd", loss=keras.losses.Dice())
    with contextlib.redirect_stdout(io.StringIO()):
        one.fit(X, BINARY, batch_size=6, epochs=1, verbose=0)  # No warning on one device (an error here).
    assert not one.__dict__.get("_keras_dist_coupling_checked")


def _retrieval(strategy):
    query, candidate = keras.Input((4,)), keras.Input((3,))
    q = keras.layers.Dense(4)(query)
    c = keras.layers.Dense(4)(candidate)
    model = keras_dist.DistributedModel([query, candidate], keras.layers.Concatenate()([q, c]), strategy=strategy)

    def in_batch_softmax(y_true, y_pred):
        logits = ops.matmul(y_pred[:, :4], ops.transpose(y_pred[:, 4:]))
        return keras.losses.sparse_categorical_crossentropy(ops.arange(ops.shape(logits)[0]), logits, from_logits=True)

    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=in_batch_softmax)
    return model


def test_verify_names_a_coupled_loss_as_the_cause_with_the_fix(mirrored_1x2_cpu):
    model = _retrieval(mirrored_1x2_cpu)
    x, y = [X, RS.rand(12, 3).astype("float32")], np.zeros((12, 1), "float32")
    report = keras_dist.verify(model, x, y, batch_size=6, steps=2)  # verify's own fit does not warn.
    assert not report.passed
    assert report.likely_cause == "batch_coupled_loss"
    assert "'in_batch_softmax'" in report.explanation
    assert "keras_dist.global_batch(in_batch_softmax)" in report.explanation
    assert "batch_coupled_loss" in str(report)


def test_a_ratio_of_the_kept_entries_sum_is_read_as_the_step_reads_it(mirrored_1x2_cpu):
    """A probe's false alarm: `reduce_sum(boolean_mask(l, m)) / reduce_sum(m)` trained exactly, but the check, traced
    for the first batch's static size, did not read it as a ratio and named it as coupling the batch."""

    def kept_sum_ratio(y_true, y_pred):
        mask = ops.cast(y_true != 0, "float32")
        loss = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
        return tf.reduce_sum(tf.boolean_mask(loss, mask > 0)) / tf.reduce_sum(mask)

    inputs = keras.Input((6, 3))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(3)(inputs), strategy=mirrored_1x2_cpu)
    model.compile(optimizer="sgd", loss=kept_sum_ratio)
    tokens = RS.randn(8, 6, 3).astype("float32")
    kept = np.array([6, 6, 5, 6, 1, 1, 2, 1])  # The first part keeps many more tokens than the second.
    targets = np.where(np.arange(6)[None] < kept[:, None], 1 + (tokens.sum(-1) > 0), 0).astype("int32")
    with batch_coupling.suppressed():  # Builds the compiled loss; no check.
        model.evaluate(tokens, targets, batch_size=8, verbose=0)
    assert batch_coupling.find_coupled(model, (tokens, targets, None), 2) == []


@pytest.mark.parametrize("form", ["sum", "ratio"])
def test_a_sum_or_a_ratio_over_the_batch_is_named_only_under_run_eagerly(mirrored_1x2_cpu, form):
    """A compiled loss function returning `ops.sum(...)` over the batch was named as coupling it; the step now counts
    each replica's sum once (stop 54), as it counts a ratio of sums by its denominator. Under `run_eagerly=True` the
    step has no graph to read either from and counts the value as a mean: named then, with that fix, not the gather."""

    def summed(y_true, y_pred):
        return ops.sum(ops.square(y_true - y_pred))

    def ratio(y_true, y_pred):
        mask = ops.cast(y_true > 0.5, "float32")
        return ops.sum(ops.square(y_true - y_pred) * mask) / ops.sum(mask)

    found = {}
    for eager in (False, True):
        inputs = keras.Input((4,))
        model = keras_dist.DistributedModel(inputs, keras.layers.Dense(3)(inputs), strategy=mirrored_1x2_cpu)
        model.compile(optimizer="sgd", loss=summed if form == "sum" else ratio, run_eagerly=eager)
        with batch_coupling.suppressed():  # Builds the compiled loss; no check.
            model.evaluate(X, POSITIVE, batch_size=12, verbose=0)
        found[eager] = batch_coupling.find_coupled(model, (X, POSITIVE, None), 2)
    assert found[False] == []
    assert [(c.kind, c.eager) for c in found[True]] == [("loss", True)]
    message = coupling.message(found[True][0], 2)
    assert "run_eagerly=True" in message and "global_batch" not in message


def test_the_checks_forward_passes_warn_nothing(mirrored_1x2_cpu):
    """A new-user probe: a wrapped `Sequential` got Keras' 'structure of inputs doesn't match' warning on every `fit`,
    from the check's call on the NumPy batch."""
    with mirrored_1x2_cpu.scope():
        sequential = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model = keras_dist.distribute(sequential, strategy=mirrored_1x2_cpu)
    model.compile(optimizer="sgd", loss=_scalar_mean_squared_error)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model.fit(X, POSITIVE, batch_size=6, epochs=1, verbose=0)
    assert not [w for w in seen if "structure" in str(w.message)], [str(w.message) for w in seen]


def _scalar_mean_squared_error(y_true, y_pred):  # One number per batch: the check runs its forward pass.
    return ops.mean(ops.square(y_true - y_pred))
