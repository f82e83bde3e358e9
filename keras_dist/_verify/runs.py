"""The two training runs of `verify` and the state kept around them.

`State` keeps everything `fit` changes on a model (`_runtime.snapshots`); the
reference run moves the model onto one device (`variables.rehome`, through
the model's own `_distribute_state`) and the state's `restore` moves it back.
"""

import contextlib
import os
from collections.abc import Mapping

import keras
import numpy as np
import tensorflow as tf

from keras_dist import _env
from keras_dist._runtime import accumulation, optimizer_patches, snapshots, variables
from keras_dist._runtime import keras_internals as ki
from keras_dist._verify import batches as verify_batches

# Layer classes whose randomness `random_layers="off"` switches off, with the attribute set to 0.
SWITCHABLE = (
    (keras.layers.Dropout, "rate"),  # SpatialDropout1D/2D/3D too
    (keras.layers.GaussianDropout, "rate"),
    (keras.layers.AlphaDropout, "rate"),
    (keras.layers.GaussianNoise, "stddev"),
)
_ONE_DEVICE: dict = {}


def optimizers(model):
    """The compiled optimizer, those in the model's attributes, and every optimizer they wrap, each once."""
    found = variables.optimizers_in([getattr(model, "optimizer", None), *vars(model).values()])
    chain, seen = [], set()
    for optimizer in found:
        for opt in variables.nested_optimizers(optimizer):
            if id(opt) not in seen:
                seen.add(id(opt))
                chain.append(opt)
    return chain


class State:
    """What `fit` changes on a model: variables (backing and values), model and optimizer attributes, seeds.

    Args:
        model: The `DistributedModel`, built.
        optimizers: Its optimizers (`optimizers(model)`).
    """

    def __init__(self, model, optimizers):
        owned = {}
        for v in [*model.variables, *model.weights, *metrics_variables(model)]:
            owned.setdefault(id(v), v)
        for optimizer in optimizers:
            for v in optimizer.variables:
                owned.setdefault(id(v), v)
        patch_states = [s for s in (optimizer_patches.state(o) for o in optimizers) if s is not None]
        sums = [v for s in patch_states if s.sums is not None for v in s.sums.variables()]
        self.variables = snapshots.VariableSnapshot(owned.values(), sums)
        self.objects = [snapshots.ObjectSnapshot(obj) for obj in (model, *optimizers, *patch_states)]
        self.seeds = snapshots.GlobalSeedSnapshot()

    def restore(self):
        for obj in self.objects:
            obj.restore()
        self.variables.restore()
        self.seeds.restore()


def metrics_variables(model):
    try:
        return list(model.metrics_variables)
    except AttributeError:  # A `metrics` property reading attributes set after __init__.
        return []


def build(model, batch):
    """Builds the model, its metrics and compiled optimizer as `fit` does first (from one batch's spec).

    Raises:
        ValueError: A layer is still not built (it would build inside the first step, on one device).
    """
    spec = tf.nest.map_structure(_spec_without_batch_size, batch)
    model._maybe_symbolic_build(data_batch=spec)
    unbuilt = [layer.name for layer in model._flatten_layers(include_self=False) if not layer.built]
    if unbuilt:
        raise ValueError(
            "`verify` must know every variable before it trains, to put the model back as it was; "
            f"these layers are not built yet: {unbuilt}. Fix: build them first, e.g. call the model "
            "(or the layer) on one batch, or `layer.build(input_shape)`."
        )


def _spec_without_batch_size(value):
    spec = tf.type_spec_from_value(value)
    if isinstance(spec, tf.TensorSpec) and spec.shape.rank:
        return tf.TensorSpec([None, *spec.shape[1:]], spec.dtype)
    return spec


def compared_variables(model, optimizers):
    """`[(path, variable)]`: the model's weights, then every optimizer's variables (each once; paths made unique)."""
    compared, seen, paths = [], set(), set()
    for v in [*model.weights, *(v for o in optimizers for v in o.variables)]:
        if id(v) in seen or v.name == variables.SEED_STATE_NAME:
            continue
        seen.add(id(v))
        path = getattr(v, "path", None) or v.name
        unique, n = path, 2
        while unique in paths:
            unique, n = f"{path}#{n}", n + 1
        paths.add(unique)
        compared.append((unique, v))
    return compared


def switch_off_random_layers(model):
    """Sets the rate (stddev) of Dropout-like layers to 0; returns `[(layer, attribute, old value)]`."""
    changed = []
    for layer in model._flatten_layers(include_self=False):
        for cls, attribute in SWITCHABLE:
            if isinstance(layer, cls) and getattr(layer, attribute, 0):
                changed.append((layer, attribute, getattr(layer, attribute)))
                setattr(layer, attribute, 0.0)
                break
    return changed


def accumulators_hold_sums(optimizers, strategy):
    """Gradient accumulation: Keras' accumulators get keras-dist's per-replica running sums, summed.

    Under several replicas keras-dist keeps a partial cycle in its own sums
    while Keras' accumulators stay zero; one device reads the partial cycle
    from Keras' (and so does the comparison). Collective under several
    workers (reading a sum sums it over them).
    """
    for optimizer in optimizers:
        state = optimizer_patches.state(optimizer)
        if state is not None and state.sums is not None:
            accumulation.copy_sums_to_keras_accumulators(optimizer, state.sums_variables, state.sums, strategy)


def check_no_new_variables(model, state):
    new = [
        getattr(v, "path", v.name)
        for v in [*model.variables, *metrics_variables(model)]
        if id(v) not in state.variables.keras_variable_ids
    ]
    if new:
        raise RuntimeError(
            f"The model created variables during `verify`'s first step ({new}); `verify` cannot put those "
            "back (they keep what the one-device steps made of them). Fix: build every layer before calling "
            "`verify` (call the model on one batch), then rebuild or reload this model."
        )


class _StepLogs(keras.callbacks.Callback):
    """Records `fit`'s logs after every step as Python floats (nested dicts flattened as `outer/inner`)."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append(dict(_flat_logs(logs or {})))


def _flat_logs(logs, prefix=""):
    for key, value in logs.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flat_logs(value, f"{name}/")
            continue
        try:
            array = np.asarray(value)
        except (TypeError, ValueError):
            continue
        if array.size == 1 and np.issubdtype(array.dtype, np.number):
            yield name, float(array.reshape(()))


def train(model, batches):
    """Trains `model` on `batches` through its own `fit`; returns the logs after each step (list of dicts)."""
    recorder = _StepLogs()
    per_execution = int(getattr(model, "steps_per_execution", 1) or 1)
    if per_execution == 1:  # One epoch per step: each step's metrics are its own.
        epochs, steps_per_epoch = len(batches), 1
    else:
        epochs, steps_per_epoch = 1, len(batches)
    model.fit(
        verify_batches.dataset(batches),
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        shuffle=False,
        verbose=0,
        callbacks=[recorder],
    )
    return recorder.steps


def train_on_one_device(model, batches, device):
    """The reference: `model` moved onto one device, trained on `batches` (restore the `State` afterwards)."""
    if device not in _ONE_DEVICE:
        _ONE_DEVICE[device] = tf.distribute.OneDeviceStrategy(device)
    ki.set_distribute_strategy(model, _ONE_DEVICE[device])
    model.train_function = model.test_function = model.predict_function = None
    model._distribute_state()
    return train(model, batches)


def reference_device(strategy):
    """This worker's first device of `strategy` (its CPU for a TPU strategy)."""
    if isinstance(strategy, tf.distribute.TPUStrategy):
        return "/cpu:0"
    try:
        devices = strategy.extended.worker_devices
    except (AttributeError, RuntimeError, NotImplementedError):
        devices = ()
    if devices:
        return devices[0]
    return "/gpu:0" if tf.config.list_logical_devices("GPU") else "/cpu:0"


@contextlib.contextmanager
def quiet():
    """keras-dist prints no plan for `verify`'s own `fit` calls."""
    previous = os.environ.get(_env.QUIET_ENV)
    os.environ[_env.QUIET_ENV] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_env.QUIET_ENV, None)
        else:
            os.environ[_env.QUIET_ENV] = previous
