"""Where the installed Keras and TensorFlow keep the private names keras-dist imports (issue 20).

A release that moves a module or renames a class changes this file alone: each name is looked up
where the installed version keeps it, gated on that version, with one line saying which release moved
it. `keras_dist._runtime` imports these names from here; `tests/compat/test_locations.py` checks each
one on the installed stack and that each gate picks the other place on the other side of it.
"""

import importlib

from keras_dist._compat import versions


def tensorflow_trainer_class():
    """Returns Keras' TensorFlow-backend trainer class (the base of `keras.Model` under TensorFlow)."""
    module = importlib.import_module("keras.src.backend.tensorflow.trainer")
    # Keras 3.16 renames TensorFlowTrainer to Trainer (keras-nightly 3.16.0.dev).
    return module.Trainer if versions.release_at_least("keras", "3.16") else module.TensorFlowTrainer


def coordination_config_module():
    """Returns TensorFlow's `coordination_config_pb2` (the coordination service's `CoordinatedJob` protos)."""
    # TensorFlow 2.19 moved it with XLA's TSL, from tensorflow.tsl.protobuf (TF 2.18.1 has it there only).
    if versions.release_at_least("tensorflow", "2.19"):
        return importlib.import_module("tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2")
    return importlib.import_module("tensorflow.tsl.protobuf.coordination_config_pb2")


def tensorflow_backend_nn_module():
    """Returns the module of Keras' TensorFlow-backend `nn` functions (`conv`, `depthwise_conv`, ...) that `keras.ops` calls."""
    # Keras 3.16 moves keras.src.backend.tensorflow.nn to keras.src.backend.tensorflow.ops.nn.
    if versions.release_at_least("keras", "3.16"):
        return importlib.import_module("keras.src.backend.tensorflow.ops.nn")
    return importlib.import_module("keras.src.backend.tensorflow.nn")


def coordination_register_barrier_supported():
    """Whether TensorFlow's `CoordinationServiceConfig` has `cluster_register_with_barrier` (TF 2.20 has, 2.18.1 has not).

    Asked of the installed protos, not the version: TensorFlow 2.19 was not measured.
    """
    fields = coordination_config_module().CoordinationServiceConfig.DESCRIPTOR.fields_by_name
    return "cluster_register_with_barrier" in fields


def autoconvert_optionals(model, function):
    """Returns `function` wrapped by `model._autoconvert_optionals`, where the installed Keras has that wrapper.

    Keras wraps its step function so that `None` (optional) inputs cross `tf.function`; Keras 3.10.0
    has no such wrapper (nor optional inputs), so there the step function is used as it is. Asked of
    the installed Keras, not the version: the releases between 3.10 and 3.13 were not measured.
    """
    wrap = getattr(model, "_autoconvert_optionals", None)
    return function if wrap is None else wrap(function)
