"""What `fit`'s step sums in the gradients' own all-reduce (docs/communication.md#what-travels-with-the-gradients).

The example counts, the gradient-structure flags and the metric state ride in the gradient
all-reduce when they can; each falls back to a reduction of its own otherwise. Every variant
must give the numbers of one device (uneven splits: 58 examples, batch 16, so the last batch
gives the replicas 5 and 5, or 4, 3 and 3 examples), and the test counts the reductions each
replica starts while the step is traced.
"""

import contextlib
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from keras_dist._runtime import metric_results
from keras_dist.collectives import _all_reduce

TOL = 1e-5


def _data():
    rs = np.random.RandomState(3)
    x = rs.rand(58, 5).astype("float32")
    y = (x @ rs.randn(5, 1).astype("float32") > 0).astype("float32")
    return x, y


def _layers():
    return [
        keras.layers.Dense(6, activation="relu", kernel_initializer=keras.initializers.GlorotUniform(seed=1)),
        keras.layers.Dense(1, activation="sigmoid", kernel_initializer=keras.initializers.GlorotUniform(seed=2)),
    ]


def _build(cls, **kwargs):
    inputs = keras.Input((5,))
    hidden, out = _layers()
    return cls(inputs, out(hidden(inputs)), **kwargs)


class OwnComputeMetrics(keras_dist.DistributedModel):
    """Overrides `compute_metrics`: the metrics are then summed after `apply`, as Keras orders them."""

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        return super().compute_metrics(x, y, y_pred, sample_weight)


class Float64Sum(keras.metrics.Sum):
    """A metric whose state is float64: not carried in a float32 pack."""

    def __init__(self):
        super().__init__(name="sum64", dtype="float64")

    def update_state(self, y_true, y_pred, sample_weight=None):
        super().update_state(keras.ops.sum(y_pred))


class KernelNorm(keras.metrics.Metric):
    """Reads the model's weights: it must see them after the step's update, as on one device."""

    def __init__(self, model):
        super().__init__(name="kernel_norm")
        self.model = model
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        examples = keras.ops.cast(keras.ops.shape(y_true)[0], "float32")
        self.total.assign_add(keras.ops.sum(keras.ops.abs(self.model.layers[-1].kernel)) * examples)
        self.count.assign_add(examples)

    def result(self):
        return self.total / self.count


def _metrics(variant, model):
    metrics = ["mae", keras.metrics.BinaryAccuracy(name="acc"), keras.metrics.AUC(name="auc", num_thresholds=20)]
    if variant == "float64_metric":
        return metrics + [Float64Sum()]
    if variant == "metric_of_ones_own":
        return metrics + [KernelNorm(model)]
    return metrics


@contextlib.contextmanager
def _counting_reductions(model):
    """Counts, while `model.train_step` is traced, the replicas' `ReplicaContext.all_reduce` calls and the metric sums after `apply`.

    The sum of a user step's metric state, read by `result()` (`metric_results.GlobalResults.summed`), is
    not counted: it runs after the step returns, while another replica's thread may still be inside it.
    """
    counts = {"all_reduce": 0, "metrics_after_apply": 0}
    in_step = [0]  # Replicas inside train_step (MirroredStrategy runs each in its own thread).
    in_metric_sums = threading.local()
    all_reduce = tf.distribute.ReplicaContext.all_reduce
    metrics_after_apply = keras_dist.DistributedModel._metrics_result_from_summed_state
    summed = metric_results.GlobalResults.summed
    train_step = model.train_step

    def counting_all_reduce(self, *args, **kwargs):
        counts["all_reduce"] += bool(in_step[0]) and not getattr(in_metric_sums, "active", False)
        return all_reduce(self, *args, **kwargs)

    def marked_summed(self):
        in_metric_sums.active = True
        try:
            return summed(self)
        finally:
            in_metric_sums.active = False

    def counting_metrics_after_apply(self, *args, **kwargs):
        counts["metrics_after_apply"] += bool(in_step[0])  # Once per step, in cross-replica context.
        return metrics_after_apply(self, *args, **kwargs)

    def counting_train_step(data):
        in_step[0] += 1
        try:
            return train_step(data)
        finally:
            in_step[0] -= 1

    tf.distribute.ReplicaContext.all_reduce = counting_all_reduce
    keras_dist.DistributedModel._metrics_result_from_summed_state = counting_metrics_after_apply
    metric_results.GlobalResults.summed = marked_summed
    model.train_step = counting_train_step
    try:
        yield counts
    finally:
        tf.distribute.ReplicaContext.all_reduce = all_reduce
        keras_dist.DistributedModel._metrics_result_from_summed_state = metrics_after_apply
        metric_results.GlobalResults.summed = summed
        del model.train_step


def _fit(model, x, y, **compile_kwargs):
    model.compile(optimizer=keras.optimizers.SGD(0.2), loss="binary_crossentropy", **compile_kwargs)
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return history.history


@pytest.mark.parametrize(
    "variant, all_reduces, metrics_after_apply",
    [
        ("default", 1, 0),  # Gradients, example counts and metric state in one all-reduce per replica.
        ("own_compute_metrics", 1, 1),  # Overridden compute_metrics: metric sums after apply.
        ("float64_metric", 1, 1),  # A float64 metric variable: the same.
        ("metric_of_ones_own", 1, 1),  # A compiled metric class of one's own (here it reads the weights): the same.
        (
            "fp16_compression",
            3,
            0,
        ),  # Compression: the counts first (loss weighting), then the metric state, then float16 gradients.
    ],
)
def test_what_rides_with_the_gradients_matches_one_device(
    multi_replica_strategy, variant, all_reduces, metrics_after_apply
):
    x, y = _data()
    reference = _build(keras.Model)
    cls = OwnComputeMetrics if variant == "own_compute_metrics" else keras_dist.DistributedModel
    communication = {"compression": "fp16"} if variant == "fp16_compression" else None
    model = _build(cls, strategy=multi_replica_strategy, communication=communication)
    model.set_weights(reference.get_weights())
    metrics = _metrics(variant, model)
    expected_history = _fit(reference, x, y, metrics=_metrics(variant, reference))
    with _counting_reductions(model) as counts:
        history = _fit(model, x, y, metrics=metrics)
    replicas = multi_replica_strategy.num_replicas_in_sync
    traces = _traces(model)
    assert counts == {
        "all_reduce": all_reduces * replicas * traces,
        "metrics_after_apply": metrics_after_apply * traces,
    }
    tol = 2e-3 if variant == "fp16_compression" else TOL
    assert sorted(history) == sorted(expected_history)
    for name, values in expected_history.items():
        np.testing.assert_allclose(history[name], values, rtol=tol, atol=tol, err_msg=name)
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def _traces(model):
    """How many times the one-step function was traced (the uneven last batch may add one)."""
    from keras_dist.callbacks._monitors import _tf_functions_in

    return sum(
        len(f._list_all_concrete_functions())
        for f in _tf_functions_in(model.train_function)
        if "one_step_on_data" in getattr(f, "__name__", "")
    )


def test_non_float32_gradients_send_counts_in_their_own_all_reduce(mirrored_1x2_cpu):
    """float16 gradients cannot share a pack with float32 counts: the counts go first, alone."""

    @tf.function
    def step():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            count = tf.constant(3) if context.replica_id_in_sync_group == 0 else tf.constant(1)
            gradient = tf.fill([4], tf.cast(context.replica_id_in_sync_group + 1, tf.float16))
            options = keras_dist.CommunicationOptions()
            return _all_reduce.all_reduce_gradients(
                [gradient, None], options, num_examples=count, extras=[tf.ones([2, 3])]
            )

        return mirrored_1x2_cpu.run(replica_fn)

    (summed, missing), extras = step()
    assert missing is None
    # (3 x 1 + 1 x 2) / 4 examples = 1.25, in float16.
    for value in mirrored_1x2_cpu.experimental_local_results(summed):
        assert value.dtype == tf.float16
        np.testing.assert_allclose(value.numpy(), [1.25] * 4)
    for value in mirrored_1x2_cpu.experimental_local_results(extras[0]):
        np.testing.assert_allclose(value.numpy(), np.full([2, 3], 2.0))


def test_float16_gradients_are_multiplied_by_the_share_not_the_count(mirrored_1x2_cpu):
    """3e4 x 3 examples overflows float16 (65504); 3e4 x 3/4 does not."""

    @tf.function
    def step():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            first = context.replica_id_in_sync_group == 0
            count = tf.constant(3) if first else tf.constant(1)
            gradient = tf.fill([4], tf.constant(3e4, tf.float16) if first else tf.constant(1e4, tf.float16))
            return _all_reduce.all_reduce_gradients([gradient], keras_dist.CommunicationOptions(), num_examples=count)

        return mirrored_1x2_cpu.run(replica_fn)

    (summed,), _ = step()
    for value in mirrored_1x2_cpu.experimental_local_results(summed):
        assert value.dtype == tf.float16
        np.testing.assert_allclose(value.numpy(), [(3 * 3e4 + 1e4) / 4] * 4, rtol=1e-3)


def test_a_step_and_optimizer_that_disagree_raise_instead_of_summing_unweighted(mirrored_1x2_cpu, monkeypatch):
    """The step leaves the example weighting to the all-reduce only when the optimizer will do it: never a silent fallback.

    Forced here: the model is told the optimizer weights by examples in its all-reduce, while the
    optimizer accumulates gradients (whose all-reduce does not carry the step's request).
    """
    from keras_dist.collectives import _optimizer

    monkeypatch.setattr(_optimizer, "weighs_examples_in_all_reduce", lambda optimizer: True)
    x, y = _data()
    model = _build(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu)
    model.compile(optimizer=keras.optimizers.SGD(0.2, gradient_accumulation_steps=2), loss="binary_crossentropy")
    with pytest.raises(RuntimeError, match="internal error.*did not carry the step's request"):
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)


class _ClippingStep:
    """A step of the user's that clips by the global norm between `tape.gradient` and `apply`."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        gradients, _ = tf.clip_by_global_norm(tape.gradient(loss, self.trainable_variables), 0.05)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        return {"loss": loss}


def test_a_step_of_ones_own_sums_its_gradients_once(mirrored_1x2_cpu):
    """`tape.gradient` returns the global gradient and `apply` sums nothing again: one all-reduce in the step, not 2.

    Summed again in `apply`, the weights would still match one device's (equal values weighted by
    shares that add up to one), so the count is what this tests.
    """
    x, y = _data()
    reference = _build(type("Plain", (_ClippingStep, keras.Model), {}))
    with mirrored_1x2_cpu.scope():
        model = _build(type("Distributed", (_ClippingStep, keras_dist.DistributedModel), {}), strategy=mirrored_1x2_cpu)
    model.set_weights(reference.get_weights())
    _fit(reference, x, y)
    with _counting_reductions(model) as counts:
        _fit(model, x, y)
    np.testing.assert_allclose(model.get_weights()[0], reference.get_weights()[0], atol=TOL)
    # One trace; the example counts are summed before `train_step` is entered, so not counted here.
    assert counts["all_reduce"] == mirrored_1x2_cpu.num_replicas_in_sync, counts
