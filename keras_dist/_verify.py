"""Layer 1: `keras_dist.verify`: does this model, on this data, train under its strategy as on one device?

Owns: taking a few global batches from the user's data, once; training the
user's own `DistributedModel` on them on one device (the reference) and under
its own strategy, from the same starting state; comparing every model and
optimizer variable (by path) and fit's logs at every step; naming the most
likely cause of a difference; and putting the model back exactly as it was.

How: the model is built as `fit` builds it, then its state is kept
(`_runtime.snapshots`: every variable's backing `tf.Variable` and per-device
values, the model's and optimizers' attributes, Keras' global seed). For the
reference the model moves onto a `tf.distribute.OneDeviceStrategy` on this
worker's first device (`_runtime.variables.rehome`, as `keras_dist.distribute`
moves a model) and trains through its own `fit` and train step; then the state
is put back, the model trains under its own strategy (its own step functions),
and the state is put back again.

What happens on each worker: `verify` is a collective. Every worker takes the
same global batches (checked: one all-reduce), computes the reference alone
on its own device from the full global batches (no communication), trains
under the strategy with the others, and compares; the verdict is agreed
(one all-reduce), so every worker returns `passed` alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import math
import os
import re
import time
import types
from collections.abc import Mapping
from typing import Any, ClassVar

import keras
import numpy as np
import tensorflow as tf

from keras_dist import _env
from keras_dist._model import DistributedModel, workers
from keras_dist._runtime import accumulation, devices, optimizer_patches, snapshots, variables
from keras_dist._runtime import keras_internals as ki
from keras_dist.data import _creator
from keras_dist.data import _inputs as data_inputs
from keras_dist.strategy import _plan

__all__ = ["VerifyReport", "verify"]

# What `VerifyReport.likely_cause` can be, with what each means.
CAUSES = {
    "unsynchronized_batch_normalization": "BatchNormalization normalizes each replica's share with that share's statistics",
    "random_layers": "Dropout and other random layers draw other numbers on each replica than on one device",
    "global_batch_loss": "a loss written for global-batch scaling, counted again as a per-replica mean",
    "gradient_scale": "the gradients are scaled by the number of replicas",
    "batch_level_metric": "a logged value computed per replica's share of the batch, not from the global batch",
    "zero_gradient_noise": "a variable whose gradient is about zero: Adam-like optimizers scale rounding noise up to full steps",
    "onednn": "oneDNN's CPU kernels round differently at different batch sizes",
    "unknown": "none of the known causes fits",
}

RANDOM_LAYERS = ("keep", "off")
DEFAULT_STEPS = 3
_KERAS_DEFAULT_BATCH_SIZE = 32
# Layer classes whose randomness `random_layers="off"` switches off, with the attribute set to 0.
_SWITCHABLE = (
    (keras.layers.Dropout, "rate"),  # SpatialDropout1D/2D/3D too
    (keras.layers.GaussianDropout, "rate"),
    (keras.layers.AlphaDropout, "rate"),
    (keras.layers.GaussianNoise, "stddev"),
)
# In a step of one's own: a loss scaled for the global batch (TensorFlow's guide), or random draws.
_GLOBAL_SCALING = re.compile(r"compute_average_loss|global_batch|GLOBAL_BATCH|num_replicas_in_sync")
_RANDOM_DRAWS = re.compile(r"\b(?:keras\.random|tf\.random|random)\.\w+\(")
_ONE_DEVICE: dict[str, tf.distribute.OneDeviceStrategy] = {}


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What `keras_dist.verify` trained and compared, its verdict and the likely cause of a difference.

    Passed means: every element of every compared variable, and every value
    `fit` logged at every step, satisfies
    `|under the strategy - on one device| <= atol + rtol * |on one device|`.

    Attributes:
        passed: Boolean verdict (the same on every worker).
        atol: Float, the absolute tolerance used.
        rtol: Float, the relative tolerance used.
        weight_differences: Read-only mapping, variable path -> Python float
            `max |difference|` over its elements after the last step: the
            model's weights (trainable and not), then the optimizers'
            variables (iterations, learning rate, slots), in that order.
        shapes: Read-only mapping, variable path -> shape tuple.
        over_tolerance: Tuple of the paths of variables over tolerance, worst first.
        reference_logs: Tuple with one read-only mapping per step, log name ->
            Python float, as `fit` logged it on one device (each step is its
            own epoch, so metrics are that step's own).
        logs: The same under the strategy.
        logs_over_tolerance: Tuple of `"step N: name"` for logged values over
            tolerance (or present in one run only).
        likely_cause: `None` when passed, else one of the keys of
            `VerifyReport.CAUSES` (e.g. `"unsynchronized_batch_normalization"`).
        explanation: `None` when passed, else what was seen, why it differs
            and how to fix it.
        other_causes: Tuple of further keys of `CAUSES` that may contribute.
        CAUSES: Class attribute, read-only mapping of every cause's key to
            what it means.
        strategy: String, the model's strategy (its class name).
        num_replicas: Integer, `num_replicas_in_sync`.
        num_workers: Integer, workers of the strategy.
        reference_device: String, the device the reference trained on.
        global_batch_sizes: Tuple of integers, examples in each global batch.
        random_layers: `"keep"` or `"off"`, as passed to `verify`.
        seconds: Float, wall time `verify` took on this worker.
    """

    CAUSES: ClassVar[Mapping[str, str]] = types.MappingProxyType(CAUSES)

    passed: bool
    atol: float
    rtol: float
    weight_differences: Mapping[str, float]
    shapes: Mapping[str, tuple[int, ...]]
    over_tolerance: tuple[str, ...]
    reference_logs: tuple[Mapping[str, float], ...]
    logs: tuple[Mapping[str, float], ...]
    logs_over_tolerance: tuple[str, ...]
    likely_cause: str | None
    explanation: str | None
    other_causes: tuple[str, ...]
    strategy: str
    num_replicas: int
    num_workers: int
    reference_device: str
    global_batch_sizes: tuple[int, ...]
    random_layers: str
    seconds: float

    @property
    def max_weight_difference(self) -> float:
        """Python float, the largest `max |difference|` over all compared variables (0.0 if none)."""
        return max(self.weight_differences.values(), default=0.0)

    def __str__(self) -> str:
        return _format(self)


def verify(
    model: keras.Model,
    x: Any = None,
    y: Any = None,
    *,
    batch_size: int | None = None,
    sample_weight: Any = None,
    steps: int = DEFAULT_STEPS,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    random_layers: str = "keep",
) -> VerifyReport:
    """Trains `model` a few steps on one device and under its strategy, and compares.

    Both runs start from the model's current weights, optimizer state and
    seeds, train on the same global batches (the first `steps` of `x`, in
    order, unshuffled) through the model's own `fit` and train step (a
    `train_step` of one's own included), and are compared variable by
    variable and log by log. Afterwards the model, its optimizer(s) and
    metrics are exactly as before: the same values, the same step functions,
    the same strategy; `verify` is not training. A model or optimizer not
    built yet is built first as `fit` builds it; an optimizer built only for
    `verify` is unbuilt again.

    Args:
        model: A compiled `keras_dist.DistributedModel` (or one from
            `keras_dist.distribute`), trained or not.
        x: What `fit` accepts: NumPy arrays (or a dict/list of them), a
            `tf.data.Dataset` (of batches, or of examples with `batch_size`),
            a `keras.utils.PyDataset`, or an iterator/generator of batches
            (consumed: `steps` batches are taken from it).
        y: Targets for array inputs, or `None`.
        batch_size: Integer, the global batch size for array inputs
            (default 32, as `fit`) or for a dataset of single examples.
        sample_weight: Sample weights for array inputs, or `None`.
        steps: Integer >= 1, global batches to train on. Defaults to 3.
        atol: Float >= 0, absolute tolerance. Defaults to `1e-5`.
        rtol: Float >= 0, relative tolerance (as `np.allclose`: passes where
            `|got - expected| <= atol + rtol * |expected|`). Defaults to `1e-5`.
            float32 training on one device and N replicas agrees to about
            1e-6 after a few steps (with oneDNN off on CPUs).
        random_layers: `"keep"` (default) trains the model as it is; `"off"`
            sets the rate of `Dropout` (and `SpatialDropout*`,
            `GaussianDropout`, `AlphaDropout`) and the `stddev` of
            `GaussianNoise` layers to 0 during both runs, to check everything
            else (replicas draw other random numbers than one device).

    Returns:
        `VerifyReport` (its `str()` is a readable table).

    Raises:
        TypeError: `model` is not a `DistributedModel`, or `x` is a
            `keras_dist.data.DatasetCreator` (pass the data itself).
        ValueError: `model` is not compiled, an argument is out of range,
            the data has no batch, a layer is not built (build it first), or
            (several workers) the workers took different batches from `x`.

    Distributed behavior:
        Collective under several workers: every worker must call it with the
        same data (the full global batches, as for `fit`). The reference is
        computed on each worker on its own device, from the global batches;
        the training under the strategy all-reduces as `fit` does.

    Example:
    >>> import contextlib, io
    >>> import keras, numpy as np, keras_dist
    >>> inputs = keras.Input((3,))
    >>> model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs))
    >>> model.compile(optimizer="adam", loss="mse")
    >>> x = np.random.RandomState(0).rand(24, 3).astype("float32")
    >>> with contextlib.redirect_stdout(io.StringIO()):
    ...     report = keras_dist.verify(model, x, x.sum(1), batch_size=8)
    >>> report.passed, report.likely_cause
    (True, None)
    """
    started = time.perf_counter()
    _check_arguments(model, steps, atol, rtol, random_layers)
    strategy = model._distribute_strategy
    batches = _global_batches(model, x, y, sample_weight, batch_size, steps)
    agreement = workers.agreement(model)
    _check_same_batches(agreement, batches)
    device = _reference_device(strategy)
    before = [snapshots.ObjectSnapshot(o) for o in _optimizers(model)]  # An optimizer not built yet is unbuilt again.
    with _quiet():
        try:
            _build(model, batches[0])
            optimizers = _optimizers(model)
            state = _State(model, optimizers)
            compared = _compared_variables(model, optimizers)
            initial = {path: snapshots.logical_value(v) for path, v in compared}
            switched_off = _switch_off_random_layers(model) if random_layers == "off" else []
            try:
                try:
                    _accumulators_hold_sums(optimizers, strategy)  # The partial cycle, for the one device.
                    reference_logs = _train_on_one_device(model, batches, device)
                    reference = {path: snapshots.logical_value(v) for path, v in compared}
                    _check_no_new_variables(model, state)
                finally:
                    state.restore()
                if switched_off:
                    model.train_function = None  # Traced with the rates it had; restored below.
                logs = _train(model, batches)
                _accumulators_hold_sums(optimizers, strategy)
                got = {path: snapshots.logical_value(v) for path, v in compared}
            finally:
                state.restore()
                for layer, attribute, value in switched_off:
                    setattr(layer, attribute, value)
        finally:
            for snapshot in before:
                snapshot.restore()
    differences = {path: _max_difference(got[path], reference[path]) for path, _ in compared}
    over = [path for path, _ in compared if not _within(got[path], reference[path], atol, rtol)]
    over.sort(key=lambda p: -_excess(got[p], reference[p], atol, rtol))
    logs_over = _logs_over_tolerance(reference_logs, logs, atol, rtol)
    passed = not over and not logs_over
    if agreement.multi_worker:  # Every worker returns the same verdict.
        passed = not agreement.any(not passed)
    cause, explanation, others = (None, None, ())
    if not passed:
        cause, explanation, others = _diagnose(
            model,
            strategy,
            compared=compared,
            initial=initial,
            reference=reference,
            got=got,
            over=over,
            reference_logs=reference_logs,
            logs=logs,
            logs_over=logs_over,
            batches=batches,
            atol=atol,
            rtol=rtol,
            random_layers=random_layers,
            device=device,
        )
    return VerifyReport(
        passed=passed,
        atol=float(atol),
        rtol=float(rtol),
        weight_differences=types.MappingProxyType(differences),
        shapes=types.MappingProxyType({path: tuple(int(d) for d in reference[path].shape) for path, _ in compared}),
        over_tolerance=tuple(over),
        reference_logs=tuple(types.MappingProxyType(step) for step in reference_logs),
        logs=tuple(types.MappingProxyType(step) for step in logs),
        logs_over_tolerance=tuple(logs_over),
        likely_cause=cause,
        explanation=explanation,
        other_causes=tuple(others),
        strategy=type(strategy).__name__,
        num_replicas=int(strategy.num_replicas_in_sync),
        num_workers=_plan.cluster_info_of(strategy).num_workers,
        reference_device=device,
        global_batch_sizes=tuple(_batch_length(b) for b in batches),
        random_layers=random_layers,
        seconds=time.perf_counter() - started,
    )


# ------------------------------------------------------------------ arguments and data


def _check_arguments(model, steps, atol, rtol, random_layers):
    if not isinstance(model, DistributedModel):
        raise TypeError(
            "`verify` takes a `keras_dist.DistributedModel`. Received: a "
            f"{type(model).__name__}. Fix: `keras_dist.distribute(model)`, or build it as "
            "`keras_dist.DistributedModel(inputs, outputs)`."
        )
    if getattr(model, "optimizer", None) is None:
        raise ValueError(
            "`verify` trains the model, so it must be compiled. Received: a model without optimizer. "
            "Fix: call `model.compile(optimizer=..., loss=...)` first."
        )
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"`steps` must be an integer >= 1. Received: steps={steps!r}. Fix: e.g. steps=3.")
    for name, value in (("atol", atol), ("rtol", rtol)):
        if not (isinstance(value, (int, float)) and value >= 0):
            raise ValueError(f"`{name}` must be a number >= 0. Received: {name}={value!r}. Fix: e.g. {name}=1e-5.")
    if random_layers not in RANDOM_LAYERS:
        raise ValueError(
            f"`random_layers` must be one of {RANDOM_LAYERS}. Received: random_layers={random_layers!r}. "
            "Fix: 'keep' to train the model as it is, 'off' to switch Dropout-like layers off during the check."
        )


def _global_batches(model, x, y, sample_weight, batch_size, steps):
    """The first `steps` global batches of the input, each a tuple `(x,)`, `(x, y)` or `(x, y, sample_weight)`."""
    if x is None:
        raise ValueError("`verify` needs data to train on. Received: x=None. Fix: pass x (and y) as for `fit`.")
    if isinstance(x, _creator.DatasetCreator):
        raise TypeError(
            "`verify` needs the global batches themselves, the same on every worker; a `DatasetCreator` "
            "builds a different input per worker. Received: a DatasetCreator. Fix: pass the dataset (or "
            "arrays) that holds the global batches."
        )
    dataset_like = isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)) or hasattr(x, "__next__")
    if dataset_like and (y is not None or sample_weight is not None):
        raise ValueError(
            "`y` and `sample_weight` go with array inputs; a dataset, PyDataset or generator yields them "
            f"in its batches. Received: x of type {type(x).__name__} and y or sample_weight. Fix: drop them."
        )
    if isinstance(x, tf.data.Dataset):
        dataset = data_inputs.prepare(x, strategy=model._distribute_strategy, model=model, batch_size=batch_size)
        batches = [_as_tuples(b) for b in dataset.take(steps)]
    elif isinstance(x, keras.utils.PyDataset):
        count = x.num_batches
        batches = [_as_tuples(x[i]) for i in range(steps if count is None else min(steps, count))]
    elif hasattr(x, "__next__"):
        batches = []
        for batch in x:
            batches.append(_as_tuples(batch))
            if len(batches) == steps:
                break
    else:
        batches = _array_batches(x, y, sample_weight, batch_size or _KERAS_DEFAULT_BATCH_SIZE, steps)
    batches = [b if isinstance(b, tuple) else (b,) for b in batches]
    if not batches or not _batch_length(batches[0]):
        raise ValueError(
            f"`verify` found no batch to train on in x (a {type(x).__name__}). Fix: pass data with at least one example."
        )
    return batches


def _array_batches(x, y, sample_weight, batch_size, steps):
    if sample_weight is not None and y is None:
        raise ValueError("`sample_weight` needs `y`. Received: y=None with sample_weight. Fix: pass y too.")
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"`batch_size` must be an integer >= 1. Received: batch_size={batch_size!r}.")
    parts = tuple(_as_tuples(p) for p in (x, y, sample_weight) if p is not None)
    leaves = keras.tree.flatten(parts)
    num_examples = len(leaves[0]) if leaves else 0
    batches = []
    for start in range(0, min(num_examples, steps * batch_size), batch_size):
        batches.append(keras.tree.map_structure(lambda a, s=start: np.asarray(a)[s : s + batch_size], parts))
    return batches


def _as_tuples(value):
    """Lists become tuples (tf.data would stack a list of arrays into one tensor), recursively."""
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return tuple(_as_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _as_tuples(v) for k, v in value.items()}
    return value


def _batch_length(batch):
    leaves = tf.nest.flatten(batch, expand_composites=False)
    shape = getattr(leaves[0], "shape", None) if leaves else None
    return int(shape[0]) if shape is not None and len(shape) and shape[0] is not None else 0


def _dataset(batches):
    """A dataset yielding `batches` in order (each one element: a global batch)."""
    dataset = None
    for batch in batches:
        part = tf.data.Dataset.from_tensors(batch)
        dataset = part if dataset is None else dataset.concatenate(part)
    return dataset


def _fingerprint(batches):
    """Four integers below 2**18 from a SHA-256 of every batch (values, shapes, dtypes): exact sums in float32."""
    digest = hashlib.sha256()
    for batch in batches:
        for leaf in tf.nest.flatten(batch, expand_composites=True):
            array = np.asarray(leaf)
            digest.update(f"{array.dtype}{array.shape}".encode())
            digest.update(np.ascontiguousarray(array).tobytes())
    raw = digest.digest()
    return [float(int.from_bytes(raw[i : i + 3], "big") >> 6) for i in range(0, 12, 3)]


def _check_same_batches(agreement, batches):
    """Several workers: raises `ValueError` on every worker unless every worker took the same batches."""
    if not agreement.multi_worker:
        return
    own = _fingerprint(batches)
    num_workers = _plan.cluster_info_of(agreement.strategy).num_workers
    summed = agreement.summed(own)
    differs = agreement.any(any(s != num_workers * v for s, v in zip(summed, own)))
    if differs:
        raise ValueError(
            "`verify` needs the same global batches on every worker (each computes the one-device "
            "reference from them). Received: different batches on some workers. Fix: pass every worker the "
            "same full data, unsharded, in the same order (a dataset shuffled with the same seed, or arrays)."
        )


def _reference_device(strategy):
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


def _one_device_strategy(device):
    if device not in _ONE_DEVICE:
        _ONE_DEVICE[device] = tf.distribute.OneDeviceStrategy(device)
    return _ONE_DEVICE[device]


@contextlib.contextmanager
def _quiet():
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


# ------------------------------------------------------------------ state


def _optimizers(model):
    """The compiled optimizer, those in the model's attributes, and every optimizer they wrap, each once."""
    found = variables.optimizers_in([getattr(model, "optimizer", None), *vars(model).values()])
    chain, seen = [], set()
    for optimizer in found:
        for opt in variables.nested_optimizers(optimizer):
            if id(opt) not in seen:
                seen.add(id(opt))
                chain.append(opt)
    return chain


class _State:
    """Everything `fit` changes on the model: variables (backing and values), model and optimizer attributes, seeds."""

    def __init__(self, model, optimizers):
        owned = {}
        for v in [*model.variables, *model.weights, *_metrics_variables(model)]:
            owned.setdefault(id(v), v)
        for optimizer in optimizers:
            for v in optimizer.variables:
                owned.setdefault(id(v), v)
        patch_states = [s for s in (optimizer_patches.state(o) for o in optimizers) if s is not None]
        sums = [v for s in patch_states if s.sums is not None for v in s.sums.sums]
        self.variables = snapshots.VariableSnapshot(owned.values(), sums)
        self.objects = [snapshots.ObjectSnapshot(obj) for obj in (model, *optimizers, *patch_states)]
        self.seeds = snapshots.GlobalSeedSnapshot()

    def restore(self):
        for obj in self.objects:
            obj.restore()
        self.variables.restore()
        self.seeds.restore()


def _metrics_variables(model):
    try:
        return list(model.metrics_variables)
    except AttributeError:  # A `metrics` property reading attributes set after __init__.
        return []


def _build(model, batch):
    """Builds the model, its metrics and compiled optimizer as `fit` does first (from one batch's spec)."""
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


def _compared_variables(model, optimizers):
    """`[(path, variable)]`: the model's weights, then every optimizer's variables (each once, numeric)."""
    compared, seen, paths = [], set(), set()
    candidates = [*model.weights, *(v for o in optimizers for v in o.variables)]
    for v in candidates:
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


def _switch_off_random_layers(model):
    """Sets the rate (stddev) of Dropout-like layers to 0; returns `[(layer, attribute, old value)]`."""
    changed = []
    for layer in model._flatten_layers(include_self=False):
        for cls, attribute in _SWITCHABLE:
            if isinstance(layer, cls) and getattr(layer, attribute, 0):
                changed.append((layer, attribute, getattr(layer, attribute)))
                setattr(layer, attribute, 0.0)
                break
    return changed


def _accumulators_hold_sums(optimizers, strategy):
    """Gradient accumulation: Keras' accumulators get keras-dist's per-replica running sums, summed.

    Under several replicas keras-dist keeps a partial cycle in its own sums, and Keras' accumulators
    stay zero: one device reads the partial cycle from Keras' (and so does the comparison).
    Collective under several workers (reading a sum sums it over them).
    """
    for optimizer in optimizers:
        state = optimizer_patches.state(optimizer)
        if state is not None and state.sums is not None:
            accumulation.copy_sums_to_keras_accumulators(optimizer, state.sums_variables, state.sums, strategy)


def _check_no_new_variables(model, state):
    new = [
        getattr(v, "path", v.name)
        for v in [*model.variables, *_metrics_variables(model)]
        if id(v) not in state.variables.keras_variable_ids
    ]
    if new:
        raise RuntimeError(
            f"The model created variables during `verify`'s first step ({new}); `verify` cannot put those "
            "back (they keep what the one-device steps made of them). Fix: build every layer before calling "
            "`verify` (call the model on one batch), then rebuild or reload this model."
        )


# ------------------------------------------------------------------ the two runs


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


def _train(model, batches):
    """Trains `model` on `batches` through its own `fit`; returns the logs after each step."""
    recorder = _StepLogs()
    per_execution = int(getattr(model, "steps_per_execution", 1) or 1)
    if per_execution == 1:  # One epoch per step: each step's metrics are its own.
        epochs, steps_per_epoch = len(batches), 1
    else:
        epochs, steps_per_epoch = 1, len(batches)
    model.fit(
        _dataset(batches),
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        shuffle=False,
        verbose=0,
        callbacks=[recorder],
    )
    return recorder.steps


def _train_on_one_device(model, batches, device):
    """The reference: `model` moved onto one device, trained on `batches` (restore the state afterwards)."""
    ki.set_distribute_strategy(model, _one_device_strategy(device))
    model.train_function = model.test_function = model.predict_function = None
    model._distribute_state()
    return _train(model, batches)


# ------------------------------------------------------------------ comparison


def _max_difference(got, expected):
    if got.size == 0:
        return 0.0
    diff = np.abs(got.astype("float64") - expected.astype("float64"))
    both_nan = np.isnan(got.astype("float64")) & np.isnan(expected.astype("float64"))
    diff = np.where(both_nan, 0.0, diff)
    return float(np.max(np.where(np.isnan(diff), np.inf, diff)))


def _excess(got, expected, atol, rtol):
    """Largest `|got - expected| - (atol + rtol * |expected|)` (inf for a NaN on one side; -inf when empty)."""
    if got.shape != expected.shape:
        return math.inf
    if got.size == 0:
        return -math.inf
    a, b = got.astype("float64"), expected.astype("float64")
    excess = np.abs(a - b) - (atol + rtol * np.abs(b))
    excess = np.where(np.isnan(a) & np.isnan(b), -np.inf, excess)
    return float(np.max(np.where(np.isnan(excess), np.inf, excess)))


def _within(got, expected, atol, rtol):
    return _excess(got, expected, atol, rtol) <= 0


def _logs_over_tolerance(reference_logs, logs, atol, rtol):
    over = []
    if len(reference_logs) != len(logs):
        over.append(f"steps logged: {len(reference_logs)} on one device, {len(logs)} under the strategy")
    for step, (expected, got) in enumerate(zip(reference_logs, logs), 1):
        for name in sorted(set(expected) | set(got)):
            if name not in expected or name not in got:
                over.append(f"step {step}: {name} (logged in one run only)")
            elif not _within(np.array(got[name]), np.array(expected[name]), atol, rtol):
                over.append(f"step {step}: {name}")
    return over


# ------------------------------------------------------------------ diagnosis


def _diagnose(
    model,
    strategy,
    *,
    compared,
    initial,
    reference,
    got,
    over,
    reference_logs,
    logs,
    logs_over,
    batches,
    atol,
    rtol,
    random_layers,
    device,
):
    """Returns `(likely cause, explanation, other causes)`: evidence from the numbers first, then the model's make-up."""
    num_replicas = strategy.num_replicas_in_sync
    batch = _batch_length(batches[0])
    share = (
        f"{batch // num_replicas}-{-(-batch // num_replicas)}" if batch % num_replicas else f"{batch // num_replicas}"
    )
    found = {}  # cause -> explanation, in order of evidence
    first_ref, first_got = (reference_logs[0] if reference_logs else {}), (logs[0] if logs else {})
    first_logs_agree = all(
        name in first_got and _within(np.array(first_got[name]), np.array(first_ref[name]), atol, rtol)
        for name in first_ref
    )
    loss_ratio = None
    if "loss" in first_ref and "loss" in first_got and first_ref["loss"]:
        loss_ratio = first_got["loss"] / first_ref["loss"]
    trainable = {id(v) for v in model.trainable_weights}
    moved_ref = math.sqrt(
        sum(float(np.sum((reference[p] - initial[p]) ** 2.0)) for p, v in compared if id(v) in trainable)
    )
    moved_got = math.sqrt(sum(float(np.sum((got[p] - initial[p]) ** 2.0)) for p, v in compared if id(v) in trainable))
    update_ratio = moved_got / moved_ref if moved_ref else None

    def near(ratio, target):
        return ratio is not None and abs(ratio / target - 1.0) < 0.05

    custom_source = _own_step_source(model)
    global_scaling = bool(_GLOBAL_SCALING.search(custom_source)) or _scaled_compiled_loss(model)
    if num_replicas > 1 and (near(loss_ratio, 1.0 / num_replicas) or near(loss_ratio, float(num_replicas))):
        seen = (
            f"Step 1's loss is {first_got['loss']:.6g} under the strategy and {first_ref['loss']:.6g} on one "
            f"device: {loss_ratio:.4g} times, off by the {num_replicas} replicas."
        )
        if model.custom_step_losses == "global" and not over:
            found["global_batch_loss"] = (
                f"{seen} The weights match (`custom_step_losses = 'global'` sums the gradients as they are), but "
                "the step logs its loss scaled for the global batch: on each replica that is the replica's part "
                f"of the loss, and the tracker averages the parts. Fix: log the mean over the step's own examples "
                "(e.g. `self.loss_tracker.update_state(ops.mean(per_example_loss))`)."
            )
        else:
            found["global_batch_loss"] = (
                f"{seen} The loss is written for global-batch scaling (`tf.nn.compute_average_loss(..., "
                "global_batch_size=...)`, or a division by the global batch size), while keras-dist counts each "
                "replica's loss as the mean over that replica's own examples (`model.custom_step_losses == "
                "'mean'`): loss and gradients are scaled twice. Fix: write the loss as the mean over the examples "
                "the step sees (`ops.mean`, `self.compute_loss`), as keras.io does; or keep it, set "
                "`model.custom_step_losses = 'global'` (keras-dist then sums the gradients as they are) and log "
                "the mean over the step's own examples (a `Mean` tracker of the scaled loss averages the "
                "replicas' parts)."
            )
    elif (
        num_replicas > 1
        and first_logs_agree
        and (near(update_ratio, float(num_replicas)) or near(update_ratio, 1.0 / num_replicas))
    ):
        found["gradient_scale"] = (
            f"Step 1's logs agree (the forward pass is the same), but the weights moved {update_ratio:.4g} times "
            f"as far as on one device, about the {num_replicas} replicas: the gradients are scaled by the number "
            "of replicas. Typical: a `train_step` that multiplies or divides its loss or gradients by "
            "`num_replicas_in_sync`, or sums the gradients over the replicas itself before `apply_gradients` "
            "(keras-dist's optimizer already sums them). Fix: drop that scaling."
        )
    if not over and logs_over:
        names = sorted({entry.split(": ", 1)[1] for entry in logs_over if ": " in entry})
        found["batch_level_metric"] = (
            f"The weights match, but the logged {names} differ: these values are computed from each replica's "
            f"share of the batch ({share} examples) and then combined, not from the global batch of {batch}: a "
            "value a `train_step` returns directly, or a metric whose `update_state` overwrites its state instead "
            "of accumulating it (its state is summed over the replicas). Fix: log it with a `keras.metrics.Metric` "
            "that accumulates (e.g. `keras.metrics.Mean`, or a metric function in `compile(metrics=...)`) and "
            "return its `result()`."
        )
    trainable_over = [p for p, v in compared if p in over and id(v) in trainable]
    if not logs_over and trainable_over and _adaptive_optimizers(model):
        found["zero_gradient_noise"] = (
            f"Every logged value agrees at every step, yet the trainable variables {trainable_over} differ: they "
            "barely change the loss, so their gradient is about zero (e.g. the bias of a layer followed by "
            "BatchNormalization, which subtracts it again) and consists of float rounding, which differs between "
            "one device and the replicas' shares. Adam-like optimizers divide by the gradient's own size, so that "
            f"noise moves them by full learning-rate steps in random directions ({_adaptive_optimizers(model)}). "
            "State computed from them (a moving mean) follows. Harmless for the model's outputs. Fix: `use_bias=False` on a layer followed by BatchNormalization, "
            "or leave it."
        )
    if num_replicas > 1:
        norms = _unsynchronized_batch_norms(model)
        if norms:
            found["unsynchronized_batch_normalization"] = (
                f"BatchNormalization layers {norms} normalize each replica's share ({share} examples) of the "
                f"global batch of {batch} with that share's own mean and variance; one device uses the whole "
                f"batch's{_first_step_evidence(first_logs_agree, first_ref, first_got)}. Fix: "
                "`BatchNormalization(synchronized=True)` computes the statistics over all replicas (one "
                "all-reduce per layer and step); or keep it: per-replica statistics are the usual choice in "
                "data-parallel training, not a bug."
            )
        randoms = _random_layers(model)
        draws = bool(_RANDOM_DRAWS.search(custom_source))
        if randoms or draws:
            what = f"the layers {randoms}" if randoms else ""
            what += (" and " if randoms and draws else "") + ("the step's own random draws" if draws else "")
            switch = (
                " Those left on cannot be switched off by `verify`."
                if random_layers == "off"
                else " To check everything else, run `verify(..., random_layers='off')`, which switches "
                "Dropout-like layers off during the check."
            )
            found["random_layers"] = (
                f"Random numbers: {what} draw their own numbers on each replica (keras-dist gives every replica "
                "its own seed), so the examples get other masks or noise than on one device: the same "
                f"distribution, other numbers{_first_step_evidence(first_logs_agree, first_ref, first_got)}. "
                "Nothing to fix in training." + switch
            )
        if global_scaling and "global_batch_loss" not in found and model.custom_step_losses == "mean":
            found["global_batch_loss"] = (
                "The step's loss looks written for global-batch scaling (its code mentions "
                "`compute_average_loss`, a global batch size or `num_replicas_in_sync`), while keras-dist counts "
                "each replica's loss as the mean over its own examples (`model.custom_step_losses == 'mean'`). "
                "Fix: set `model.custom_step_losses = 'global'`, or compute the mean over the step's own examples."
            )
    onednn = _onednn_evidence(device, first_ref, first_got, over, reference, got)
    if onednn:
        found["onednn"] = onednn
    if not found:
        worst = over[0] if over else (logs_over[0] if logs_over else "")
        found["unknown"] = (
            f"None of the known causes fits (worst: {worst}). Look for state a layer or step updates outside "
            "Keras variables, a custom layer that reduces over the batch (each replica sees only its share), "
            "or Python-side randomness; compare `model.predict` on one batch under both to see whether the "
            "forward pass already differs."
        )
    causes = list(found)
    return causes[0], found[causes[0]], tuple(causes[1:])


def _first_step_evidence(first_logs_agree, first_ref, first_got):
    if first_logs_agree or "loss" not in first_ref or "loss" not in first_got:
        return ""
    return f" (step 1's loss: {first_got['loss']:.6g} under the strategy, {first_ref['loss']:.6g} on one device)"


def _unsynchronized_batch_norms(model):
    return [
        layer.name
        for layer in model._flatten_layers(include_self=False)
        if isinstance(layer, keras.layers.BatchNormalization)
        and not getattr(layer, "synchronized", False)
        and layer.trainable
    ]


def _adaptive_optimizers(model):
    """Names of the model's optimizers that scale steps by the gradient's size (every one but plain SGD)."""
    return [type(o).__name__ for o in _optimizers(model) if not isinstance(o, keras.optimizers.SGD) and o.variables]


def _random_layers(model):
    """Layers that draw random numbers in training: Dropout-like ones with a rate > 0, and any with a SeedGenerator."""
    found = []
    for layer in model._flatten_layers(include_self=False):
        switchable = next((attribute for cls, attribute in _SWITCHABLE if isinstance(layer, cls)), None)
        if switchable is not None:
            if getattr(layer, switchable, 0):
                found.append(layer.name)
        elif any(isinstance(v, keras.random.SeedGenerator) for v in vars(layer).values()):
            found.append(layer.name)
    return found


def _own_step_source(model):
    """The source of the `train_step`/`compute_loss`/`compute_loss_and_updates` the model's classes define (or '')."""
    parts = []
    for cls in type(model).__mro__:
        if cls is DistributedModel or cls is keras.Model:
            break
        for name in ("train_step", "compute_loss"):
            function = cls.__dict__.get(name)
            if function is not None:
                with contextlib.suppress(OSError, TypeError):
                    parts.append(inspect.getsource(function))
    return "\n".join(parts)


def _scaled_compiled_loss(model):
    """Whether a compiled loss function's code divides by a global batch size (a function, not a Keras loss)."""
    losses = getattr(model, "loss", None)
    for loss in keras.tree.flatten(losses) if losses is not None else []:
        if inspect.isfunction(loss):
            with contextlib.suppress(OSError, TypeError):
                if _GLOBAL_SCALING.search(inspect.getsource(loss)):
                    return True
    return False


def _onednn_evidence(device, first_ref, first_got, over, reference, got):
    """An explanation when the differences are small, on a CPU with oneDNN on; else `None`."""
    if not devices.onednn_enabled() or "GPU" in device.upper() or "TPU" in device.upper():
        return None
    first_loss = None
    if "loss" in first_ref and "loss" in first_got:
        first_loss = abs(first_got["loss"] - first_ref["loss"]) / max(abs(first_ref["loss"]), 1e-12)
    relative = max(
        (
            _max_difference(got[path], reference[path]) / max(float(np.max(np.abs(reference[path]))), 1e-12)
            for path in over
            if reference[path].size
        ),
        default=0.0,
    )
    if (first_loss is not None and first_loss > 1e-4) or relative > 1e-2:
        return None
    setting = os.environ.get("TF_ENABLE_ONEDNN_OPTS")
    state = f"TF_ENABLE_ONEDNN_OPTS={setting}" if setting is not None else "TensorFlow's default on this CPU"
    shown = f"largest relative weight difference {relative:.1e}"
    if first_loss is not None:
        shown += f", step 1's loss {first_loss:.1e}"
    return (
        f"The differences are small ({shown}) and oneDNN is on ({state}): its CPU kernels round differently for "
        "the global batch on one device and each replica's share, and the differences grow with the steps. "
        "Fix: to check without it, set TF_ENABLE_ONEDNN_OPTS=0 before TensorFlow is imported; or pass a "
        "larger atol/rtol."
    )


# ------------------------------------------------------------------ the report as text


def _format(report):
    verdict = "PASSED" if report.passed else "DIFFERS"
    replicas = f"{report.num_replicas} replica{'s' if report.num_replicas != 1 else ''}"
    if report.num_workers > 1:
        replicas += f" on {report.num_workers} workers"
    batches = ", ".join(str(b) for b in report.global_batch_sizes)
    lines = [
        f"keras_dist.verify: {verdict}",
        f"  under the strategy: {report.strategy}, {replicas}",
        f"  reference:          one device, {report.reference_device}",
        f"  trained:            {len(report.global_batch_sizes)} steps, global batches of {batches} examples"
        + (", random layers off" if report.random_layers == "off" else ""),
        f"  tolerance:          |strategy - one device| <= atol + rtol * |one device|, atol={report.atol:g}, "
        f"rtol={report.rtol:g}, every element of every variable and every logged value",
        f"  variables:          {len(report.weight_differences)} compared, {len(report.over_tolerance)} over "
        f"tolerance; largest max |diff| {report.max_weight_difference:.3g}",
    ]
    worst = sorted(report.weight_differences.items(), key=lambda item: -item[1])[:8]
    if worst:
        width = max(len("variable"), *(len(path) for path, _ in worst))
        lines += ["", f"  {'variable':<{width}}  {'shape':<14}  max |diff|  within"]
        for path, diff in worst:
            shape = str(report.shapes.get(path, ()))
            mark = "no" if path in report.over_tolerance else "yes"
            lines.append(f"  {path:<{width}}  {shape:<14}  {diff:<10.3g}  {mark}")
        if len(report.weight_differences) > len(worst):
            lines.append(f"  ... {len(report.weight_differences) - len(worst)} more, each smaller")
    names = sorted({name for step in (*report.reference_logs, *report.logs) for name in step})
    if names:
        width = max(len("log"), *(len(n) for n in names))
        lines += ["", f"  step  {'log':<{width}}  {'one device':>13}  {'strategy':>13}  {'|diff|':>9}"]
        for step, (expected, got) in enumerate(zip(report.reference_logs, report.logs), 1):
            for name in names:
                a, b = expected.get(name), got.get(name)
                diff = "" if a is None or b is None else f"{abs(a - b):9.2g}"
                lines.append(f"  {step:<4}  {name:<{width}}  {_number(a):>13}  {_number(b):>13}  {diff:>9}")
    if report.passed:
        lines += ["", "  likely cause: none (the runs agree within tolerance)"]
    else:
        lines += ["", f"  likely cause: {report.likely_cause} ({CAUSES[report.likely_cause or 'unknown']})"]
        lines += [f"  {line}" for line in _wrap(report.explanation or "", 100)]
        if report.other_causes:
            lines.append(f"  also possible: {', '.join(report.other_causes)}")
        if report.logs_over_tolerance:
            shown = report.logs_over_tolerance[:6]
            more = len(report.logs_over_tolerance) - len(shown)
            lines.append(f"  logs over tolerance: {', '.join(shown)}" + (f" (+{more} more)" if more > 0 else ""))
    return "\n".join(lines)


def _number(value):
    return "-" if value is None else f"{value:.8g}"


def _wrap(text, width):
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return lines
