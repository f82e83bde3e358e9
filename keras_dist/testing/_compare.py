"""`assert_matches_single_device`: train on one device and under a strategy, compare the numbers.

Owns: building the two models from one builder and one set of starting weights,
running the same training on both, and the comparison (weights by path, then
everything the training returned: History logs, `evaluate`, predictions), with
an error message naming the worst weight or log and the difference.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import keras
import numpy as np

if TYPE_CHECKING:
    from keras_dist._verify import VerifyReport

__all__ = ["SingleDeviceComparison", "assert_matches_single_device", "max_weight_difference"]


def max_weight_difference(model_a: keras.Model, model_b: keras.Model) -> float:
    """Returns the largest absolute difference between two models' weights.

    Args:
        model_a: `keras.Model`.
        model_b: `keras.Model` with the same weight shapes, in the same order.

    Returns:
        Python float, `max |a - b|` over every element of every weight.

    Raises:
        ValueError: The models have different numbers or shapes of weights.
    """
    weights_a, weights_b = model_a.get_weights(), model_b.get_weights()
    shapes_a = [w.shape for w in weights_a]
    shapes_b = [w.shape for w in weights_b]
    if shapes_a != shapes_b:
        raise ValueError(
            f"Both models must have the same weight shapes, in the same order. Received: {shapes_a} and {shapes_b}."
        )
    return max((float(np.max(np.abs(a - b))) for a, b in zip(weights_a, weights_b) if a.size), default=0.0)


@dataclasses.dataclass(frozen=True)
class SingleDeviceComparison:
    """What `assert_matches_single_device` trained and compared (it passed).

    Attributes:
        reference: The plain `keras.Model`, trained on one device.
        model: The `keras_dist.DistributedModel`, trained under the strategy.
        reference_results: What the training returned for `reference` (a
            `History` becomes its `history` dict), as NumPy arrays.
        results: The same for `model`.
        max_weight_difference: Python float, `max |a - b|` over all weights.
    """

    reference: keras.Model
    model: keras.Model
    reference_results: Any
    results: Any
    max_weight_difference: float


def assert_matches_single_device(
    build_model: Callable[..., keras.Model] | keras.Model,
    x: Any = None,
    y: Any = None,
    *,
    strategy: Any = "auto",
    train: Callable[[keras.Model], Any] | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    logs_atol: float | None = None,
    logs_rtol: float | None = None,
    seed: int | None = None,
    **fit_kwargs: Any,
) -> SingleDeviceComparison | VerifyReport:
    """Asserts that training under `strategy` gives the numbers of plain Keras on one device.

    Builds a plain `keras.Model` (the reference, no strategy) and a
    `keras_dist.DistributedModel` on `strategy`, gives the second the first's
    starting weights, trains the reference and then the distributed model the
    same way, and compares every weight (by position, named by its path) and
    everything the training returned.

    `build_model` may also be a `keras_dist.DistributedModel` that exists
    (compiled, trained or not): then this is `keras_dist.verify(model, x, y,
    atol=atol, rtol=rtol, **fit_kwargs)` (a few steps of the model's own on
    one device and under its own strategy, the model left as it was), and
    its report is the `AssertionError`'s message when the verdict fails.
    There `fit_kwargs` may hold `batch_size`, `sample_weight`, `steps` and
    `random_layers` (see `verify`); `strategy`, `train`, `seed` and the logs
    tolerances do not apply.

    Otherwise `build_model` is called either way:

    - `build_model(Model, **model_kwargs)`: called as `build_model(keras.Model)`
      and `build_model(keras_dist.DistributedModel, strategy=strategy)`; it
      passes `**model_kwargs` to `Model(...)` (or to a subclass of `Model` it
      defines, e.g. one with its own `train_step`). Returns the model, compiled.
    - `build_model()`, without parameters: returns a compiled `keras.Model`; the
      distributed one is `keras_dist.distribute(build_model(), strategy=strategy)`.

    Args:
        build_model: Callable as above, returning a compiled `keras.Model`;
            or a `keras_dist.DistributedModel`.
        x: Inputs for the default training, `model.fit(x, y, **fit_kwargs)`:
            anything `fit` accepts (NumPy arrays, a `tf.data.Dataset`, ...).
        y: Targets for the default training, or `None`.
        strategy: A `tf.distribute.Strategy`, or a name as for
            `DistributedModel` (e.g. `"auto"`). Defaults to `"auto"`.
        train: Callable `model -> results`, run on each model instead of
            `fit`; `results` may be a `History`, a dict, list or tuple of
            numbers and arrays (nested), or `None`. Excludes `x`, `y` and
            `fit_kwargs`.
        atol: Float >= 0, absolute tolerance on every weight element.
            Defaults to `1e-5`.
        rtol: Float >= 0, relative tolerance on every weight element: passes
            where `|got - expected| <= atol + rtol * |expected|` (as
            `np.allclose`). Defaults to `1e-5`.
        logs_atol: Float >= 0, `atol` for the training's results (History
            logs, ...). Defaults to `atol`.
        logs_rtol: Float >= 0, `rtol` for the training's results. Defaults to `rtol`.
        seed: Integer for `keras.utils.set_random_seed(seed)` before each build
            and each training, or `None` (default) to leave the RNG alone.
        **fit_kwargs: Passed to `fit` by the default training, e.g.
            `batch_size=8, epochs=2`. `shuffle` defaults to `False` and
            `verbose` to `0` here, so both models see the same batches.

    Returns:
        `SingleDeviceComparison`: both trained models and their results; for
        a `DistributedModel`, `verify`'s `VerifyReport` (it passed).

    Raises:
        AssertionError: A weight or result differs beyond the tolerance, or
            the results differ in structure (other keys, shapes, lengths). The
            message names the worst weight (its path and shape) or result, the
            element, both values and the tolerance.
        ValueError: The two models' weights differ in number or shape, `train`
            was given with `x`, `y` or `fit_kwargs`, or neither `train` nor `x`
            was given, or a tolerance is negative; for a `DistributedModel`,
            an argument that does not apply was given (or what `verify` raises).

    Example:
    >>> import keras, numpy as np, tensorflow as tf
    >>> from keras_dist.testing import assert_matches_single_device
    >>> def build(Model, **kwargs):
    ...     inputs = keras.Input((3,))
    ...     model = Model(inputs, keras.layers.Dense(1)(inputs), **kwargs)
    ...     model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ...     return model
    >>> x = np.random.RandomState(0).rand(10, 3).astype("float32")
    >>> import contextlib, io
    >>> with contextlib.redirect_stdout(io.StringIO()):  # fit prints keras-dist's plan once
    ...     result = assert_matches_single_device(
    ...         build, x, x.sum(1, keepdims=True), strategy="one_device", batch_size=4, epochs=2)
    >>> result.max_weight_difference < 1e-5
    True
    """
    from keras_dist._model import DistributedModel  # Imported here: keeps `keras_dist.testing` light to import.
    from keras_dist._wrap import distribute

    if isinstance(build_model, keras.Model):
        return _verify_model(build_model, x, y, strategy, train, atol, rtol, logs_atol, logs_rtol, seed, fit_kwargs)

    for name, value in (("atol", atol), ("rtol", rtol), ("logs_atol", logs_atol), ("logs_rtol", logs_rtol)):
        if value is not None and not value >= 0:
            raise ValueError(f"`{name}` must be a number >= 0. Received: {name}={value!r}. Fix: pass e.g. 1e-5.")
    if train is not None and (x is not None or y is not None or fit_kwargs):
        raise ValueError(
            "Pass either `train` (a callable run on each model) or `x`/`y`/fit arguments, not both. "
            f"Received: train={train!r}, x given: {x is not None}, y given: {y is not None}, "
            f"fit_kwargs={sorted(fit_kwargs)}. Fix: call fit inside `train`, or drop `train`."
        )
    if train is None:
        if x is None:
            raise ValueError(
                "`assert_matches_single_device` needs training data or a `train` callable. Received: x=None "
                "and train=None. Fix: pass x (and y), or train=lambda model: model.fit(...)."
            )
        fit_kwargs = {"shuffle": False, "verbose": 0, **fit_kwargs}

        def train(model):
            return model.fit(x, y, **fit_kwargs)

    takes_model_class = bool(inspect.signature(build_model).parameters)

    def build(distributed):
        if seed is not None:
            keras.utils.set_random_seed(seed)
        if takes_model_class:
            if distributed:
                return build_model(DistributedModel, strategy=strategy)
            return build_model(keras.Model)
        model = build_model()
        return distribute(model, strategy=strategy) if distributed else model

    reference = build(False)
    _build_optimizers_before_the_step(reference)
    model = build(True)
    reference_paths = [_weight_name(w) for w in reference.weights]
    if [w.shape for w in reference.get_weights()] != [w.shape for w in model.get_weights()]:
        raise ValueError(
            "`build_model` must build the same model both times. Received weights "
            f"{[(p, w.shape) for p, w in zip(reference_paths, reference.get_weights())]} on one device and "
            f"{[(_weight_name(v), w.shape) for v, w in zip(model.weights, model.get_weights())]} under the "
            "strategy. Fix: build the layers the same way whatever class `build_model` receives."
        )
    model.set_weights(reference.get_weights())

    all_results = []
    for m in (reference, model):
        if seed is not None:
            keras.utils.set_random_seed(seed)
        all_results.append(_to_numpy(train(m)))
    reference_results, results = all_results

    problems = []
    expected_weights = {f"weights[{i}]": w for i, w in enumerate(reference.get_weights())}
    got_weights = {f"weights[{i}]": w for i, w in enumerate(model.get_weights())}
    names = {
        f"weights[{i}]": f"{p} {tuple(w.shape)}" for i, (p, w) in enumerate(zip(reference_paths, got_weights.values()))
    }
    problems += _compare(expected_weights, got_weights, atol, rtol, "weight", names)
    problems += _compare(
        _flatten(reference_results, "results"),
        _flatten(results, "results"),
        atol if logs_atol is None else logs_atol,
        rtol if logs_rtol is None else logs_rtol,
        "result",
    )
    if problems:
        raise AssertionError(
            f"The DistributedModel on {type(model.distribute_strategy).__name__} "
            f"({model.distribute_strategy.num_replicas_in_sync} replicas) does not match plain Keras on one "
            "device:\n  " + "\n  ".join(problems)
        )
    return SingleDeviceComparison(
        reference=reference,
        model=model,
        reference_results=reference_results,
        results=results,
        max_weight_difference=max_weight_difference(reference, model),
    )


_VERIFY_ARGUMENTS = ("batch_size", "sample_weight", "steps", "random_layers")


def _verify_model(model, x, y, strategy, train, atol, rtol, logs_atol, logs_rtol, seed, fit_kwargs):
    """`assert_matches_single_device` on a model that exists: `keras_dist.verify`, its report as the error."""
    from keras_dist._verify import verify

    given = {
        "strategy": strategy != "auto",
        "train": train is not None,
        "logs_atol": logs_atol is not None,
        "logs_rtol": logs_rtol is not None,
        "seed": seed is not None,
        **{name: True for name in fit_kwargs if name not in _VERIFY_ARGUMENTS},
    }
    misplaced = sorted(name for name, value in given.items() if value)
    if misplaced:
        raise ValueError(
            "With a model that exists, `assert_matches_single_device` runs `keras_dist.verify`: the model's own "
            f"strategy, its own train step on x/y. Received arguments that do not apply: {misplaced}. Fix: drop "
            f"them (verify takes {list(_VERIFY_ARGUMENTS)}), or pass a builder function instead of the model."
        )
    report = verify(model, x, y, atol=atol, rtol=rtol, **fit_kwargs)
    if not report.passed:
        raise AssertionError(f"The DistributedModel does not match plain Keras on one device:\n{report}")
    return report


def _build_optimizers_before_the_step(reference):
    """Makes the one-device reference's optimizers build eagerly where Keras would build them in the traced step.

    Keras on one device builds the compiled optimizer while tracing the
    first train step, where what `build` assigns is lost: ScheduleFreeAdamW's
    momentum starts at 0, not at the weights (Keras 3.15.1). The reference
    then trained otherwise than Keras does under any strategy or after
    `optimizer.build(...)` (loss 1.058, 1.094 over 2 epochs instead of
    0.967, 0.852; max weight difference 0.768 in a new-user probe), and a
    DistributedModel that trains as Keras means to was reported wrong. Every
    other optimizer's numbers are the same either way.
    """
    from keras_dist import _compat
    from keras_dist._runtime import variables

    if not _compat.is_active("optimizer_built_in_step"):
        return
    for optimizer in variables.optimizers_in([getattr(reference, "optimizer", None), *vars(reference).values()]):
        variables.build_outside_step(optimizer, without_strategy=True)


def _weight_name(variable):
    return getattr(variable, "path", None) or variable.name


def _to_numpy(value):
    if isinstance(value, Mapping):
        return {str(k): _to_numpy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_numpy(v) for v in value]
    if isinstance(getattr(value, "history", None), dict):  # a keras History
        return _to_numpy(value.history)
    if value is None:
        return None
    return np.asarray(value)


def _flatten(value, prefix):
    """Nested results -> {"results.loss": array}; a list of scalars (a History log) stays one array."""
    if isinstance(value, dict):
        out = {}
        for k in sorted(value):
            out.update(_flatten(value[k], f"{prefix}.{k}"))
        return out
    if isinstance(value, Sequence) and not isinstance(value, str):
        if value and all(isinstance(v, np.ndarray) and v.ndim == 0 for v in value):
            return {prefix: np.array(value)}
        out = {}
        for i, v in enumerate(value):
            out.update(_flatten(v, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


def _compare(expected, got, atol, rtol, kind, names=None):
    """Returns one line per problem, worst first: structure, then the element furthest over tolerance."""
    names = names or {}
    problems = []
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing or extra:
        problems.append(f"{kind}s differ in structure: only on one device {missing}, only under the strategy {extra}")
    over = []
    for key in sorted(set(expected) & set(got)):
        a, b = got[key], expected[key]
        if a is None or b is None:
            if (a is None) != (b is None):
                problems.append(f"{key}: {a!r} under the strategy vs {b!r} on one device")
            continue
        if a.shape != b.shape:
            problems.append(f"{names.get(key, key)}: shape {a.shape} under the strategy vs {b.shape} on one device")
            continue
        if a.size == 0:
            continue
        if not (np.issubdtype(b.dtype, np.number) or b.dtype == bool):
            if not np.array_equal(a, b):
                problems.append(f"{names.get(key, key)}: values differ")
            continue
        a64, b64 = a.astype("float64"), b.astype("float64")
        diff = np.abs(a64 - b64)
        excess = np.where(np.isnan(a64) & np.isnan(b64), -np.inf, diff - (atol + rtol * np.abs(b64)))
        excess = np.where(np.isnan(excess), np.inf, excess)  # a NaN on one side only
        if excess.max() > 0:
            at = np.unravel_index(int(np.argmax(excess)), excess.shape)
            over.append((float(excess.max()), key, at, float(a64[at]), float(b64[at]), float(np.nanmax(diff))))
    over.sort(key=lambda item: -item[0])
    for _, key, at, a, b, worst in over:
        where = f" at index {tuple(int(i) for i in at)}" if at else ""
        problems.append(
            f"{kind} {names.get(key, key)}: max |difference| {worst:.3g}{where}: {a:.8g} under the strategy vs "
            f"{b:.8g} on one device (tolerance atol={atol:g} + rtol={rtol:g} * |one device|)"
        )
    if len(over) > 1:
        problems.insert(len(problems) - len(over), f"{len(over)} {kind}s over tolerance, worst first:")
    return problems
