"""Save/load round trips: `.keras` files and weights-only, across replica counts."""

import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import keras_dist
from keras_dist.testing import clean_env, max_weight_difference


def _trained_functional(strategy):
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = keras.layers.Dense(2)(keras.layers.BatchNormalization()(hidden))
    model = keras_dist.DistributedModel(inputs, outputs, strategy=strategy)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x = np.random.RandomState(0).rand(40, 4).astype("float32")
    model.fit(x, x[:, :2] * 3, batch_size=8, epochs=2, verbose=0)
    return model, x


def test_keras_file_loads_back_on_another_replica_count(mirrored_1x2_cpu, mirrored_1x3_cpu, tmp_path):
    model, x = _trained_functional(mirrored_1x2_cpu)
    path = str(tmp_path / "model.keras")
    model.save(path)
    with mirrored_1x3_cpu.scope():
        loaded = keras.models.load_model(path)
    assert isinstance(loaded, keras_dist.DistributedModel)
    assert loaded.distribute_strategy is mirrored_1x3_cpu
    assert loaded.optimizer is not None and loaded.compiled
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)
    # Optimizer state (iterations, Adam moments) came back too, mirrored on 3 replicas.
    saved_state = [v.numpy() for v in model.optimizer.variables]
    loaded_state = [v.numpy() for v in loaded.optimizer.variables]
    assert len(saved_state) == len(loaded_state) > 2
    for a, b in zip(saved_state, loaded_state):
        np.testing.assert_array_equal(a, b)
    assert {type(v.value).__name__ for v in loaded.optimizer.variables} == {"MirroredVariable"}


def test_weights_only_round_trip(mirrored_1x2_cpu, tmp_path):
    model, x = _trained_functional(mirrored_1x2_cpu)
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    plain = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.BatchNormalization()(hidden)))
    plain.load_weights(path)
    assert max_weight_difference(model, plain) == 0
    np.testing.assert_allclose(plain.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)


def test_subclassed_and_wrapped_models_round_trip(mirrored_1x2_cpu, tmp_path):
    @keras.saving.register_keras_serializable(package="tests")
    class Net(keras_dist.DistributedModel):
        def __init__(self, units=3, **kwargs):
            super().__init__(**kwargs)
            self.units = units
            self.dense = keras.layers.Dense(units)

        def call(self, x):
            return self.dense(x)

        def get_config(self):
            return {**super().get_config(), "units": self.units}

    x = np.random.RandomState(1).rand(10, 4).astype("float32")
    net = Net(units=3, strategy=mirrored_1x2_cpu)
    net(x[:2])
    wrapped = keras_dist.distribute(keras.Sequential([keras.layers.Dense(2)]), strategy=mirrored_1x2_cpu)
    wrapped(x[:2])
    for model in (net, wrapped):
        path = str(tmp_path / f"{model.name}.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        assert type(loaded) is type(model)
        np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)


@pytest.mark.timeout(120)
def test_loads_in_a_plain_single_device_process(mirrored_1x2_cpu, tmp_path):
    """A file saved on 2 replicas loads with plain `keras.models.load_model` on one device."""
    model, x = _trained_functional(mirrored_1x2_cpu)
    model.save(str(tmp_path / "model.keras"))
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "expected.npy", model.predict(x, verbose=0))
    script = textwrap.dedent(
        """
        import sys, numpy as np, keras, keras_dist
        loaded = keras.models.load_model(sys.argv[1] + "/model.keras")
        assert loaded.distribute_strategy.num_replicas_in_sync == 1, loaded.distribute_strategy
        got = loaded.predict(np.load(sys.argv[1] + "/x.npy"), verbose=0)
        np.testing.assert_allclose(got, np.load(sys.argv[1] + "/expected.npy"), atol=1e-6)
        print("LOADED_OK", type(loaded).__name__)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        env=clean_env(KERAS_DIST_QUIET="1"),
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LOADED_OK DistributedModel" in result.stdout
