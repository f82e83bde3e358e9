"""`save`, `save_weights` and `load_weights` of a `DistributedModel`, and its compile config on load.

Files are written on the chief only, under a temporary name renamed into
place (`WorkerAgreement.chief_writes`); every worker calls them and returns
once the file is complete. A partial gradient-accumulation cycle (each
replica's running sums) is saved in Keras' accumulators and continues after
`load_weights`.
"""

import os

import keras
import tensorflow as tf

from keras_dist.collectives import _optimizer as collectives_optimizer


def save(model, keras_save, filepath, args, kwargs):
    """`DistributedModel.save` with Keras' `save` (`keras_save`, bound)."""
    with collectives_optimizer.accumulation_saved_with_weights(
        getattr(model, "optimizer", None), model._distribute_strategy
    ):
        if _asks_before_overwriting(filepath, args, kwargs):  # Keras' interactive prompt, on the real path.
            return keras_save(filepath, *args, **kwargs)
        return model._agreement().chief_writes(
            lambda path: keras_save(path, *args, **kwargs),
            filepath,
            atomic=kwargs.get("zipped") is not False,  # zipped=False writes a directory: not renamed atomically.
        )


def save_weights(model, keras_save_weights, filepath, args, kwargs):
    """`DistributedModel.save_weights` with Keras' `save_weights` (`keras_save_weights`, bound)."""
    with collectives_optimizer.accumulation_saved_with_weights(
        getattr(model, "optimizer", None), model._distribute_strategy
    ):
        if _asks_before_overwriting(filepath, args, kwargs):
            return keras_save_weights(filepath, *args, **kwargs)
        return model._agreement().chief_writes(
            lambda path: keras_save_weights(path, *args, **kwargs),
            filepath,
            extensions=(".weights.h5", ".weights.json"),
        )


def load_weights(model, keras_load_weights, filepath, args, kwargs):
    """`DistributedModel.load_weights` with Keras' `load_weights` (`keras_load_weights`, bound)."""
    result = keras_load_weights(filepath, *args, **kwargs)
    collectives_optimizer.accumulation_loaded_with_weights(
        getattr(model, "optimizer", None), model._distribute_strategy
    )
    return result


def compile_from_config(model, config):
    """Compiles `model` from a saved compile config, and builds its optimizer when the model is built."""
    model.compile(**keras.saving.deserialize_keras_object(config))
    if model.built:
        with model._distribute_strategy.scope():
            model.optimizer.build(model.trainable_variables)


def _asks_before_overwriting(filepath, args, kwargs):
    overwrite = args[0] if args else kwargs.get("overwrite", True)
    return not overwrite and tf.io.gfile.exists(os.fspath(filepath))
