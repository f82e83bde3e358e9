"""Atomic saves, and callbacks on one worker (unchanged): the in-process half of the callback tests."""

import os

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist.callbacks import _adapt, _coordination


def _model(strategy):
    inputs = keras.Input((3,))
    model = keras_dist.DistributedModel(
        inputs, keras.layers.Dense(1, kernel_initializer="ones")(inputs), strategy=strategy
    )
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("name", ["model.keras", "model.weights.h5"])
def test_a_crash_mid_write_keeps_the_previous_file(tmp_path, mirrored_1x2_cpu, name):
    model = _model(mirrored_1x2_cpu)
    path = tmp_path / name
    (model.save if name.endswith(".keras") else model.save_weights)(path)
    before = path.read_bytes()

    def crash(temporary):
        with open(temporary, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        model._agreement().chief_writes(crash, path)  # What DistributedModel.save and save_weights go through.
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == [name]  # The temporary file is gone too.


def test_save_writes_through_a_temporary_name(tmp_path, mirrored_1x2_cpu, monkeypatch):
    model = _model(mirrored_1x2_cpu)
    renames = []
    original = _coordination.tf.io.gfile.rename
    monkeypatch.setattr(
        _coordination.tf.io.gfile, "rename", lambda a, b, overwrite: renames.append((a, b)) or original(a, b, overwrite)
    )
    model.save(tmp_path / "m.keras")
    model.save_weights(tmp_path / "m.weights.h5")
    assert [os.path.basename(b) for _, b in renames] == ["m.keras", "m.weights.h5"]
    assert all(os.path.basename(a).startswith(".m.tmp-") for a, _ in renames)


def test_saved_files_load_with_the_trained_weights(tmp_path, mirrored_1x2_cpu):
    model = _model(mirrored_1x2_cpu)
    x = np.random.RandomState(0).rand(16, 3).astype("float32")
    model.fit(x, x.sum(1, keepdims=True), batch_size=8, epochs=2, verbose=0)
    model.save(tmp_path / "m.keras")
    model.save_weights(tmp_path / "m.weights.h5")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert all(np.array_equal(a, b) for a, b in zip(loaded.get_weights(), model.get_weights()))
    again = _model(mirrored_1x2_cpu)
    again.load_weights(tmp_path / "m.weights.h5")
    assert all(np.array_equal(a, b) for a, b in zip(again.get_weights(), model.get_weights()))
    assert sorted(os.listdir(tmp_path)) == ["m.keras", "m.weights.h5"]


def test_atomic_path_keeps_the_whole_extension(tmp_path):
    with _coordination.atomic_path(tmp_path / "ckpt-01-0.53.weights.h5") as temporary:
        assert temporary.endswith(".weights.h5") and os.path.dirname(temporary) == str(tmp_path)
        open(temporary, "w").close()
    assert os.listdir(tmp_path) == ["ckpt-01-0.53.weights.h5"]


def test_one_worker_keeps_the_callbacks_and_decides_locally(mirrored_1x2_cpu):
    agreement = _coordination.WorkerAgreement(mirrored_1x2_cpu)
    callbacks = [keras.callbacks.CSVLogger("log.csv"), keras.callbacks.EarlyStopping()]
    adapted = _adapt.adapt_callbacks(callbacks, _model(mirrored_1x2_cpu), agreement)
    assert adapted[1:-1] == callbacks and isinstance(adapted[0], _adapt.ExactIterationCount)
    assert isinstance(adapted[-1], _adapt.AgreeOnStop) and not adapted[-1].every_batch
    assert agreement.any(True) and not agreement.any(False)
    agreement.barrier()


def test_user_callbacks_with_batch_hooks_are_agreed_every_batch():
    class Mine(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    assert _adapt._may_stop_alone(Mine())
    assert not _adapt._may_stop_alone(keras.callbacks.TerminateOnNaN())
    assert not _adapt._may_stop_alone(keras.callbacks.Callback())


def test_paths_keras_refuses_or_directories_are_written_directly(tmp_path, mirrored_1x2_cpu):
    """Keras' own errors name the user's path; zipped=False (a directory) is not renamed."""
    model = _model(mirrored_1x2_cpu)
    with pytest.raises(ValueError, match=r"Received: filepath=.*/w[.]h5"):
        model.save_weights(tmp_path / "w.h5")
    with pytest.raises(FileNotFoundError, match="missing/m.keras"):
        model.save(tmp_path / "missing" / "m.keras")
    model.save(tmp_path / "unzipped", zipped=False)
    assert sorted(os.listdir(tmp_path)) == ["unzipped"]
