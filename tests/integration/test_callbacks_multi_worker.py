"""Standard Keras callbacks on 2 workers: chief-only atomic writes, chief-only logs, agreed stops."""

import json
import os

import keras
import numpy as np
import pytest

from keras_dist.testing import clean_env, run_launcher

pytestmark = pytest.mark.multi_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "callbacks_worker.py")
ENV = clean_env(TF_CPP_MIN_LOG_LEVEL="3", KERAS_DIST_QUIET="1")


def _launch(tmp_path, scenario):
    result = run_launcher(["--num-workers", "2", WORKER, str(tmp_path), scenario], env=ENV, timeout=150)
    assert result.returncode == 0, result.stdout[-4000:]
    return [json.load(open(tmp_path / f"worker-{i}.json")) for i in range(2)]


@pytest.mark.timeout(180)
def test_standard_callbacks_write_once_on_the_chief_and_files_load(tmp_path):
    chief, other = _launch(tmp_path, "standard")
    run = tmp_path / "run"
    assert sorted(os.listdir(run)) == [
        "backup",
        "batch.weights.h5",
        "best.weights.h5",
        "ckpt-01.keras",
        "ckpt-02.keras",
        "final.keras",
        "log.csv",
        "tensorboard",
    ]  # No temporary files left; EarlyStopping stopped both workers after epoch 2.
    assert chief["calls"] == {"keras_save": 3, "keras_save_weights": 7, "csv_epoch_end": 2, "tensorboard_epoch_end": 2}
    assert other["calls"] == {"keras_save": 0, "keras_save_weights": 0, "csv_epoch_end": 0, "tensorboard_epoch_end": 0}
    assert chief["epochs"] == other["epochs"] == 2 and chief["iterations"] == other["iterations"] == 16
    assert chief["learning_rate"] == other["learning_rate"] == pytest.approx(0.025)  # ReduceLROnPlateau, on both
    trained = [np.array(w, "float32") for w in chief["weights"]]
    assert all(np.array_equal(a, np.array(b, "float32")) for a, b in zip(trained, other["weights"]))

    for name in ("ckpt-02.keras", "final.keras"):
        loaded = keras.models.load_model(run / name)
        assert all(np.allclose(a, b) for a, b in zip(loaded.get_weights(), trained)), name
    inputs = keras.Input((4,))
    plain = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    plain.load_weights(run / "best.weights.h5")  # Loss fell every epoch: the best is the last.
    assert all(np.allclose(a, b) for a, b in zip(plain.get_weights(), trained))
    metadata = json.loads((run / "backup" / "training_metadata.json").read_text())
    assert {k: metadata[k] for k in ("epoch", "batch", "keras_dist_steps_done_in_epoch")} == {
        "epoch": 2,
        "batch": 0,
        "keras_dist_steps_done_in_epoch": 0,
    }
    assert metadata["keras_dist_num_workers"] == 2  # With the global batch and the replicas (docs/callbacks.md).
    assert (run / "log.csv").read_text().count("\n") == 3  # Header and 2 epochs, written once.


@pytest.mark.timeout(180)
def test_a_stop_on_one_worker_stops_both_at_the_same_batch(tmp_path):
    """Without the agreement worker 1 leaves fit and worker 0 waits in the next step's collective."""
    first, second = _launch(tmp_path, "stop_one")
    assert first["iterations"] == second["iterations"] == 8 + 3
    assert first["epochs"] == second["epochs"] == 2
    assert first["weights"] == second["weights"]


@pytest.mark.timeout(180)
def test_a_stop_set_at_epoch_begin_on_one_worker_stops_both(tmp_path):
    first, second = _launch(tmp_path, "stop_at_epoch_begin")
    assert first["iterations"] == second["iterations"] == 8 + 1  # Keras stops after epoch 1's first batch.
    assert first["weights"] == second["weights"]


GUARDED_SAVE_SCRIPT = """
import sys, time
import keras_dist
import keras, numpy as np

x = np.random.RandomState(0).rand(32, 4).astype("float32")
inputs = keras.Input((4,))
model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs))
model.compile(optimizer="sgd", loss="mse")
model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
if keras_dist.is_chief():
    model.save(sys.argv[1] + "/guarded.keras")  # The other worker never calls save.
else:
    time.sleep(60)
"""


@pytest.mark.timeout(120)
def test_a_save_guarded_by_is_chief_fails_with_the_fix_instead_of_hanging(tmp_path):
    script = tmp_path / "guarded.py"
    script.write_text(GUARDED_SAVE_SCRIPT)
    result = run_launcher(
        ["--num-workers", "2", "--grace-period", "2", str(script), str(tmp_path)],
        env={**ENV, "KERAS_DIST_WRITE_TIMEOUT": "5"},
        timeout=110,
    )
    assert result.returncode == 1, result.stdout[-3000:]
    assert "the other workers did not join it within 5 s" in result.stdout
    assert "Fix: call `model.save(...)` on every worker" in result.stdout
    assert keras.models.load_model(tmp_path / "guarded.keras") is not None  # The chief's file is complete.
