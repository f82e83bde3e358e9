"""`keras_dist.global_batch`: compiled losses and metrics that couple the examples match one device (issue 25 item 2).

The program is a keras.io-style two-tower retrieval model (a query tower and
a candidate tower, the model outputs both embeddings) compiled with an
in-batch softmax loss (`logits = q @ c^T`, labels `arange(batch)`) and an
in-batch top-1 accuracy, both wrapped in `keras_dist.global_batch`: nothing
else changes. Each run is compared with plain Keras on one device from the
same weights on the same batches: 10 examples, batch 4, on 3 replicas (parts
2/1/1, then 1/1/0: a replica without examples) and on 2. Without the wrapper
the same program differs (checked here: the tests can fail).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import keras_dist
from keras_dist import errors
from keras_dist._compat import versions
from keras_dist._global_batch import GlobalBatchLoss, GlobalBatchMetric
from keras_dist.testing import assert_matches_single_device

RS = np.random.RandomState(0)
QUERIES = RS.rand(10, 4).astype("float32")
CANDIDATES = RS.rand(10, 3).astype("float32")
UNUSED = np.zeros((10, 1), "float32")  # `fit` needs a y for a compiled loss; the in-batch labels are positions.
WEIGHTS = RS.uniform(0.5, 2.0, size=(10,)).astype("float32")
TOL = {"atol": 1e-6, "rtol": 0.0, "logs_atol": 1e-6, "logs_rtol": 1e-5}


def in_batch_softmax(y_true, y_pred):
    """Each query's own candidate against the batch's other candidates (per-example cross-entropy)."""
    del y_true
    q, c = y_pred[:, :4], y_pred[:, 4:]
    logits = ops.matmul(q, ops.transpose(c)) / 0.5
    labels = ops.arange(ops.shape(q)[0])
    return keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)


def in_batch_top1(y_true, y_pred):
    """1.0 where a query's own candidate scores highest in the batch."""
    del y_true
    q, c = y_pred[:, :4], y_pred[:, 4:]
    best = ops.argmax(ops.matmul(q, ops.transpose(c)), axis=1)
    return ops.cast(ops.equal(best, ops.arange(ops.shape(q)[0])), "float32")


def _towers():
    query, candidate = keras.Input((4,), name="query"), keras.Input((3,), name="candidate")
    q = keras.layers.Dense(4)(keras.layers.Dense(8, activation="tanh")(query))
    c = keras.layers.Dense(4)(keras.layers.Dense(8, activation="tanh")(candidate))
    return [query, candidate], q, c


def _retrieval(wrap=True, loss=in_batch_softmax, learning_rate=0.5):
    def build(cls, **kwargs):
        inputs, q, c = _towers()
        model = cls(inputs, keras.layers.Concatenate()([q, c]), **kwargs)
        top1 = keras.metrics.MeanMetricWrapper(in_batch_top1, name="top1")
        model.compile(
            optimizer=keras.optimizers.SGD(learning_rate),
            loss=keras_dist.global_batch(loss) if wrap else loss,
            metrics=[keras_dist.global_batch(top1) if wrap else top1],
        )
        return model

    return build


def _fit_and_evaluate(sample_weight=None):
    def train(model):
        x = [QUERIES, CANDIDATES]
        history = model.fit(x, UNUSED, sample_weight=sample_weight, batch_size=4, epochs=2, shuffle=False, verbose=0)
        evaluated = model.evaluate(x, UNUSED, sample_weight=sample_weight, batch_size=4, verbose=0, return_dict=True)
        return {"history": history.history, "evaluate": evaluated}

    return train


@pytest.mark.parametrize("strategy_name", ["mirrored_1x3_cpu", "mirrored_1x2_cpu"])
def test_two_tower_in_batch_softmax_matches_one_device(strategy_name, request):
    strategy = request.getfixturevalue(strategy_name)
    result = assert_matches_single_device(_retrieval(), strategy=strategy, train=_fit_and_evaluate(), **TOL)
    # The loss learns (not a vacuous match), and the logs are one device's.
    assert result.reference_results["history"]["loss"][1] < result.reference_results["history"]["loss"][0]


class _InBatchSoftmax(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return in_batch_softmax(y_true, y_pred)


@pytest.mark.parametrize("reduction", ["mean_with_sample_weight", "sum"])
def test_with_sample_weights_and_other_reductions_it_counts_once(mirrored_1x3_cpu, reduction):
    # "sum": the global batch's sum, the same on every replica, counted once (not once per replica). Its
    # gradients are 4 times the mean's: the same steps at a quarter of the learning rate.
    assert_matches_single_device(
        _retrieval(
            loss=_InBatchSoftmax(reduction=reduction, name="in_batch"),
            learning_rate=0.125 if reduction == "sum" else 0.5,
        ),
        strategy=mirrored_1x3_cpu,
        train=_fit_and_evaluate(WEIGHTS),
        **TOL,
    )


def test_one_output_takes_the_one_collective_step(mirrored_1x2_cpu, monkeypatch):
    # The gathers are weighted as the step weights gradients: not a collective in `call` that needs two.
    from keras_dist._runtime import steps

    calls = []
    original = steps._global_loss
    monkeypatch.setattr(steps, "_global_loss", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = _retrieval()(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu)
    model.fit([QUERIES, CANDIDATES], UNUSED, batch_size=4, epochs=1, verbose=0)
    assert calls == []
    two = _two_outputs(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu)
    two.fit([QUERIES, CANDIDATES], {"pair": UNUSED, "score": QUERIES[:, :1]}, batch_size=4, epochs=1, verbose=0)
    assert calls  # Several outputs: per-output trackers, the two-collective step.


def _two_outputs(cls, **kwargs):
    """A second output with a per-example loss: several outputs, per-output trackers (the two-collective step)."""
    inputs, q, c = _towers()
    pair = keras.layers.Concatenate(name="pair")([q, c])
    score = keras.layers.Dense(1, name="score")(q)
    model = cls(inputs, {"pair": pair, "score": score}, **kwargs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.2),  # At 0.5 float rounding (1e-7 after one epoch) grows to 2e-6 by the third.
        loss={"pair": keras_dist.global_batch(in_batch_softmax), "score": "mse"},
        loss_weights={"pair": 1.0, "score": 0.5},
    )
    return model


def test_next_to_a_per_example_loss_on_another_output_it_matches_one_device(mirrored_1x3_cpu):
    def train(model):
        x, y = [QUERIES, CANDIDATES], {"pair": UNUSED, "score": QUERIES[:, :1]}
        history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history
        logs = {"history": history, "evaluate": model.evaluate(x, y, batch_size=4, verbose=0, return_dict=True)}
        if versions.release_at_least("keras", "3.16"):
            # Keras 3.16 (nightly) weights a per-output loss tracker by the batch size only where the
            # traced step's batch dimension is static: on one device batches of 4, 4 and 2 count 4, 4
            # and 1 in the first epoch (traced for 4, then retraced for any size) and 1 each after.
            # Keras 3.10-3.15 count 1 each, as keras-dist does. The weights and `loss` still compare.
            logs = {part: {k: v for k, v in values.items() if not k.endswith("_loss")} for part, values in logs.items()}
        return logs

    assert_matches_single_device(_two_outputs, strategy=mirrored_1x3_cpu, train=train, **TOL)


def _own_step(cls, **kwargs):
    """keras.io's "customizing what happens in fit": `self.compute_loss` and a `Mean` tracker."""

    class RetrievalModel(cls):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            gradients = tape.gradient(loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(gradients, self.trainable_weights))
            self.tracker.update_state(loss)
            return {"loss": self.tracker.result()}

    inputs, q, c = _towers()
    model = RetrievalModel(inputs, keras.layers.Concatenate()([q, c]), **kwargs)
    model.tracker = keras.metrics.Mean(name="loss")
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=keras_dist.global_batch(in_batch_softmax))
    return model


def test_in_a_train_step_of_ones_own_with_compute_loss_it_matches_one_device(mirrored_1x3_cpu):
    def train(model):
        return model.fit([QUERIES, CANDIDATES], UNUSED, batch_size=4, epochs=2, shuffle=False, verbose=0)

    assert_matches_single_device(_own_step, strategy=mirrored_1x3_cpu, train=train, **TOL)


def _masked(wrap):
    def build(cls, **kwargs):
        tokens = keras.Input((5,), dtype="int32")
        hidden = keras.layers.Embedding(7, 3, mask_zero=True)(tokens)
        model = cls(tokens, keras.layers.Dense(2)(hidden), **kwargs)
        model.compile(optimizer=keras.optimizers.SGD(0.3), loss=keras_dist.global_batch("mse") if wrap else "mse")
        return model

    return build


def test_the_keras_mask_is_gathered_with_the_batch(mirrored_1x3_cpu):
    rs = np.random.RandomState(3)
    tokens = rs.randint(0, 7, size=(10, 5)).astype("int32")
    tokens[:, 3:] = 0  # Padding: masked out of the loss.
    targets = rs.rand(10, 5, 2).astype("float32")

    def train(model):
        history = model.fit(tokens, targets, batch_size=4, epochs=2, shuffle=False, verbose=0)
        return {"history": history.history, "evaluate": model.evaluate(tokens, targets, batch_size=4, verbose=0)}

    wrapped = assert_matches_single_device(_masked(True), strategy=mirrored_1x3_cpu, train=train, seed=5, **TOL)
    plain = assert_matches_single_device(_masked(False), strategy=mirrored_1x3_cpu, train=train, seed=5, **TOL)
    np.testing.assert_allclose(wrapped.results["history"]["loss"], plain.results["history"]["loss"], rtol=1e-6)


def test_without_the_wrapper_each_replica_sees_fewer_negatives(mirrored_1x2_cpu):
    with (
        pytest.warns(errors.KerasDistWarning) as seen,
        pytest.raises(AssertionError, match="weight"),
    ):
        assert_matches_single_device(_retrieval(wrap=False), strategy=mirrored_1x2_cpu, train=_fit_and_evaluate())
    messages = [str(w.message) for w in seen if issubclass(w.category, errors.KerasDistWarning)]
    assert len(messages) == 2, messages  # Once each: the loss and the metric, not again in evaluate.
    assert "The compiled loss 'in_batch_softmax' couples the examples" in messages[0]
    assert "compile(loss=keras_dist.global_batch(in_batch_softmax))" in messages[0]
    assert "keras.metrics.MeanMetricWrapper(in_batch_top1, name='top1')" in messages[1]


def test_on_one_device_it_is_the_loss_itself():
    y_pred = tf.constant(np.concatenate([QUERIES, QUERIES], axis=1))
    wrapped = keras_dist.global_batch(in_batch_softmax)
    plain = keras.losses.LossFunctionWrapper if hasattr(keras.losses, "LossFunctionWrapper") else None
    expected = ops.mean(in_batch_softmax(UNUSED, y_pred))
    assert float(wrapped(UNUSED, y_pred)) == pytest.approx(float(expected), rel=1e-6)
    assert plain is None or isinstance(wrapped.loss, plain)
    metric = keras_dist.global_batch(keras.metrics.MeanMetricWrapper(in_batch_top1, name="top1"))
    metric.update_state(UNUSED, y_pred)
    assert float(metric.result()) == pytest.approx(float(ops.mean(in_batch_top1(UNUSED, y_pred))))
    assert [v.name for v in metric.variables] == [v.name for v in metric.metric.variables]


def test_the_wrappers_round_trip_through_their_config():
    loss = GlobalBatchLoss.from_config(keras_dist.global_batch(keras.losses.Dice()).get_config())
    assert isinstance(loss.loss, keras.losses.Dice) and loss.name == "dice"
    metric = GlobalBatchMetric.from_config(keras_dist.global_batch(keras.metrics.AUC(name="auc")).get_config())
    assert isinstance(metric.metric, keras.metrics.AUC) and metric.name == "auc"
    assert keras_dist.global_batch(loss) is loss


def test_what_it_does_not_take_is_said():
    with pytest.raises(TypeError, match="takes a loss .* Received: 3 of type int"):
        keras_dist.global_batch(3)
    with pytest.raises(ValueError, match="reduces the batch to one number.*reduction=None"):
        keras_dist.global_batch(keras.losses.MeanSquaredError(reduction=None))
    with pytest.raises(TypeError, match="wraps a `keras.metrics.Metric`"):
        GlobalBatchMetric("auc")


def test_under_jit_compile_on_several_replicas_it_says_to_turn_xla_off(mirrored_1x2_cpu):
    inputs, q, c = _towers()
    model = keras_dist.DistributedModel(inputs, keras.layers.Concatenate()([q, c]), strategy=mirrored_1x2_cpu)
    model.compile(optimizer="sgd", loss=keras_dist.global_batch(in_batch_softmax), jit_compile=True)
    with pytest.raises(ValueError, match="keras_dist.global_batch.*jit_compile=False"):
        model.fit([QUERIES, CANDIDATES], UNUSED, batch_size=4, epochs=1, verbose=0)
