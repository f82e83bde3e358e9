"""The stall watchdog's decisions and the phases it reads (issue 21), in one process.

The watchdog itself runs only under several workers: tests/integration/test_stall_watchdog.py.
"""

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist.cli._cluster_env import build_worker_env
from keras_dist.monitor import _progress, _stall
from keras_dist.monitor._stall import Record, describe_stall

SPEC_2 = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}


def record(task, kind="step", what="train step 13 (fit: ...)", collective=True, age=40.0, outer="fit", steps=12):
    return Record(task, 7, kind, what, collective, age, outer, steps, 1, 0.1)


def describe(me, records, silent=None):
    silent = silent or {}
    return describe_stall(me, records, silent, bound=60, floor=60, frozen_after=15)


def test_stall_timeout_defaults_to_60_seconds_and_0_turns_it_off():
    assert _stall.stall_timeout_from_environment({}) == 60
    assert _stall.stall_timeout_from_environment({"KERAS_DIST_STALL_TIMEOUT": "0"}) == 0
    assert _stall.stall_timeout_from_environment({"KERAS_DIST_STALL_TIMEOUT": " 12.5 "}) == 12.5


@pytest.mark.parametrize("raw", ["-1", "soon", "nan", "inf"])
def test_a_bad_stall_timeout_says_what_was_expected_and_received(raw):
    with pytest.raises(
        ValueError, match=rf"must be a number of seconds >= 0.*Received: KERAS_DIST_STALL_TIMEOUT='{raw}'"
    ):
        _stall.stall_timeout_from_environment({"KERAS_DIST_STALL_TIMEOUT": raw})


def test_the_bound_grows_with_the_median_step_time():
    assert _stall.bound_seconds(60, 0.5) == 60
    assert _stall.bound_seconds(60, 4.0) == 80
    assert _stall.bound_seconds(8, None) == 8


def test_a_worker_in_a_callback_is_named_with_its_last_step_and_the_collective_others_wait_in():
    me = record("worker:0")
    peer = record("worker:1", kind="callback", what="Slow.on_train_batch_end (a callback)", collective=False)
    stuck, facts = describe(me, {"worker:1": peer})
    assert stuck == ["worker:1"]
    assert "worker:1 has been in Slow.on_train_batch_end (a callback) for 40 s" in facts
    assert "last finished train step 12 (epoch 1)" in facts
    assert "worker:0 waits for it in train step 13 (fit: ...) since 40 s" in facts


def test_a_frozen_worker_is_named_frozen():
    stuck, facts = describe(record("worker:0"), {"worker:1": record("worker:1")}, {"worker:1": 20.0})
    assert stuck == ["worker:1"] and "worker:1 is frozen: its process has not answered for 20 s" in facts


def test_nobody_is_named_when_every_worker_waits_in_the_same_collective():
    # E.g. one worker still compiling the first step, or a slow but progressing step.
    assert describe(record("worker:0"), {"worker:1": record("worker:1"), "worker:2": record("worker:2")}) is None
    assert describe(record("worker:0"), {"worker:1": record("worker:1")}, {"worker:1": 5.0}) is None


def test_the_worker_alone_in_an_evaluate_the_others_did_not_call_is_named_from_both_sides():
    chief = record("worker:0", kind="evaluate", what="evaluate (Keras' loop, between steps)", outer="evaluate")
    other = record("worker:1")
    assert describe(chief, {"worker:1": other})[0] == ["worker:0"]
    assert describe(other, {"worker:0": chief})[0] == ["worker:0"]


def test_a_worker_never_heard_from_counts_only_once_it_is_silent_long_enough():
    assert describe(record("worker:0"), {"worker:1": None}, {"worker:1": 3.0}) is None
    assert describe(record("worker:0"), {"worker:1": None}, {"worker:1": 30.0})[0] == ["worker:1"]


def test_progress_records_phases_innermost_last_and_the_time_since_the_last_change():
    now = [100.0]
    progress = _progress.Progress(clock=lambda: now[0], monotonic=lambda: now[0])
    ended = []
    progress.add_listener(lambda phase, end: ended.append((phase.detail, end - phase.since_monotonic)))
    with progress.phase("fit", "fit", collective=True):
        now[0] += 2
        with progress.phase("callback", "C.on_epoch_end"):
            now[0] += 3
            assert [p.kind for p in progress.stack()] == ["script", "fit", "callback"]
            assert progress.seconds_in_current() == 3
        now[0] += 1
        assert progress.current().kind == "fit" and progress.seconds_in_current() == 1
    assert ended == [("C.on_epoch_end", 3.0), ("fit", 6.0)]
    assert progress.current().kind == "script"


class _Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        phase = _progress.PROGRESS.current()
        self.seen.append((phase.kind, phase.detail, _progress.PROGRESS.stack()[1].kind))


def test_fit_records_each_callback_hook_and_each_step_and_leaves_the_callbacks_unpatched(mirrored_1x2_cpu):
    inputs = keras.Input((3,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy=mirrored_1x2_cpu)
    model.compile(optimizer="sgd", loss="mse")
    recorder = _Recorder()
    before = _progress.PROGRESS.steps_finished
    x = np.ones((16, 3), "float32")
    model.fit(x, x[:, :1], batch_size=4, epochs=2, verbose=0, callbacks=[recorder])
    assert recorder.seen == [("callback", "_Recorder.on_train_batch_end", "fit")] * 8
    assert _progress.PROGRESS.steps_finished - before == 8
    assert _progress.PROGRESS.median_step_seconds() > 0
    assert "on_train_batch_end" not in vars(recorder)  # The patch is gone after fit.
    assert _progress.PROGRESS.current().kind == "script"


def test_the_watchdog_does_not_start_in_one_process(monkeypatch):
    assert _stall.ensure_started("worker:0", {}) is None
    assert _stall.ensure_started("worker:0", {"worker:1": "127.0.0.1:1"}, {"KERAS_DIST_STALL_TIMEOUT": "0"}) is None


def test_the_launcher_passes_the_stall_timeout_to_every_worker():
    env = build_worker_env({}, cluster_spec=SPEC_2, task_id=1, stall_timeout=0)
    assert env["KERAS_DIST_STALL_TIMEOUT"] == "0.0"
    assert "KERAS_DIST_STALL_TIMEOUT" not in build_worker_env({}, cluster_spec=SPEC_2, task_id=1)


def test_the_minority_in_another_collective_is_named_whoever_looks():
    alone = record("worker:0", kind="agreement", what="the workers' agreement all-reduce")
    most = [record("worker:1"), record("worker:2")]
    for me, others in [(alone, most), (most[0], [alone, most[1]]), (most[1], [alone, most[0]])]:
        stuck, facts = describe(me, {r.task: r for r in others})
        assert stuck == ["worker:0"], facts
        assert "worker:1, worker:2 wait for it in train step 13" in facts


def test_two_workers_in_different_collectives_of_fit_are_both_named():
    a = record("worker:0", kind="agreement", what="the workers' agreement all-reduce")
    b = record("worker:1")
    stuck, facts = describe(a, {"worker:1": b})
    assert stuck == ["worker:0", "worker:1"]
    assert "the workers wait in different collectives" in facts


def test_fit_with_validation_data_records_the_validation_inside_fit(mirrored_1x2_cpu):
    inputs = keras.Input((3,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy=mirrored_1x2_cpu)
    model.compile(optimizer="sgd", loss="mse")
    seen = []

    class OnTestBatch(keras.callbacks.Callback):
        def on_test_batch_end(self, batch, logs=None):
            seen.append([p.kind for p in _progress.PROGRESS.stack()])

    x = np.ones((8, 3), "float32")
    model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0, validation_data=(x, x[:, :1]), callbacks=[OnTestBatch()])
    assert seen == [["script", "fit", "evaluate", "callback"]] * 2


def test_a_worker_that_exited_is_left_to_tensorflow():
    exited = record("worker:1", kind="exited", what="fit (Keras' loop, between steps)")
    assert describe(record("worker:0"), {"worker:1": exited}, {"worker:1": 30.0}) is None
