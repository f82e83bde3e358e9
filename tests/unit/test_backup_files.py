"""BackupAndRestore's files under DistributedModel: another topology, a damaged backup, a crash mid-save, a full disk.

The model has BatchNormalization (synchronized: N replicas then compute the global batch's
moments, as one device does) and Adam; the reference is an uninterrupted run on one device.
"""

import json
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from keras_dist.callbacks import _backup_files, _resume
from keras_dist.testing import clean_env

X = np.random.RandomState(0).rand(64, 3).astype("float32")
Y = X.sum(1, keepdims=True)
ATOL = 1e-5


@pytest.fixture(scope="module")
def one_device():
    return tf.distribute.OneDeviceStrategy("/cpu:0")


def _model(strategy):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, use_bias=False)(inputs)  # A bias before BatchNormalization has no gradient.
    hidden = keras.layers.BatchNormalization(synchronized=True)(hidden)
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(hidden), strategy=strategy)
    # epsilon=1e-3: near-zero gradients under Adam's default 1e-7 turn float rounding into 1e-4.
    model.compile(optimizer=keras.optimizers.Adam(0.05, epsilon=1e-3), loss="mse")
    return model


def _fit(model, callbacks=(), batch_size=8):
    return model.fit(X, Y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0, callbacks=list(callbacks))


class Crash(Exception):
    pass


class CrashAtStep(keras.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self.step, self.seen = step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            raise Crash(f"crash after step {self.step}")


def _backup(backup_dir, **kwargs):
    return keras.callbacks.BackupAndRestore(str(backup_dir), save_freq=3, **kwargs)


def _crash(strategy, backup_dir, step=11, **kwargs):
    """Trains until step `step` with a backup every 3 steps (the last at step 9: epoch 1, 1 step in)."""
    with pytest.raises(Crash):
        _fit(_model(strategy), [_backup(backup_dir, **kwargs), CrashAtStep(step)])


def _max_difference(model, reference):
    pairs = zip(model.weights + model.optimizer.variables, reference.weights + reference.optimizer.variables)
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs)


@pytest.fixture(scope="module")
def uninterrupted(one_device):
    model = _model(one_device)
    _fit(model)
    return model


def _metadata(backup_dir):
    return json.loads((backup_dir / "training_metadata.json").read_text())


@pytest.mark.parametrize("before, after", [("mirrored_1x2_cpu", "one_device"), ("one_device", "mirrored_1x3_cpu")])
def test_a_backup_resumes_on_another_number_of_replicas_as_one_device(request, tmp_path, uninterrupted, before, after):
    """1x2 -> 1x1, and 1x1 -> 1x3, where the global batch of 8 splits 3+3+2 (exact: each example weighs once)."""
    backup_dir = tmp_path / "backup"
    _crash(request.getfixturevalue(before), backup_dir)
    metadata = _metadata(backup_dir)
    assert metadata["epoch"] == 1 and metadata[_resume.STEPS_KEY] == 1
    assert metadata[_resume.GLOBAL_BATCH_KEY] == 8 and metadata[_resume.NUM_WORKERS_KEY] == 1
    assert metadata[_resume.NUM_REPLICAS_KEY] == request.getfixturevalue(before).num_replicas_in_sync

    resumed = _model(request.getfixturevalue(after))
    _fit(resumed, [_backup(backup_dir)])
    assert int(np.asarray(resumed.optimizer.iterations)) == 16
    difference = _max_difference(resumed, uninterrupted)
    print(f"{before} -> {after}: max |difference| {difference:.3g}")
    assert difference <= ATOL


def test_another_global_batch_size_resumes_after_the_same_examples_with_a_warning(tmp_path, mirrored_1x2_cpu):
    backup_dir = tmp_path / "backup"
    _crash(mirrored_1x2_cpu, backup_dir, step=14)  # Last backup at step 12: epoch 1, 4 steps (32 examples) in.
    seen = []

    class Batches(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)

    with pytest.warns(keras_dist.errors.KerasDistWarning, match="global batch size of 8.*this run's is 16"):
        resumed = _model(mirrored_1x2_cpu)
        _fit(resumed, [_backup(backup_dir), Batches()], batch_size=16)
    assert seen == [0, 1]  # The last epoch from example 32 on: 2 batches of 16.
    assert int(np.asarray(resumed.optimizer.iterations)) == 12 + 2


def test_a_global_batch_size_that_does_not_divide_the_examples_done_replays_the_epoch(tmp_path, mirrored_1x2_cpu):
    backup_dir = tmp_path / "backup"
    _crash(mirrored_1x2_cpu, backup_dir, step=14)  # 32 examples into epoch 1.
    with pytest.warns(keras_dist.errors.KerasDistWarning, match=r"batch size is 12 .*does not divide 32"):
        _fit(_model(mirrored_1x2_cpu), [_backup(backup_dir)], batch_size=12)


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: _truncate(d / "latest.weights.h5"),
        lambda d: (d / "training_metadata.json").write_text("{garbage"),
    ],
    ids=["weights_cut_in_half", "garbage_metadata"],
)
def test_a_damaged_backup_falls_back_to_the_previous_one_with_a_warning(tmp_path, one_device, uninterrupted, damage):
    backup_dir = tmp_path / "backup"
    _crash(one_device, backup_dir, double_checkpoint=True)  # Backups at steps 6 (kept as previous*) and 9.
    assert _metadata(backup_dir)[_backup_files.GENERATION_KEY] == 3
    damage(backup_dir)
    resumed = _model(one_device)
    with pytest.warns(keras_dist.errors.KerasDistWarning, match=r"is not complete; resuming from the previous") as w:
        _fit(resumed, [_backup(backup_dir, double_checkpoint=True)])
    message = next(str(x.message) for x in w if "is not complete" in str(x.message))
    assert "previous.weights.h5" in message and "previous_training_metadata.json" in message
    assert int(np.asarray(resumed.optimizer.iterations)) == 16  # From step 6: steps 7-9 trained again.
    assert _max_difference(resumed, uninterrupted) <= ATOL


def test_no_complete_backup_is_an_error_that_names_the_files_and_overwrites_nothing(tmp_path, one_device):
    backup_dir = tmp_path / "backup"
    _crash(one_device, backup_dir)
    _truncate(backup_dir / "latest.weights.h5")
    before = {p.name: p.read_bytes() for p in backup_dir.iterdir()}
    with pytest.raises(OSError, match=r"no complete backup in .*latest\.weights\.h5.*truncated or corrupted.*Fix:"):
        _fit(_model(one_device), [_backup(backup_dir)])
    assert {p.name: p.read_bytes() for p in backup_dir.iterdir()} == before


@pytest.mark.parametrize("renames_before_crash", [0, 1, 2, 3])
def test_a_crash_in_the_middle_of_a_save_leaves_a_complete_backup(
    tmp_path, one_device, uninterrupted, monkeypatch, renames_before_crash
):
    """The third save (step 9) dies after 0..3 of its renames; the resume finds step 6's or step 9's backup."""
    backup_dir = tmp_path / "backup"
    rename, commit = tf.io.gfile.rename, _backup_files.commit
    calls = {"saves": 0, "renames": 0, "in_third_save": False}

    def counting_commit(*args, **kwargs):
        calls["saves"] += 1
        calls["in_third_save"] = calls["saves"] == 3
        try:
            return commit(*args, **kwargs)
        finally:
            calls["in_third_save"] = False

    def dying_rename(source, target, overwrite=False):
        if calls["in_third_save"]:  # Its renames: latest and metadata to .bkp, the new metadata, the new weights.
            if calls["renames"] == renames_before_crash:
                raise Crash("died during the save")
            calls["renames"] += 1
        return rename(source, target, overwrite=overwrite)

    monkeypatch.setattr(_backup_files, "commit", counting_commit)
    monkeypatch.setattr(tf.io.gfile, "rename", dying_rename)
    with pytest.raises(Crash):
        _fit(_model(one_device), [_backup(backup_dir, double_checkpoint=True)])
    monkeypatch.undo()
    resumed = _model(one_device)
    _fit(resumed, [_backup(backup_dir, double_checkpoint=True)])
    assert _max_difference(resumed, uninterrupted) <= ATOL


_DISK_FULL_SCRIPT = """
import json, os, resource, signal, sys
import keras, numpy as np
import keras_dist

backup_dir = sys.argv[1]
x = np.random.RandomState(0).rand(32, 3).astype("float32")
inputs = keras.Input((3,))
model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs))
model.compile(optimizer="adam", loss="mse")
backup = lambda: keras.callbacks.BackupAndRestore(backup_dir, save_freq=2, delete_checkpoint=False)
model.fit(x, x.sum(1), batch_size=8, epochs=1, verbose=0, callbacks=[backup()])  # A complete backup.
before = {name: open(os.path.join(backup_dir, name), "rb").read() for name in sorted(os.listdir(backup_dir))}
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # Writes past the limit fail with EFBIG, as on a full disk.
limit = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
try:
    model.fit(x, x.sum(1), batch_size=8, epochs=2, verbose=0, callbacks=[backup()])
    error = None
except OSError as e:
    error = str(e)
resource.setrlimit(resource.RLIMIT_FSIZE, limit)
after = {name: open(os.path.join(backup_dir, name), "rb").read() for name in sorted(os.listdir(backup_dir))}
print(json.dumps({"error": error, "intact": before == after, "names": sorted(after)}))
"""


def test_a_save_on_a_full_disk_keeps_the_previous_backup_and_names_path_and_fix(tmp_path):
    script = tmp_path / "disk_full.py"
    script.write_text(textwrap.dedent(_DISK_FULL_SCRIPT))
    backup_dir = tmp_path / "backup"
    env = clean_env(TF_CPP_MIN_LOG_LEVEL="3", KERAS_DIST_QUIET="1")
    done = subprocess.run(
        [sys.executable, str(script), str(backup_dir)], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["intact"], result  # The previous weights and metadata, byte for byte; no temporary file left.
    assert result["names"] == ["latest.weights.h5", "training_metadata.json"]
    assert str(backup_dir) in result["error"] and "file-size limit (ulimit -f, RLIMIT_FSIZE) is 4096" in result["error"]
    assert "The previous backup is intact" in result["error"]
    assert "Fix: raise the limit (`ulimit -f unlimited`), or pass another `backup_dir`" in result["error"]
