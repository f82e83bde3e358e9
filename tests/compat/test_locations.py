"""keras_dist._compat.locations and versions: each private name is found where the installed stack keeps it.

Issue 20: TensorFlow 2.18 keeps `coordination_config_pb2` at `tensorflow.tsl.protobuf` (2.19 moved
it with XLA's TSL); Keras 3.16 renames `TensorFlowTrainer` to `Trainer` and moves
`keras.src.backend.tensorflow.nn` to `...tensorflow.ops.nn`. Without these gates `import keras_dist`
fails on those stacks (the tests of the installed stack below would not even be collected).
"""

import importlib
import types

import keras
import pytest
from packaging.version import Version

from keras_dist._compat import locations, versions

pytestmark = pytest.mark.compat


@pytest.fixture
def fake_version(monkeypatch):
    """Returns `set(package, version)`, which makes the gates see `version` as installed."""

    def set_version(package, version):
        monkeypatch.setitem(versions.INSTALLED, package, Version(version))

    return set_version


def test_the_trainer_class_is_the_installed_keras_models_base():
    trainer = locations.tensorflow_trainer_class()
    assert issubclass(keras.Model, trainer)
    assert hasattr(trainer, "_make_function") and hasattr(trainer, "_maybe_symbolic_build")


def test_the_backend_nn_module_is_the_one_keras_ops_calls():
    module = locations.tensorflow_backend_nn_module()
    assert all(
        callable(getattr(module, name)) for name in ("conv", "depthwise_conv", "separable_conv", "conv_transpose")
    )
    from keras.src import backend

    assert module.conv is (backend.ops.nn if versions.release_at_least("keras", "3.16") else backend.nn).conv


def test_the_coordination_protos_are_the_installed_tensorflows():
    protos = locations.coordination_config_module()
    job = protos.CoordinatedJob(name="worker", num_tasks=2)
    assert (job.name, job.num_tasks) == ("worker", 2)


@pytest.fixture
def recorded_imports(monkeypatch):
    """Records the module names the gates import, answering each with a stand-in that has both names."""
    imported = []

    def fake_import(name):
        imported.append(name)
        return types.SimpleNamespace(Trainer="Trainer", TensorFlowTrainer="TensorFlowTrainer")

    monkeypatch.setattr(importlib, "import_module", fake_import)
    return imported


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("3.10.0", "TensorFlowTrainer"),
        ("3.15.1", "TensorFlowTrainer"),
        ("3.16.0.dev2026010203", "Trainer"),
        ("3.16.0", "Trainer"),
    ],
)
def test_keras_3_16_renames_the_trainer(fake_version, recorded_imports, version, expected):
    fake_version("keras", version)
    assert locations.tensorflow_trainer_class() == expected
    assert recorded_imports == ["keras.src.backend.tensorflow.trainer"]


@pytest.mark.parametrize(
    ("version", "module"),
    [
        ("2.18.1", "tensorflow.tsl.protobuf.coordination_config_pb2"),
        ("2.19.0", "tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2"),
        ("2.23.0.dev20260101", "tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2"),
    ],
)
def test_tensorflow_2_19_moved_the_coordination_protos(fake_version, recorded_imports, version, module):
    fake_version("tensorflow", version)
    locations.coordination_config_module()
    assert recorded_imports == [module]


@pytest.mark.parametrize(
    ("version", "module"),
    [
        ("3.10.0", "keras.src.backend.tensorflow.nn"),
        ("3.15.1", "keras.src.backend.tensorflow.nn"),
        ("3.16.0.dev2026102704", "keras.src.backend.tensorflow.ops.nn"),
    ],
)
def test_keras_3_16_moves_the_backend_nn_module(fake_version, recorded_imports, version, module):
    fake_version("keras", version)
    locations.tensorflow_backend_nn_module()
    assert recorded_imports == [module]


def test_autoconvert_optionals_wraps_where_keras_has_the_wrapper_and_not_elsewhere():
    def step(data):
        return data

    model = keras.Sequential([keras.layers.Dense(1)])
    wrapped = locations.autoconvert_optionals(model, step)
    # Keras with optional inputs (3.13.2, 3.15.1) wraps the step; Keras 3.10.0 has no wrapper.
    assert (wrapped is step) == (not hasattr(model, "_autoconvert_optionals"))
    assert locations.autoconvert_optionals(types.SimpleNamespace(), step) is step  # A Keras without it.


# ---- versions: nightly builds (pre-releases) compare sanely.


@pytest.mark.parametrize(
    ("version", "specifiers", "inside"),
    [
        ("3.16.0.dev2026010203", ">=3.10,<3.16", False),  # PEP 440: <3.16 excludes 3.16's pre-releases.
        ("3.16.0.dev2026010203", ">=3.10,<3.17", True),  # SpecifierSet alone would say False (pre-release).
        ("3.15.1", ">=3.10,<3.16", True),
        ("3.9.2", ">=3.10,<3.16", False),
        ("3.16.0", ">=3.10,<3.16", False),
    ],
)
def test_in_range_counts_nightly_builds(fake_version, version, specifiers, inside):
    fake_version("keras", version)
    assert versions.in_range("keras", specifiers) is inside


@pytest.mark.parametrize(
    ("version", "at_least"),
    [("3.15.1", False), ("3.16.0.dev2026010203", True), ("3.16.0rc1", True), ("3.16.0", True), ("4.0.0", True)],
)
def test_release_at_least_counts_a_nightly_as_its_release(fake_version, version, at_least):
    fake_version("keras", version)
    assert versions.release_at_least("keras", "3.16") is at_least


def test_versions_come_from_the_modules_not_the_distribution_names():
    """keras-nightly, tf-nightly and tensorflow-tpu install the same modules under other distribution names."""
    import tensorflow as tf

    assert versions.INSTALLED == {"keras": Version(keras.__version__), "tensorflow": Version(tf.__version__)}
