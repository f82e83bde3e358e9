"""LearningRateWarmup, ThroughputMonitor and RetracingMonitor on 2 replicas."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _support import sum_regression

import keras_dist
from keras_dist import errors
from keras_dist.callbacks import LearningRateWarmup, RetracingMonitor, ThroughputMonitor


class RecordLearningRate(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


def _model(strategy, learning_rate=0.1, **compile_kwargs):
    inputs = keras.Input((3,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy=strategy)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse", **compile_kwargs)
    return model


def test_warmup_reaches_the_linearly_scaled_rate_step_by_step(mirrored_1x2_cpu):
    """Goyal et al. 2017: k = num_replicas_in_sync by default; linear in steps; left alone afterwards."""
    model, record = _model(mirrored_1x2_cpu), RecordLearningRate()
    model.fit(
        *sum_regression(64, 3),
        batch_size=8,
        epochs=1,
        verbose=0,
        callbacks=[LearningRateWarmup(warmup_steps=4), record],
    )
    np.testing.assert_allclose(record.rates, [0.1, 0.125, 0.15, 0.175, 0.2, 0.2, 0.2, 0.2], rtol=1e-6)


def test_warmup_with_a_base_batch_size_and_epochs(mirrored_1x2_cpu):
    model, record = _model(mirrored_1x2_cpu), RecordLearningRate()
    warmup = LearningRateWarmup(warmup_epochs=0.5, base_batch_size=4)  # global batch 16: k = 4; 4 steps per epoch
    history = model.fit(*sum_regression(64, 3), batch_size=16, epochs=2, verbose=0, callbacks=[warmup, record])
    np.testing.assert_allclose(record.rates, [0.1, 0.25, 0.4, 0.4, 0.4, 0.4, 0.4, 0.4], rtol=1e-6)
    assert history.history["learning_rate"] == pytest.approx([0.4, 0.4])


def test_warmup_continues_where_a_restored_run_left_it(mirrored_1x2_cpu):
    model, first, second = _model(mirrored_1x2_cpu), RecordLearningRate(), RecordLearningRate()
    x, y = sum_regression(64, 3)
    model.fit(x[:16], y[:16], batch_size=8, epochs=1, verbose=0, callbacks=[LearningRateWarmup(warmup_steps=4), first])
    model.fit(x[:32], y[:32], batch_size=8, epochs=1, verbose=0, callbacks=[LearningRateWarmup(warmup_steps=4), second])
    np.testing.assert_allclose(first.rates + second.rates, [0.1, 0.125, 0.15, 0.175, 0.2, 0.2], rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [({}, "exactly one of"), ({"warmup_epochs": 1, "warmup_steps": 2}, "exactly one of"), ({"warmup_steps": 0}, "> 0")],
)
def test_warmup_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LearningRateWarmup(**kwargs)


def test_warmup_refuses_a_schedule(mirrored_1x2_cpu):
    inputs = keras.Input((3,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy=mirrored_1x2_cpu)
    model.compile(optimizer=keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)), loss="mse")
    with pytest.raises(ValueError, match="LearningRateSchedule does not allow"):
        model.fit(
            *sum_regression(64, 3), batch_size=8, epochs=1, verbose=0, callbacks=[LearningRateWarmup(warmup_steps=2)]
        )


def test_throughput_monitor_logs_rates_and_percentiles(mirrored_1x2_cpu):
    model = _model(mirrored_1x2_cpu)
    history = model.fit(*sum_regression(64, 3), batch_size=8, epochs=2, verbose=0, callbacks=[ThroughputMonitor()])
    logs = history.history
    assert all(v > 0 for v in logs["examples_per_second"])
    np.testing.assert_allclose(np.array(logs["examples_per_second"]) / 2, logs["examples_per_second_per_replica"])
    assert all(p50 <= p90 for p50, p90 in zip(logs["step_seconds_p50"], logs["step_seconds_p90"]))


def test_throughput_monitor_arithmetic_on_a_fake_clock(mirrored_1x2_cpu, monitor_clock):
    """Every step takes 0.5 s on the fake clock: 8 examples / 0.5 s = 16 examples/s, p50 = p90 = 0.5 s."""
    model = _model(mirrored_1x2_cpu)
    logs = model.fit(*sum_regression(64, 3), batch_size=8, epochs=2, verbose=0, callbacks=[ThroughputMonitor()]).history
    np.testing.assert_allclose(logs["examples_per_second"], [16.0, 16.0])
    np.testing.assert_allclose(logs["examples_per_second_per_replica"], [8.0, 8.0])
    np.testing.assert_allclose(logs["step_seconds_p50"] + logs["step_seconds_p90"], [0.5] * 4)


@pytest.fixture
def monitor_clock(monkeypatch):
    """ThroughputMonitor's clock, advancing 0.5 s per reading (one reading per step begin and end)."""
    from keras_dist.callbacks import _monitors

    ticks = iter(np.arange(0, 10_000, 0.5))
    monkeypatch.setattr(_monitors, "_now", lambda: float(next(ticks)))


class PredictGrowingInputs(keras.callbacks.Callback):
    """A retracing storm: each epoch predicts on longer sequences, a new input signature each time."""

    def on_epoch_end(self, epoch, logs=None):
        self.model.predict(np.zeros((4, 3 + epoch), "int32"), verbose=0)


def _sequence_model(strategy):
    inputs = keras.Input((None,), dtype="int32")
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(10, 2)(inputs))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(hidden), strategy=strategy)
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_retracing_monitor_warns_with_the_signatures(mirrored_1x2_cpu):
    model = _sequence_model(mirrored_1x2_cpu)
    x = np.zeros((16, 5), "int32")
    monitor = RetracingMonitor(max_traces_per_epoch=0)
    with pytest.warns(
        errors.KerasDistWarning, match=r"(?s)model.predict_function was traced 1 times in epoch 1.*Fix: give"
    ):
        history = model.fit(
            x, np.zeros((16, 1)), batch_size=8, epochs=3, verbose=0, callbacks=[PredictGrowingInputs(), monitor]
        )
    assert history.history["train_traces"][1:] == [0, 0]
    assert monitor.traces["predict_function"] >= 2  # Keras relaxes the shape after two traces.


def test_retracing_monitor_is_quiet_on_static_shapes(mirrored_1x2_cpu, recwarn):
    model = _sequence_model(mirrored_1x2_cpu)
    model.fit(
        np.zeros((16, 5), "int32"), np.zeros((16, 1)), batch_size=8, epochs=3, verbose=0, callbacks=[RetracingMonitor()]
    )
    assert not [w for w in recwarn if issubclass(w.category, errors.KerasDistWarning)]


def test_throughput_monitor_model_flops_utilization(mirrored_1x2_cpu):
    """MFU = flops_per_example x examples/s / (peak x replicas) (PaLM, appendix B); no peak on CPU, no MFU."""
    model = _model(mirrored_1x2_cpu)
    monitor = ThroughputMonitor(flops_per_example=6 * 4, peak_flops_per_second=1e9)
    logs = model.fit(*sum_regression(64, 3), batch_size=8, epochs=1, verbose=0, callbacks=[monitor]).history
    np.testing.assert_allclose(logs["model_flops_per_second"], np.array(logs["examples_per_second"]) * 24)
    np.testing.assert_allclose(logs["model_flops_utilization"], np.array(logs["model_flops_per_second"]) / 2e9)
    without_peak = model.fit(
        *sum_regression(64, 3), batch_size=8, epochs=1, verbose=0, callbacks=[ThroughputMonitor(flops_per_example=24)]
    )
    assert "model_flops_per_second" in without_peak.history and "model_flops_utilization" not in without_peak.history
    with pytest.raises(ValueError, match="`flops_per_example` must be a number > 0"):
        ThroughputMonitor(flops_per_example=0)


class TrainOnGrowingBatches(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        x = np.zeros((4, 3 + epoch), "int32")
        self.model.train_on_batch(x, np.zeros((4, 1)))


def test_retracing_monitor_counts_the_train_function(mirrored_1x2_cpu):
    """Keras wraps the train function's tf.functions in a plain closure; the monitor finds them."""
    model = _sequence_model(mirrored_1x2_cpu)
    monitor = RetracingMonitor(max_traces_per_epoch=0)
    with pytest.warns(errors.KerasDistWarning, match="model.train_function was traced"):
        history = model.fit(
            np.zeros((16, 5), "int32"),
            np.zeros((16, 1)),
            batch_size=8,
            epochs=3,
            verbose=0,
            callbacks=[TrainOnGrowingBatches(), monitor],
        )
    assert history.history["train_traces"][0] >= 1  # fit's own first trace
    assert monitor.traces["train_function"] >= 3


def test_warmup_hands_over_to_a_later_scheduler_and_counts_micro_batches(mirrored_1x2_cpu):
    model, record = _model(mirrored_1x2_cpu), RecordLearningRate()
    scheduler = keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr if epoch == 0 else 0.05)
    model.fit(
        *sum_regression(64, 3),
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[LearningRateWarmup(warmup_epochs=1), scheduler, record],
    )
    np.testing.assert_allclose(record.rates[:8], [0.1 + 0.1 * s / 8 for s in range(8)], rtol=1e-6)
    np.testing.assert_allclose(record.rates[8:], [0.05] * 8, rtol=1e-6)  # The scheduler's rate, not the warm-up's.

    inputs = keras.Input((3,))
    accumulating = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy=mirrored_1x2_cpu)
    accumulating.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), loss="mse")
    record = RecordLearningRate()
    accumulating.fit(
        *sum_regression(64, 3),
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[LearningRateWarmup(warmup_epochs=1), record],
    )
    np.testing.assert_allclose(record.rates[8:], [0.2] * 8, rtol=1e-6)  # Warm-up over the first epoch's 8 batches.


def test_throughput_monitor_without_a_known_global_batch_size(mirrored_1x2_cpu):
    """A dataset with no static batch dimension: examples/s left out with a warning, unless given."""
    model = _model(mirrored_1x2_cpu)
    x, y = sum_regression(64, 3)
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    batches = keras_dist.data.bucket_by_length(examples, boundaries=[4], global_batch_size=8, length_fn=lambda a, b: 3)
    with pytest.warns(
        errors.KerasDistWarning, match=r"global batch size is unknown.*ThroughputMonitor\(global_batch_size=\.\.\.\)"
    ):
        logs = model.fit(batches, epochs=1, verbose=0, callbacks=[ThroughputMonitor()]).history
    assert "step_seconds_p50" in logs and "examples_per_second" not in logs
    logs = model.fit(batches, epochs=1, verbose=0, callbacks=[ThroughputMonitor(global_batch_size=8)]).history
    assert logs["examples_per_second"][0] > 0
