"""Layer 1: `distribute(model)`, turning a model that exists into a `DistributedModel`."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from keras_dist import collectives
from keras_dist._model import DistributedModel
from keras_dist._runtime import keras_internals as ki
from keras_dist.collectives._options import CommunicationValue
from keras_dist.data._sharding import validate_auto_shard_policy
from keras_dist.strategy import _resolve

_STEP_METHODS = ("train_step", "test_step", "predict_step", "compute_loss")


def distribute(
    model: keras.Model,
    *,
    strategy: str | tf.distribute.Strategy = "auto",
    communication: CommunicationValue = None,
    auto_shard_policy: str = "auto",
) -> DistributedModel:
    """Returns a `DistributedModel` that trains `model`'s layers under a strategy.

    The layer objects and their weights are kept (trained or not): their
    variables are re-created under the strategy's scope with their current
    values. A compiled `model` is compiled again with the same optimizer
    object (its state kept), loss and metrics.

    Args:
        model: `keras.Model`: functional, `Sequential` or subclassed; or a
            `DistributedModel`, which is moved to `strategy`.
        strategy: A `tf.distribute.Strategy` or a name, as for
            `DistributedModel`. Defaults to `"auto"`.
        communication: As for `DistributedModel`: a
            `keras_dist.CommunicationOptions` or `None`.
        auto_shard_policy: As for `DistributedModel`. Defaults to `"auto"`.

    Returns:
        `DistributedModel`. A functional or built `Sequential` model becomes a
        functional `DistributedModel` over the same graph; any other model is
        wrapped (`model.wrapped_model` is the original).

    Raises:
        TypeError: `model` is not a `keras.Model`.
        ValueError: `model` overrides `train_step`, `test_step`, `predict_step`
            or `compute_loss` (subclass `keras_dist.DistributedModel` instead,
            so the override runs under the strategy).

    Example:
    >>> import keras, keras_dist
    >>> plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> dm = keras_dist.distribute(plain)
    >>> [w.shape for w in dm.get_weights()] == [w.shape for w in plain.get_weights()]
    True
    """
    options = {"communication": communication, "auto_shard_policy": auto_shard_policy}
    if isinstance(model, DistributedModel):
        ki.set_distribute_strategy(model, _resolve.resolve_strategy(strategy))
        model.communication = collectives.CommunicationOptions.from_value(communication)
        model.auto_shard_policy = validate_auto_shard_policy(auto_shard_policy)
        model.train_function = None
        model._distribute_state()
        return model
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`distribute` expects a `keras.Model`. "
            f"Received: model of type {type(model).__name__}. Fix: pass a Keras model, "
            "or build one with `keras_dist.DistributedModel(inputs, outputs)`."
        )
    overridden = [name for name in _STEP_METHODS if getattr(type(model), name) is not getattr(keras.Model, name)]
    if overridden:
        raise ValueError(
            f"`distribute` cannot carry over overridden {overridden} of "
            f"{type(model).__name__}: they would run outside keras-dist's step. "
            f"Fix: make {type(model).__name__} subclass `keras_dist.DistributedModel` "
            "instead of `keras.Model`."
        )
    graph = _functional_graph(model)
    if graph is not None:
        distributed = DistributedModel(*graph, name=model.name, strategy=strategy, **options)
    else:
        distributed = WrappedModel(model, strategy=strategy, **options)
    compile_args = ki.compile_arguments(model)
    if compile_args is not None:
        distributed.compile(**compile_args)
    return distributed


def _functional_graph(model: keras.Model) -> tuple[Any, Any] | None:
    """Returns `(inputs, outputs)` of a functional or built Sequential model, else `None`."""
    if isinstance(model, ki.Functional) or isinstance(model, keras.Sequential):
        try:
            inputs, outputs = model.inputs, model.outputs
        except (AttributeError, ValueError):
            return None
        if inputs and outputs:
            if isinstance(model, ki.Functional):
                return ki.functional_structure(model)
            return inputs, outputs
    return None


@keras.saving.register_keras_serializable(package="keras_dist")
class WrappedModel(DistributedModel):
    """A `DistributedModel` that calls a subclassed (non-functional) Keras model.

    Made by `keras_dist.distribute`; use that instead of constructing it.

    Args:
        model: The `keras.Model` to call; available as `wrapped_model`.
        strategy: As for `DistributedModel`.
        **kwargs: Keras `Model` keyword arguments.
    """

    def __init__(self, model: keras.Model, *, strategy: str | tf.distribute.Strategy = "auto", **kwargs: Any) -> None:
        kwargs.setdefault("name", f"distributed_{model.name}")
        super().__init__(strategy=strategy, **kwargs)
        self.wrapped_model = model
        if model.built:
            self.built = True
        self._distribute_state()

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        return self.wrapped_model(inputs, training=training)

    def build(self, input_shape: Any) -> None:
        if not self.wrapped_model.built:
            self.wrapped_model.build(input_shape)

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "model": keras.saving.serialize_keras_object(self.wrapped_model)}

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: dict[str, Any] | None = None) -> WrappedModel:
        config = dict(config)
        model = keras.saving.deserialize_keras_object(config.pop("model"), custom_objects=custom_objects)
        return cls(model, **config)
