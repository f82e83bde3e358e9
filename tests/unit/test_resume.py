"""BackupAndRestore through DistributedModel.fit: mid-epoch resume and SIGTERM, against an uninterrupted run."""

import json
import os
import signal

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist.callbacks import _resume

X = np.random.RandomState(0).rand(64, 3).astype("float32")
Y = X.sum(1, keepdims=True)


def _model(strategy):
    inputs = keras.Input((3,))
    model = keras_dist.DistributedModel(
        inputs, keras.layers.Dense(1, kernel_initializer="zeros")(inputs), strategy=strategy
    )
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    return model


def _fit(model, callbacks, **kwargs):
    return model.fit(X, Y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=callbacks, **kwargs)


class AtStep(keras.callbacks.Callback):
    """Calls `action()` at the end of global step `step` (1-based) of this run."""

    def __init__(self, step, action):
        super().__init__()
        self.step, self.action, self.seen = step, action, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            self.action()


class Crash(Exception):
    pass


def _raise():
    raise Crash("worker died")


@pytest.fixture
def uninterrupted(mirrored_1x2_cpu):
    model = _model(mirrored_1x2_cpu)
    _fit(model, [])
    return model


def _assert_same_run(model, reference):
    assert int(np.asarray(model.optimizer.iterations)) == int(np.asarray(reference.optimizer.iterations)) == 24
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_a_crash_mid_epoch_resumes_at_the_step_after_the_backup(tmp_path, mirrored_1x2_cpu, uninterrupted):
    backup_dir = str(tmp_path / "backup")
    model = _model(mirrored_1x2_cpu)
    with pytest.raises(Crash):
        _fit(model, [keras.callbacks.BackupAndRestore(backup_dir, save_freq=3), AtStep(13, _raise)])
    metadata = json.loads(open(os.path.join(backup_dir, "training_metadata.json")).read())
    assert metadata["epoch"] == 1 and metadata[_resume.STEPS_KEY] == 4  # Saved after step 12 = epoch 1, 4 steps in.

    resumed = _model(mirrored_1x2_cpu)
    history = _fit(resumed, [keras.callbacks.BackupAndRestore(backup_dir, save_freq=3)])
    assert len(history.history["loss"]) == 2  # Epochs 1 (its last 4 steps) and 2.
    _assert_same_run(resumed, uninterrupted)
    assert not os.path.exists(backup_dir)  # delete_checkpoint=True: removed after the finished run.


def test_an_epoch_backup_resumes_at_the_next_epoch(tmp_path, mirrored_1x2_cpu, uninterrupted):
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(Crash):
        _fit(_model(mirrored_1x2_cpu), [keras.callbacks.BackupAndRestore(backup_dir), AtStep(13, _raise)])
    resumed = _model(mirrored_1x2_cpu)
    _fit(resumed, [keras.callbacks.BackupAndRestore(backup_dir)])
    _assert_same_run(resumed, uninterrupted)


def test_sigterm_saves_once_at_that_step_and_exits_with_the_restart_status(tmp_path, mirrored_1x2_cpu, uninterrupted):
    backup_dir = str(tmp_path / "backup")
    terminate = AtStep(10, lambda: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(SystemExit) as exit_info:
        _fit(_model(mirrored_1x2_cpu), [keras.callbacks.BackupAndRestore(backup_dir), terminate])
    assert exit_info.value.code == _resume.RESTART_EXIT_STATUS == 75
    metadata = json.loads(open(os.path.join(backup_dir, "training_metadata.json")).read())
    assert metadata["epoch"] == 1 and metadata[_resume.STEPS_KEY] == 2  # Not Keras' end-of-epoch save of the cut epoch.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # The handler is only installed during fit.

    resumed = _model(mirrored_1x2_cpu)
    _fit(resumed, [keras.callbacks.BackupAndRestore(backup_dir)])
    _assert_same_run(resumed, uninterrupted)


def test_the_same_backup_callback_in_two_fits_wraps_keras_methods_once(tmp_path, mirrored_1x2_cpu):
    """Wrapping the previous fit's wrappers would run the end-of-training barrier twice on the chief only."""
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), delete_checkpoint=False)
    model = _model(mirrored_1x2_cpu)
    for _ in range(2):
        model.fit(X, Y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[backup])
    kept = backup.__dict__["_keras_dist_keras_methods"]
    assert all(kept[name].__func__ is getattr(keras.callbacks.BackupAndRestore, name) for name in kept)


@pytest.mark.parametrize(
    "kind, kwargs",
    [("accumulation", {}), ("steps_per_execution", {}), ("generator", {})],
)
def test_resume_mid_cycle_and_uneven_executions_match_an_uninterrupted_run(tmp_path, mirrored_1x2_cpu, kind, kwargs):
    """A backup in the middle of an accumulation cycle keeps its partial sums (saved in Keras' accumulators);
    a short last execution (8 steps as 3+3+2) keeps the step count exact."""

    def model():
        inputs = keras.Input((3,))
        m = keras_dist.DistributedModel(
            inputs, keras.layers.Dense(1, kernel_initializer="zeros")(inputs), strategy=mirrored_1x2_cpu
        )
        optimizer = keras.optimizers.Adam(0.05, gradient_accumulation_steps=2 if kind == "accumulation" else None)
        m.compile(optimizer=optimizer, loss="mse", steps_per_execution=3 if kind == "steps_per_execution" else 1)
        return m

    save_freq, crash = (3, 11) if kind == "accumulation" else (4, 4) if kind == "steps_per_execution" else (3, 13)
    reference = model()
    _fit(reference, [])
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(Crash):
        _fit(model(), [keras.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq), AtStep(crash, _raise)])
    resumed = model()
    _fit(resumed, [keras.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq)])
    assert int(np.asarray(resumed.optimizer.iterations)) == int(np.asarray(reference.optimizer.iterations))
    for a, b in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_an_input_of_unknown_length_replays_the_epoch_with_a_warning(tmp_path, mirrored_1x2_cpu):
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).filter(lambda x, y: True).batch(8)
    backup_dir = str(tmp_path / "backup")
    with pytest.raises(Crash):
        _model(mirrored_1x2_cpu).fit(
            dataset,
            epochs=3,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup_dir, save_freq=3), AtStep(13, _raise)],
        )
    with pytest.warns(keras_dist.errors.KerasDistWarning, match="the epoch is replayed from its start"):
        _model(mirrored_1x2_cpu).fit(
            dataset, epochs=3, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup_dir, save_freq=3)]
        )
