"""Layer 1: `keras_dist.verify`: does this model, on this data, train under its strategy as on one device?

Owns: taking a few global batches from the user's data, once; training the
user's own `DistributedModel` on them on one device (the reference) and under
its own strategy, from the same starting state; comparing every model and
optimizer variable (by path) and fit's logs at every step; naming the most
likely cause of a difference; and putting the model back exactly as it was.
Modules: `batches` (the global batches), `runs` (the state kept and the two
runs), `compare`, `diagnosis` (the likely cause), `report` (`VerifyReport`).

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

import time
from typing import Any

import keras

from keras_dist._model import DistributedModel, workers
from keras_dist._runtime import batch_coupling, snapshots
from keras_dist._verify import batches as verify_batches
from keras_dist._verify import compare, diagnosis, runs
from keras_dist._verify.report import VerifyReport
from keras_dist.strategy import _plan

__all__ = ["VerifyReport", "verify"]

RANDOM_LAYERS = ("keep", "off")
DEFAULT_STEPS = 3


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
            (default 32, as `fit`) or for a dataset of single examples;
            ignored for a dataset of batches, as `fit` ignores it.
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
    batches = verify_batches.global_batches(model, x, y, sample_weight, batch_size, steps)
    agreement = workers.agreement(model)
    verify_batches.check_same_batches(agreement, batches)
    device = runs.reference_device(strategy)
    with runs.quiet(), batch_coupling.suppressed():  # A coupled loss is reported below, as a cause.
        comparison = _run_both(model, batches, device, atol, rtol, random_layers)
    passed = comparison.passed
    if agreement.multi_worker:  # Every worker returns the same verdict.
        passed = not agreement.any(not passed)
    cause, explanation, others = (None, None, ())
    global_batch_size = verify_batches.batch_length(batches[0])
    if not passed:
        cause, explanation, others = diagnosis.diagnose(
            model,
            strategy,
            comparison,
            global_batch_size=global_batch_size,
            random_layers=random_layers,
            device=device,
            first_batch=batches[0],
        )
    return VerifyReport(
        passed=passed,
        atol=float(atol),
        rtol=float(rtol),
        weight_differences=comparison.differences(),
        shapes={p: tuple(int(d) for d in a.shape) for p, a in comparison.reference.items()},
        over_tolerance=tuple(comparison.over),
        reference_logs=tuple(dict(step) for step in comparison.reference_logs),
        logs=tuple(dict(step) for step in comparison.logs),
        logs_over_tolerance=tuple(comparison.logs_over),
        likely_cause=cause,
        explanation=explanation,
        other_causes=tuple(others),
        strategy=type(strategy).__name__,
        num_replicas=int(strategy.num_replicas_in_sync),
        num_workers=_plan.cluster_info_of(strategy).num_workers,
        reference_device=device,
        global_batch_sizes=tuple(verify_batches.batch_length(b) for b in batches),
        random_layers=random_layers,
        seconds=time.perf_counter() - started,
    )


def _run_both(model, batches, device, atol, rtol, random_layers):
    """Trains on one device, puts the state back, trains under the strategy, puts it back; compares."""
    strategy = model._distribute_strategy
    before = [snapshots.ObjectSnapshot(o) for o in runs.optimizers(model)]  # One built only here is unbuilt again.
    try:
        runs.build(model, batches[0])
        optimizers = runs.optimizers(model)
        state = runs.State(model, optimizers)
        compared = runs.compared_variables(model, optimizers)
        initial = {path: snapshots.logical_value(v) for path, v in compared}
        switched_off = runs.switch_off_random_layers(model) if random_layers == "off" else []
        try:
            try:
                runs.accumulators_hold_sums(optimizers, strategy)  # A partial accumulation cycle, for one device.
                reference_logs = runs.train_on_one_device(model, batches, device)
                reference = {path: snapshots.logical_value(v) for path, v in compared}
                runs.check_no_new_variables(model, state)
            finally:
                state.restore()
            if switched_off:
                model.train_function = None  # Traced with the rates it had; put back with the state.
            logs = runs.train(model, batches)
            runs.accumulators_hold_sums(optimizers, strategy)
            got = {path: snapshots.logical_value(v) for path, v in compared}
        finally:
            state.restore()
            for layer, attribute, value in switched_off:
                setattr(layer, attribute, value)
    finally:
        for snapshot in before:
            snapshot.restore()
    return compare.compare(compared, initial, reference, got, reference_logs, logs, atol, rtol)


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
