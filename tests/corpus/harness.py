"""Runs a corpus program and compares two runs of it.

A run (`run_program`) seeds Keras, builds the program's data and model, gives the
model the reference's starting weights (when given), trains it with the program's
own `train`, and returns the program's results plus the final weights, as NumPy.
`compare` flattens two such results into named arrays and measures, per group
(`weights`, `history`, `evaluate`, `predict` and any other key the program
returns), the largest absolute and relative difference.

Importable without TensorFlow having run an op (the programs build nothing at
import), so the launcher's worker processes and the unit tests share it.
"""

import hashlib
import importlib
import os
import sys
import time

import numpy as np

SEED = 1234
TOL = 1e-4  # rtol and atol of `np.testing.assert_allclose`, for every compared number


def load(name):
    """Returns the program module `corpus.programs.<name>`."""
    return importlib.import_module(f"corpus.programs.{name}")


def _identity(model, **kwargs):
    return model


def one_device_api():
    """(Model, distribute) as plain Keras on one device: `keras.Model` and no wrapping."""
    import keras

    return keras.Model, _identity


def distributed_api():
    """(Model, distribute) as keras-dist: `keras_dist.DistributedModel`, `keras_dist.distribute`."""
    import keras_dist

    return keras_dist.DistributedModel, keras_dist.distribute


def run_program(program, Model, distribute, initial_weights=None):
    """Builds and trains `program` with the given API; returns its results as NumPy.

    Args:
        program: A corpus program module (`data`, `build`, `train`).
        Model: `keras.Model` or `keras_dist.DistributedModel`.
        distribute: A function `model -> model` (identity, or `keras_dist.distribute`).
        initial_weights: List of NumPy arrays for `model.set_weights` before training, or
            `None` to keep the model's own (the reference run).

    Returns:
        Dict: the program's `train` results (history, evaluate, predict, ...) converted
        to NumPy, plus `"initial_weights"` and `"weights"` (lists of arrays),
        `"weight_paths"`, `"model"` (the trained model), and `"seconds"` and
        `"cpu_seconds"` (build + train, wall and this process's CPU time).
    """
    import keras

    start, cpu_start = time.perf_counter(), time.process_time()
    keras.utils.set_random_seed(SEED)
    data = program.data()
    policy = keras.mixed_precision.global_policy()
    try:
        model = program.build(Model, distribute)
    finally:
        keras.mixed_precision.set_global_policy(policy)  # a program may set mixed_float16
    if initial_weights is not None:
        model.set_weights(initial_weights)
    initial = [np.array(w) for w in model.get_weights()]
    keras.utils.set_random_seed(SEED)
    results = to_numpy(program.train(model, data))
    results["initial_weights"] = initial
    results["weights"] = [np.array(w) for w in model.get_weights()]
    results["weight_paths"] = [getattr(w, "path", w.name) for w in model.weights]
    results["model"] = model
    results["seconds"] = time.perf_counter() - start
    results["cpu_seconds"] = time.process_time() - cpu_start
    return results


# A directory where one-device references are kept between test sessions of one stack (CI sets it:
# the in-process tier writes each reference, the multi-worker tier reads the 22 it needs).
REFERENCES_ENV = "CORPUS_REFERENCES"


def _reference_path(name):
    """`$CORPUS_REFERENCES/NAME-KEY.npz`, KEY a hash of all a reference depends on; or None if unset."""
    directory = os.environ.get(REFERENCES_ENV)
    if not directory:
        return None
    import keras
    import tensorflow as tf

    key = hashlib.sha256()
    for path in (load(name).__file__, __file__):
        with open(path, "rb") as f:
            key.update(f.read())
    key.update(f"{sys.version} {np.__version__} {keras.__version__} {tf.__version__}".encode())
    key.update(os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset").encode())
    return os.path.join(directory, f"{name}-{key.hexdigest()[:16]}.npz")


def one_device_reference(name, reuse=False):
    """The one-device reference of program NAME: `run_program` with plain Keras (`one_device_api`).

    With `$CORPUS_REFERENCES` set to a directory, a computed reference is written there
    (atomically), and `reuse=True` reads one written by an earlier session of the same program,
    harness, Python, NumPy, Keras and TensorFlow with the same oneDNN setting (the file name holds
    a hash of them). A read reference has every compared group, `initial_weights` and `weight_paths`,
    but no `model`, `seconds` or `cpu_seconds`.
    """
    path = _reference_path(name)
    if reuse and path and os.path.exists(path):
        results = load_results(path)
        initial = results.pop("_initial")
        results["initial_weights"] = [initial[str(i)] for i in range(len(initial))]
        results["weight_paths"] = [str(p) for p in results.pop("_paths")]
        return results
    results = run_program(load(name), *one_device_api())
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        extra = {f"_initial.{i}": w for i, w in enumerate(results["initial_weights"])}
        extra["_paths"] = np.array(results["weight_paths"], dtype=str)
        save_results(path + ".tmp.npz", results, **extra)
        os.replace(path + ".tmp.npz", path)
    return results


def to_numpy(value):
    """Nested dicts/lists/tuples of tensors or numbers -> the same structure of NumPy arrays."""
    if isinstance(value, dict):
        return {str(k): to_numpy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_numpy(v) for v in value]
    if hasattr(value, "history") and isinstance(value.history, dict):  # a keras History
        return to_numpy(value.history)
    return np.array(value)


def flatten(value, prefix=""):
    """Nested structure -> {"a.b.0": array}; lists of scalars (history) stay one array."""
    if isinstance(value, dict):
        out = {}
        for k in sorted(value):
            out.update(flatten(value[k], f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list):
        if all(isinstance(v, np.ndarray) and v.ndim == 0 for v in value):
            return {prefix: np.array(value)}
        out = {}
        for i, v in enumerate(value):
            out.update(flatten(v, f"{prefix}.{i}"))
        return out
    return {prefix: np.asarray(value)}


COMPARED = ("weights", "history", "evaluate", "predict")


def tolerance(program):
    """The program's `TOLERANCE` if it sets one (mixed precision), else `TOL`."""
    return getattr(program, "TOLERANCE", TOL)


def compare(reference, got, tol=TOL):
    """Measures how far `got` is from `reference` (two `run_program` results).

    Returns:
        Dict with, per group (`weights`, `history`, `evaluate`, `predict`, and any
        other key the program returned), `{"abs": max |a-b|, "rel": max |a-b|/|b|,
        "excess": max (|a-b| - tol*(1+|b|))}`, plus `"mismatched"`: list of
        strings naming structural differences (missing keys, other shapes or
        history lengths). Passing means `mismatched` is empty and every `excess`
        is <= 0 (`np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)`).
    """
    skip = {"model", "seconds", "cpu_seconds", "initial_weights", "weight_paths"}
    groups = sorted(set(reference) - skip, key=lambda k: (COMPARED.index(k) if k in COMPARED else 9, k))
    report = {"mismatched": []}
    for group in groups:
        if group not in got:
            report["mismatched"].append(f"{group}: missing")
            continue
        ref_flat, got_flat = flatten(reference[group], group), flatten(got[group], group)
        if sorted(ref_flat) != sorted(got_flat):
            report["mismatched"].append(f"{group}: keys {sorted(set(ref_flat) ^ set(got_flat))} in only one run")
        worst = {"abs": 0.0, "rel": 0.0, "excess": -np.inf, "where": "", "over": {}}
        for key in sorted(set(ref_flat) & set(got_flat)):
            a, b = got_flat[key], ref_flat[key]
            if a.shape != b.shape:
                report["mismatched"].append(f"{key}: shape {a.shape} vs {b.shape} on one device")
                continue
            if a.size == 0:
                continue
            if not np.issubdtype(b.dtype, np.number):
                if not np.array_equal(a, b):
                    report["mismatched"].append(f"{key}: values differ")
                continue
            a64, b64 = a.astype("float64"), b.astype("float64")
            diff = np.abs(a64 - b64)
            bad = ~np.isfinite(a64) & np.isfinite(b64)
            if bad.any():
                report["mismatched"].append(f"{key}: non-finite values")
            diff = np.where(np.isfinite(diff), diff, 0.0)
            excess = float(np.max(diff - tol * (1 + np.abs(b64))))
            if excess > 0:
                worst["over"][key] = float(diff.max())
            if excess > worst["excess"]:
                at = np.unravel_index(np.argmax(diff - tol * (1 + np.abs(b64))), diff.shape)
                worst["where"], worst["values"] = key, (float(a64[at]), float(b64[at]))
            worst["abs"] = max(worst["abs"], float(diff.max()))
            worst["rel"] = max(worst["rel"], float(np.max(diff / np.maximum(np.abs(b64), 1e-12))))
            worst["excess"] = max(worst["excess"], excess)
        report[group] = worst
    return report


def passed(report):
    return not report["mismatched"] and all(v["excess"] <= 0 for k, v in report.items() if k != "mismatched")


def describe(report, weight_paths=None):
    """One line per group: `weights: abs 1.2e-07 (at weights.3)`; `weight_paths` names weights.N."""
    lines = list(report["mismatched"])

    def name(key):
        return f"{key} ({weight_paths[int(key.split('.')[1])]})" if weight_paths and key.startswith("weights.") else key

    for group, worst in report.items():
        if group != "mismatched":
            flag = "" if worst["excess"] <= 0 else "  <-- over tolerance"
            values = (
                f": {worst['values'][0]:.6g} vs {worst['values'][1]:.6g} on one device" if worst.get("values") else ""
            )
            lines.append(
                f"{group}: max abs {worst['abs']:.3g}, rel {worst['rel']:.3g} (at {name(worst['where'])}{values}){flag}"
            )
            if worst["over"] and len(worst["over"]) > 1:
                ranked = sorted(worst["over"].items(), key=lambda kv: -kv[1])
                shown = ", ".join(f"{name(k)} {v:.2g}" for k, v in ranked[:6])
                lines.append(f"    over tolerance ({len(ranked)}): {shown}{', ...' if len(ranked) > 6 else ''}")
    return "\n".join(lines)


class auto_strategy:
    """Context manager: `strategy="auto"` (what the programs leave) resolves to `strategy`.

    The unit-test session has 4 simulated CPU devices, where "auto" would mirror over
    all 4; a user running a program with `KERAS_DIST_CPU_REPLICAS=2` gets 2. This swaps
    keras-dist's resolver for the duration (outside any `strategy.scope()`, so variables
    are created where the user's would be); `run_program` callers check
    `model.distribute_strategy` is the one asked for.
    """

    def __init__(self, strategy):
        self.strategy = strategy

    def __enter__(self):
        import tensorflow as tf

        from keras_dist.strategy import _resolve

        self._module, self._original = _resolve, _resolve.resolve_strategy
        strategy, original = self.strategy, self._original

        def resolve_strategy(name="auto"):
            if isinstance(name, str) and name == "auto" and not tf.distribute.has_strategy():
                return strategy
            return original(name)

        _resolve.resolve_strategy = resolve_strategy
        return self.strategy

    def __exit__(self, *exc):
        self._module.resolve_strategy = self._original
        return False


def save_results(path, results, **extra):
    """Writes the compared groups of `run_program` results, and `extra` arrays, to an `.npz` (flat keys like `history.loss`)."""
    flat = dict(extra)
    for group, value in results.items():
        if group not in ("model", "seconds", "cpu_seconds", "weight_paths", "initial_weights"):
            flat.update(flatten(value, group))
    np.savez(path, **flat)


def load_results(path):
    """Reads `save_results`' file back as {group: {rest of key: array}}, which `compare` accepts."""
    results = {}
    with np.load(path) as npz:
        for key in npz.files:
            group, _, rest = key.partition(".")
            if rest:
                results.setdefault(group, {})[rest] = npz[key]
            else:  # the whole group is one array (e.g. `predict`)
                results[group] = npz[key]
    return results
