"""The step timeline (`keras_dist.callbacks.Timeline`, `KERAS_DIST_TIMELINE`) and the straggler report, in-process."""

import json
import math
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from _support import sum_regression

import keras_dist
from keras_dist import _env, errors
from keras_dist._runtime import keras_internals
from keras_dist.callbacks import Timeline
from keras_dist.monitor import _timeline
from keras_dist.monitor._progress import Progress

STEP_PHASES = ["input", "forward/backward", "all-reduce", "apply", "outputs"]


class SlowEpochEnd(keras.callbacks.Callback):
    """A user's callback: it shows in the timeline under its class name."""

    def on_epoch_end(self, epoch, logs=None):
        time.sleep(0.001)


def _model(strategy, seed=0, **compile_kwargs):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="relu")(inputs)
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(hidden), strategy=strategy)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", **compile_kwargs)
    return model


def _fit(model, callbacks=(), epochs=2, **kwargs):
    x, y = sum_regression(40, 3)
    return model.fit(x, y, batch_size=8, epochs=epochs, verbose=0, callbacks=list(callbacks), **kwargs)


def _complete_events(trace):
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def _inside(inner, outer):
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def test_the_file_is_a_chrome_trace_with_the_step_phases_callbacks_and_saving(mirrored_1x2_cpu, tmp_path):
    model = _model(mirrored_1x2_cpu)
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "m.weights.h5"), save_weights_only=True)
    timeline = Timeline(tmp_path / "timeline", report=False)
    _fit(model, [timeline, SlowEpochEnd(), checkpoint], validation_data=sum_regression(16, 3))

    path = tmp_path / "timeline" / "timeline-worker-0.json"
    assert timeline.path == str(path) and sorted(p.name for p in path.parent.iterdir()) == [path.name]
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    assert {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "worker:0"}} in trace["traceEvents"]
    events = _complete_events(trace)
    for event in events:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= set(event), event
        assert isinstance(event["ts"], int) and event["dur"] >= 0 and event["pid"] == 0
    for tid in {e["tid"] for e in events}:
        starts = [e["ts"] for e in events if e["tid"] == tid]
        assert starts == sorted(starts)
    names = [e["name"] for e in events]
    steps = [e for e in events if e["name"].startswith("train step ")]
    assert len(steps) == 10  # 5 steps x 2 epochs
    for step in steps:  # Each step holds its phases, in order, covering it.
        inside = [e for e in events if e["cat"] != "step" and e["tid"] == step["tid"] and _inside(e, step)]
        phases = [e for e in inside if e["name"] in STEP_PHASES]
        assert [e["name"] for e in phases] == STEP_PHASES
        assert phases[0]["ts"] == step["ts"] and phases[-1]["ts"] + phases[-1]["dur"] == step["ts"] + step["dur"]
        assert all(a["ts"] + a["dur"] == b["ts"] for a, b in zip(phases, phases[1:]))
    assert names.count("SlowEpochEnd.on_epoch_end") == 2
    assert names.count("epoch 1") == names.count("epoch 2") == 1
    assert names.count("fit") == 1 and names.count("evaluate") == 2 and "test_step" in names
    savings = [e for e in events if e["name"] == "saving"]
    checkpoints = [e for e in events if e["name"] == "ModelCheckpoint.on_epoch_end"]
    assert len(savings) == len(checkpoints) == 2
    assert all(_inside(s, c) for s, c in zip(savings, checkpoints))
    assert "m.weights.h5" in savings[0]["args"]["detail"]


def test_weights_with_the_timeline_on_equal_those_with_it_off(mirrored_1x2_cpu, tmp_path):
    off, on = _model(mirrored_1x2_cpu), _model(mirrored_1x2_cpu)
    on.set_weights(off.get_weights())
    history_off = _fit(off)
    history_on = _fit(on, [Timeline(tmp_path, report=False)])
    for a, b in zip(off.get_weights(), on.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert history_off.history == history_on.history


def _op_types(model):
    """The op types of every graph traced for the model's train function, nested functions included."""
    types = set()
    for function in keras_internals.tf_functions_behind(model.train_function):
        for concrete in function._list_all_concrete_functions():
            graph_def = concrete.graph.as_graph_def()
            types.update(node.op for node in graph_def.node)
            types.update(node.op for f in graph_def.library.function for node in f.node_def)
    return types


def test_with_the_timeline_off_the_step_has_no_timestamp_op(mirrored_1x2_cpu, tmp_path):
    model = _model(mirrored_1x2_cpu)
    _fit(model, epochs=1)
    off = _op_types(model)
    assert "Timestamp" not in off and "MatMul" in off
    _fit(model, [Timeline(tmp_path, report=False)], epochs=1)
    assert "Timestamp" in _op_types(model)  # The check can fail: the same search finds them when on.
    _fit(model, epochs=1)  # Off again: traced anew, without them.
    assert "Timestamp" not in _op_types(model)


def test_a_train_step_of_ones_own_gets_its_phases(mirrored_1x2_cpu, tmp_path):
    class Regressor(keras_dist.DistributedModel):  # keras.io, "Customizing what happens in fit()".
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(gradients, self.trainable_variables)
            for metric in self.metrics:
                metric.update_state(loss) if metric.name == "loss" else metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    inputs = keras.Input((3,))
    model = Regressor(inputs, keras.layers.Dense(1)(inputs), strategy=mirrored_1x2_cpu)
    model.compile(optimizer="sgd", loss="mse")
    timeline = Timeline(tmp_path, report=False)
    _fit(model, [timeline], epochs=1)
    names = [e["name"] for e in _complete_events(timeline.recorder.trace(pid=0))]
    assert all(names.count(phase) == 5 for phase in STEP_PHASES), names


@pytest.mark.parametrize(
    "jit_compile, accumulation, phases",
    [
        (True, None, STEP_PHASES),  # XLA per replica: the timestamps sit around the compiled pass.
        (False, 2, ["input", "forward/backward", "all-reduce + apply", "outputs"]),  # All-reduced inside `apply`.
    ],
    ids=["jit_compile", "gradient_accumulation"],
)
def test_phases_under_xla_and_gradient_accumulation(mirrored_1x2_cpu, tmp_path, jit_compile, accumulation, phases):
    inputs = keras.Input((3,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy=mirrored_1x2_cpu)
    optimizer = keras.optimizers.SGD(0.1, gradient_accumulation_steps=accumulation)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    timeline = Timeline(tmp_path, report=False)
    _fit(model, [timeline], epochs=1)
    events = _complete_events(timeline.recorder.trace(pid=0))
    step = next(e for e in events if e["name"].startswith("train step "))
    assert [e["name"] for e in events if e["cat"] != "step" and _inside(e, step)] == phases


def test_the_environment_variable_adds_a_timeline_and_the_chief_prints_the_report(
    mirrored_1x2_cpu, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(_env.TIMELINE_ENV, str(tmp_path))
    _fit(_model(mirrored_1x2_cpu), epochs=1)
    assert json.loads((tmp_path / "timeline-worker-0.json").read_text())["traceEvents"]
    lines = capsys.readouterr().out.splitlines()
    header = lines.index("keras-dist timeline: step times per worker in this fit")
    assert lines[header + 1].split()[:3] == ["worker", "steps", "median"]
    assert lines[header + 2].split()[:2] == ["worker:0", "5"]


def test_a_timeline_without_directory_reports_only(mirrored_1x2_cpu, tmp_path, capsys):
    timeline = Timeline()
    _fit(_model(mirrored_1x2_cpu), [timeline], epochs=1)
    assert timeline.path is None and "worker:0" in timeline.report_text
    assert timeline.report_text in capsys.readouterr().out


def test_a_failing_fit_still_writes_what_it_recorded(mirrored_1x2_cpu, tmp_path):
    class Fails(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise RuntimeError("boom")

    timeline = Timeline(tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        _fit(_model(mirrored_1x2_cpu), [timeline, Fails()])
    names = [e["name"] for e in _complete_events(json.loads((tmp_path / "timeline-worker-0.json").read_text()))]
    assert sum(name.startswith("train step ") for name in names) == 3  # The third step's batch end raised.
    assert timeline.report_text is None


def test_the_timeline_needs_a_directory_or_the_report():
    with pytest.raises(ValueError, match="needs a `directory` to write to, or `report=True`"):
        Timeline(None, report=False)


def test_a_plain_keras_model_warns_that_it_is_not_recorded(tmp_path):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.warns(errors.KerasDistWarning, match="records the `fit` of a `keras_dist.DistributedModel` only"):
        _fit(model, [Timeline(tmp_path)], epochs=1)


# ----------------------------------------------------------------- pure functions


def test_step_phases_from_the_timestamps():
    names = lambda phases: [name for name, _, _ in phases]  # noqa: E731
    assert names(_timeline.step_phases(1.0, 2.0, [1.1, 1.2, 1.3, 1.4])) == STEP_PHASES
    # Gradient accumulation: no `all_reduced` timestamp; a value from an earlier step is not this step's.
    assert names(_timeline.step_phases(1.0, 2.0, [1.1, 1.2, math.nan, 1.4])) == [
        "input",
        "forward/backward",
        "all-reduce + apply",
        "outputs",
    ]
    assert names(_timeline.step_phases(1.0, 2.0, [1.1, 0.5, 1.3, 1.4]))[1] == "forward/backward + all-reduce"
    assert _timeline.step_phases(1.0, 2.0, [math.nan] * 4) == [] == _timeline.step_phases(1.0, 2.0, None)


def test_the_latest_local_replica_sets_each_boundary():
    assert _timeline.latest_marks([[1.0, 2.0, 3.0, 4.0], [1.5, 1.8, 3.1, math.nan]])[:3] == [1.5, 2.0, 3.1]
    assert math.isnan(_timeline.latest_marks([[1.0, 2.0, 3.0, 4.0], [1.5, 1.8, 3.1, math.nan]])[3])


def _summary(task, own_ms, step_ms=100.0, collective=1.0):
    return _timeline.WorkerSummary(task, 50, step_ms / 1e3, None if own_ms is None else own_ms / 1e3, collective, 10.0)


def test_the_report_names_the_slowest_worker_when_more_than_20_percent_slower():
    report = _timeline.straggler_report([_summary("worker:0", 60), _summary("worker:1", 81), _summary("worker:2", 62)])
    lines = report.splitlines()
    assert lines[2].split() == ["worker:0", "50", "100.00", "60.00", "10.0"]
    assert lines[-1] == (
        "worker:1 is the slowest: its median step (own work, without waiting in collectives) is 35% longer "
        "than the fastest's (worker:0)."
    )


def test_the_report_names_nobody_when_10_percent_slower():
    report = _timeline.straggler_report([_summary("worker:0", 60), _summary("worker:1", 66)])
    assert "slowest" not in report and len(report.splitlines()) == 4


def test_the_report_without_own_work_compares_whole_steps_and_lists_the_missing():
    report = _timeline.straggler_report(
        [_summary("chief:0", None, step_ms=100), _summary("worker:0", None, step_ms=130)], missing=["worker:1"]
    )
    assert "worker:0 is the slowest: its median step is 30% longer than the fastest's (chief:0)." in report
    assert "own work not measured" in report and "worker:1      (no report" in report


def test_gather_summaries_through_a_store():
    store = {}
    tasks = ["worker:0", "worker:1", "worker:2"]
    one = _summary("worker:1", 70)
    assert (
        _timeline.gather_summaries(one, tasks, is_chief=False, key_prefix="t/", put=store.__setitem__, get=None) is None
    )
    assert store == {"t/worker:1": one.to_json()}
    waits = []

    def get(key, timeout_seconds):
        waits.append(timeout_seconds)
        return store.get(key)

    chief = _summary("worker:0", 60)
    summaries, missing = _timeline.gather_summaries(
        chief, tasks, is_chief=True, key_prefix="t/", put=None, get=get, timeout_seconds=5.0
    )
    assert summaries == [chief, one] and missing == ["worker:2"]
    assert len(waits) == 2 and all(0 < w <= 5.0 for w in waits)


def test_the_recorder_turns_phases_into_events_and_numbers():
    clock = [100.0]
    progress = Progress(clock=lambda: clock[0], monotonic=lambda: clock[0])
    marks = [[100.1, 100.2, 100.25, 100.3]]
    recorder = _timeline.TimelineRecorder("worker:1", lambda: marks, progress=progress, clock=lambda: clock[0])
    recorder.start()
    with progress.phase("fit", "in fit"):
        with progress.phase("step", "train step 1", collective=True):
            clock[0] = 100.5
        with progress.phase("callback", "AgreeOnStop.on_epoch_end"):
            with progress.phase("agreement", "the workers' agreement", collective=True):
                clock[0] = 101.0
    recorder.stop()
    names = [(e["name"], e["ts"], e["dur"]) for e in _complete_events(recorder.trace(pid=2))]
    assert ("train step 1", 100_000_000, 500_000) in names and ("all-reduce", 100_200_000, 50_000) in names
    assert ("agreement", 100_500_000, 500_000) in names and ("AgreeOnStop.on_epoch_end", 100_500_000, 500_000) in names
    summary = recorder.summary()
    assert summary.steps == 1 and summary.median_step_seconds == pytest.approx(0.5)
    assert summary.median_own_seconds == pytest.approx(0.45)
    assert summary.collective_seconds == pytest.approx(0.55) and summary.total_seconds == pytest.approx(1.0)
