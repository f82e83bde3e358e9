"""What `DistributedModel(...)` checks and builds before Keras' own constructor runs.

The constructor's own arguments (`strategy`, `communication`,
`auto_shard_policy`), the refusal of a model made inside another strategy's
scope, and the functional style: a separate class with Keras' `Functional`
mixed in, made once per class, so that `DistributedModel` stays usable for
subclassing after it was used functionally.
"""

import keras
import tensorflow as tf

from keras_dist._runtime import keras_internals as ki
from keras_dist.strategy import _resolve

OWN_ARGUMENTS = ("strategy", "communication", "auto_shard_policy")  # DistributedModel's, not keras.Model's.
_FUNCTIONAL_CLASSES = {}


def resolve_strategy(strategy):
    """The `tf.distribute.Strategy` for `DistributedModel(strategy=...)`; refuses one inside another's scope."""
    resolved = _resolve.resolve_strategy(strategy)
    if tf.distribute.has_strategy() and tf.distribute.get_strategy() is not resolved:
        raise ValueError(
            "A DistributedModel must be created under its own strategy's scope or under "
            f"none. Received: strategy={type(resolved).__name__} inside the scope of "
            f"another {type(tf.distribute.get_strategy()).__name__}. Fix: leave "
            '`strategy="auto"` to use the enclosing scope\'s strategy, or create the '
            "model outside `with strategy.scope():`."
        )
    return resolved


def require_gpus_for_nccl(communication):
    if communication.implementation == "nccl" and not tf.config.list_physical_devices("GPU"):
        raise ValueError(
            "CommunicationOptions(implementation='nccl') needs GPUs: NCCL all-reduces between GPUs "
            "only, and this machine has none. Received: implementation='nccl' with 0 GPUs. Fix: use "
            "implementation='ring' (CPUs, between hosts) or 'auto' (NCCL when there are GPUs)."
        )


def init_keras_model(model, args, kwargs):
    """Runs Keras' constructor on `model`: `Functional`'s for `(inputs, outputs)`, `keras.Model`'s otherwise."""
    if ki.functional_init_arguments(args, kwargs):
        if not isinstance(model, ki.Functional):
            # A subclass's own __init__ passed (inputs, outputs) on. keras.Model.__init__ would
            # rewrite this class's bases for good; this instance alone becomes functional instead.
            model.__class__ = functional_class(type(model))
        ki.Functional.__init__(model, *args, **kwargs)
    else:
        keras.Model.__init__(model, *args, **kwargs)


def functional_class(cls):
    """Returns `cls` with `Functional` mixed in, made once per class.

    Keras turns a `Model` subclass into a functional one by rewriting the
    class's `__bases__` in place, for every later use too; a separate class per
    style keeps `DistributedModel` usable for subclassing after it was used
    functionally. Saved files name the original class.
    """
    if cls not in _FUNCTIONAL_CLASSES:
        functional_cls = type(
            cls.__name__,
            (cls, ki.Functional),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__},
        )
        registered = keras.saving.get_registered_name(cls)
        if registered != cls.__name__:
            package, name = registered.split(">", 1)
            keras.saving.register_keras_serializable(package, name)(functional_cls)
            keras.saving.register_keras_serializable(package, name)(cls)
        _FUNCTIONAL_CLASSES[cls] = functional_cls
    return _FUNCTIONAL_CLASSES[cls]
