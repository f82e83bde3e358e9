"""Layer 3: does a compiled loss or metric couple the examples of a batch? A check on one batch, on the host.

Under N replicas each replica computes a compiled loss on its part of the
global batch, and keras-dist combines the parts (weighted by their divisors,
metric state summed). That is one device's value exactly when the loss's
per-example values do not depend on the other examples of the batch. A loss
that couples them (an in-batch softmax, a contrastive or triplet loss, a Dice
over the whole batch) gives another value, which only
`keras_dist.global_batch` makes one device's.

`find_coupled` checks each compiled loss and metric on one global batch:
one forward pass of the model (`training=False`: no dropout, no moving
statistics, no random draws), then each loss's unreduced values
(`loss.call(y_true, y_pred)`, before masks and sample weights, so neither can
cause a false alarm) on the whole batch against the concatenation of its
values on the replicas' parts (a loss function that returns one number: its
value against the parts' example-weighted mean), at a relative tolerance of
`RTOL`. Metric functions (`MeanMetricWrapper`) are checked the same way,
except those returning one number per batch (keras-dist computes those on the
global batch already, `batch_metrics`); a metric class of one's own by its
result from the parts' summed state against the whole batch's (computed
statelessly). Keras' own metric classes are sums of per-example state: exact.
Where a layer is a class of one's own, what each layer adds with `add_loss`
is checked the same way (`_coupled_added_losses`; one forward pass per part).
No collective runs, no variable is assigned, no random number is drawn;
any failure of the check itself counts as "not coupled".

`first_batch` takes that batch where it is cheap and free of side effects:
the first `batch_size` rows of in-memory arrays, or the first element of a
`tf.data.Dataset` built only from in-memory tensors with deterministic,
stateless transformations (no shuffle, no file reading, no random op in a
`map`): a fresh iterator of such a dataset changes nothing the training sees.
"""

import contextlib
import dataclasses
import threading
import warnings

import keras
import numpy as np
import tensorflow as tf
from keras import ops, tree

from keras_dist._runtime import keras_internals as ki
from keras_dist._runtime import loss_terms, step_state

RTOL = 1e-4
MAX_EXAMPLES = 64  # The check's forward pass sees at most this many examples (one device holds them).
# Keras' losses and loss functions whose values are per example (Dice, Tversky and Circle couple the batch).
_PER_EXAMPLE_LOSSES = {
    "MeanSquaredError",
    "MeanAbsoluteError",
    "MeanAbsolutePercentageError",
    "MeanSquaredLogarithmicError",
    "CosineSimilarity",
    "Huber",
    "LogCosh",
    "Hinge",
    "SquaredHinge",
    "CategoricalHinge",
    "KLDivergence",
    "Poisson",
    "BinaryCrossentropy",
    "BinaryFocalCrossentropy",
    "CategoricalCrossentropy",
    "CategoricalFocalCrossentropy",
    "SparseCategoricalCrossentropy",
}
_PER_EXAMPLE_LOSS_FUNCTIONS = {
    "mean_squared_error",
    "mean_absolute_error",
    "mean_absolute_percentage_error",
    "mean_squared_logarithmic_error",
    "cosine_similarity",
    "huber",
    "log_cosh",
    "hinge",
    "squared_hinge",
    "categorical_hinge",
    "kl_divergence",
    "poisson",
    "binary_crossentropy",
    "binary_focal_crossentropy",
    "categorical_crossentropy",
    "categorical_focal_crossentropy",
    "sparse_categorical_crossentropy",
}
# Set on the classes of `keras_dist.global_batch`'s wrappers: computed on the global batch already.
ON_GLOBAL_BATCH = "_keras_dist_on_global_batch"

_SUPPRESSED = []  # Non-empty inside `suppressed()` (verify's own training runs).

# tf.data classes whose fresh iterator reads nothing but memory and draws no random number.
_SAFE_DATASETS = {
    "_TensorSliceDataset",
    "_TensorDataset",
    "_RangeDataset",
    "_BatchDataset",
    "_PaddedBatchDataset",
    "_UnbatchDataset",
    "_MapDataset",
    "_ParallelMapDataset",
    "_FilterDataset",
    "_PrefetchDataset",
    "_OptionsDataset",
    "_TakeDataset",
    "_SkipDataset",
    "_RepeatDataset",
    "_ZipDataset",
    "_ConcatenateDataset",
    "_CacheDataset",
    "_AssertCardinalityDataset",
    "_ShardDataset",
    "_EnumerateDataset",
}


@dataclasses.dataclass(frozen=True)
class Coupled:
    """A compiled loss or metric, or a loss a layer adds, found to couple the examples of a batch.

    Attributes:
        kind: `"loss"`, `"metric"`, or `"added loss"` (a value a layer adds with `add_loss`).
        name: String, its name (as in the logs; for an added loss, the layer's path).
        wrapped: The object to pass to `keras_dist.global_batch` (the loss, or the metric); `None` for an added loss.
        difference: Python float, the largest relative difference seen (inf: other shapes).
        by_definition: True for one of Keras' losses that couples by definition
            (`_couples_by_definition`), whatever the difference on this batch.
        summed: True for an added loss whose parts' values add up to the
            whole batch's: one number that is a sum over the batch.
        source: For an added loss, `(layer, position)`: the layer and the
            index of the value among those it adds in one call.
        eager: True for a compiled loss that is a sum or a ratio of sums
            over the batch, read from its traced graph, which the step cannot
            read under `run_eagerly=True` (it counts the value as a mean).
    """

    kind: str
    name: str
    wrapped: object
    difference: float
    by_definition: bool = False
    summed: bool = False
    source: object = None
    eager: bool = False


@contextlib.contextmanager
def suppressed():
    """No check runs while the block runs (e.g. `verify`'s own training, which reports the cause itself)."""
    _SUPPRESSED.append(True)
    try:
        yield
    finally:
        _SUPPRESSED.pop()


def is_suppressed():
    return bool(_SUPPRESSED)


# ------------------------------------------------------------------ the batch


def first_batch(x, y, sample_weight, batch_size):
    """`(x, y, sample_weight)` of a first global batch taken without side effects, or `None` where that is not cheap."""
    if isinstance(x, tf.data.Dataset):
        if not _safe_to_iterate(x):
            return None
        for element in x.take(1):
            return ki.unpack_x_y_sample_weight(element)
        return None
    leaves = tree.flatten(x) if x is not None else []
    others = [] if y is None else tree.flatten(y)
    if not leaves or not all(isinstance(v, (np.ndarray, tf.Tensor)) for v in leaves + others):
        return None
    size = min(batch_size or 32, int(leaves[0].shape[0]))

    def head(v):
        return None if v is None else v[:size]

    return tree.map_structure(head, x), tree.map_structure(head, y), tree.map_structure(head, sample_weight)


def _safe_to_iterate(dataset, depth=0):
    if depth > 50 or type(dataset).__name__ not in _SAFE_DATASETS:
        return False
    for name in ("_map_func", "_predicate"):
        wrapper = getattr(dataset, name, None)
        function = getattr(wrapper, "function", None)
        if wrapper is not None and (
            function is None or any(op.op_def.is_stateful for op in function.graph.get_operations())
        ):
            return False
    try:
        inputs = dataset._inputs()
    except (AttributeError, NotImplementedError):
        return False
    return all(_safe_to_iterate(d, depth + 1) for d in inputs)


# ------------------------------------------------------------------ the check


def find_coupled(model, batch, num_parts):
    """Returns the `Coupled` compiled losses and metrics of `model` on `batch` split into `num_parts` parts.

    Args:
        model: A built, compiled `keras.Model` (keras-dist's own step).
        batch: `(x, y, sample_weight)` of one global batch (NumPy or eager tensors).
        num_parts: Integer, the replicas the batch is split over.
    """
    x, y, sample_weight = batch
    compiled = y is not None and _anything_to_check(model)
    # Under `run_eagerly=True` (debugging: a breakpoint or `.numpy()` in `call`) `call` runs only in the steps:
    # added losses are not checked there (a test counting each replica's eager calls saw the check's).
    added = _may_add_losses(model) and not getattr(model, "run_eagerly", False)
    if not compiled and not added:
        return []  # Keras' per-example losses and metrics and Keras' own layers only: no forward pass.
    size = min(int(tree.flatten(x)[0].shape[0]), MAX_EXAMPLES)
    x, y, sample_weight = tree.map_structure(lambda v: None if v is None else v[:size], (x, y, sample_weight))
    sizes = [len(p) for p in np.array_split(np.arange(size), num_parts)]
    if sum(1 for s in sizes if s) < 2:
        return []
    # Keras' own warnings about the check's calls (the structure a wrapped `Sequential` takes its inputs in,
    # a new-user probe: a `UserWarning` on every `fit`) are not the user's: the check's forward passes say nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with _watching_batch_statistics() as watched:
            y_pred = model(x, training=False)
        # A loss computed with `batch_mean` is the global batch's already; the parts cannot show it.
        found = _coupled_added_losses(model, x, sizes) if added and not watched.taken else []
    if not compiled:
        return found
    compile_loss = getattr(model, "_compile_loss", None)
    for entry in getattr(compile_loss, "_flat_losses", None) or []:
        path, loss = entry[0], entry[1]
        pair = _resolve(path, y, y_pred)
        if pair is None or getattr(type(loss), ON_GLOBAL_BATCH, False):
            continue
        divisors = lambda t, p, _loss=loss: _ratio_terms_of(_loss, t, p)  # noqa: E731
        values = lambda t, p, _loss=loss: _loss_values(_loss, t, p)  # noqa: E731
        difference = _difference(values, *pair, sizes, divisors)
        # Eagerly the step has no graph to read sums and ratios from: it counts the value by the examples.
        eager = difference is None and getattr(model, "run_eagerly", False)
        difference = _difference(values, *pair, sizes) if eager else difference
        if _couples_by_definition(loss):
            found.append(Coupled("loss", loss.name, _unwrapped(loss), difference or 0.0, by_definition=True))
        elif difference is not None:
            found.append(Coupled("loss", loss.name, _unwrapped(loss), difference, eager=eager))
    found.extend(_coupled_metrics(model, y, y_pred, sample_weight, sizes))
    return found


_BATCH_STATISTICS = threading.local()  # `watched`: the `_Watched` of the forward pass being watched, or None.


@dataclasses.dataclass
class _Watched:
    taken: bool = False  # `keras_dist.ops.batch_mean` ran in the watched forward pass.


@contextlib.contextmanager
def _watching_batch_statistics():
    """Yields a `_Watched` whose `taken` says whether `batch_mean` ran inside (on this thread)."""
    watched, previous = _Watched(), getattr(_BATCH_STATISTICS, "watched", None)
    _BATCH_STATISTICS.watched = watched
    try:
        yield watched
    finally:
        _BATCH_STATISTICS.watched = previous


def note_batch_statistic():
    """Called by `keras_dist.ops.batch_mean`: the check of added losses cannot see the global batch's statistics."""
    watched = getattr(_BATCH_STATISTICS, "watched", None)
    if watched is not None:
        watched.taken = True


def _may_add_losses(model):
    """Whether a layer of `model` (or the model) is a class of one's own: its `call` may `add_loss` a batch statistic.

    Keras' classes and keras-dist's (`DistributedModel`, the wrapper
    `distribute` makes) add none of their own.
    """
    return any(
        not type(layer).__module__.startswith(("keras.", "keras_dist."))
        for layer in model._flatten_layers(include_self=True)
    )


def _added_losses(model):
    """`{(layer path, position): (layer, float64 array)}`: what each layer added with `add_loss` in the model's last call.

    A value keras-dist already counts as a sum (`loss_terms.counts_as_sum`) is left out.
    """
    added = {}
    for layer in model._flatten_layers(include_self=True):
        for position, value in enumerate(layer._get_own_losses()):
            if not loss_terms.counts_as_sum(layer, position):
                key = (getattr(layer, "path", None) or layer.name, position)
                added[key] = (layer, np.asarray(ops.convert_to_numpy(value), "float64"))
    return added


def _coupled_added_losses(model, x, sizes):
    """`Coupled` for each `add_loss` value of the model's last call (on `x`) that the replicas' parts do not give.

    keras-dist counts a value added with one entry per example as a sum over
    the examples, and any other (a scalar) by the replicas' example shares
    (`loss_terms.global_surrogate`): the parts' values combined so are checked
    against the whole batch's. A function of statistics over the batch (a
    mixture-of-experts load-balancing loss, `mean(p, 0) * mean(mask, 0)`) is
    not: a new-user probe trained 0.21 off one device, unwarned.
    """
    try:
        whole = _added_losses(model)  # Of the whole batch's forward pass, just run.
        if not whole:
            return []
        per_part = []
        for part in _parts(x, sizes):
            model(part, training=False)
            per_part.append(_added_losses(model))
    except Exception:  # noqa: BLE001
        return []
    total = sum(sizes)
    shares = [s / total for s in sizes if s]
    found = []
    for key, (layer, expected) in whole.items():
        values = [part[key][1] if key in part else None for part in per_part]
        if any(v is None for v in values):
            continue
        summed = False
        if (
            expected.ndim
            and expected.shape[0] == total
            and all(v.ndim and v.shape[0] == n for v, n in zip(values, sizes))
        ):
            got = np.concatenate(values)
        elif all(v.shape == expected.shape for v in values):
            got = sum(share * v for share, v in zip(shares, values))
            summed = _relative_excess(sum(values), expected) is None  # A sum over the batch: the parts add up.
        else:
            got = None
        difference = float("inf") if got is None or got.shape != expected.shape else _relative_excess(got, expected)
        if difference is not None:
            name = f"{key[0]}" if key[1] == 0 else f"{key[0]} (its value {key[1] + 1})"
            found.append(Coupled("added loss", name, None, difference, summed=summed, source=(layer, key[1])))
    return found


_OVER_THE_BATCH_BY_DEFAULT = ("dice", "tversky")  # Keras' functions: one value over `axis`, by default every axis.
_PAIRS_ACROSS_THE_BATCH = ("circle",)  # Keras' function: pairs the batch's examples with each other.


def _couples_by_definition(loss):
    """Whether `loss` is Keras' Dice or Tversky over an `axis` that takes in the batch (the default), or Circle.

    Their value on the whole batch and the parts' example-weighted mean can
    agree to 1e-5 at the first step (a Dice over similar halves differs at
    second order), under the check's tolerance, while the gradients already
    differ (a new-user probe: `keras.losses.Dice()`, 4.6e-3 after one epoch,
    1.7e-2 after two, with no warning).
    """
    fn = getattr(loss, "fn", None) if isinstance(loss, ki.LossFunctionWrapper) else loss
    name = getattr(fn, "__name__", None)
    if not getattr(fn, "__module__", "").startswith("keras.") or name is None:
        return False
    if name in _PAIRS_ACROSS_THE_BATCH:
        return True
    if name not in _OVER_THE_BATCH_BY_DEFAULT:
        return False
    axis = (getattr(loss, "_fn_kwargs", None) or {}).get("axis")
    return axis is None or 0 in tree.flatten(axis)


def _anything_to_check(model):
    """False when every compiled loss and metric is one of Keras' own per-example ones (nothing can couple)."""
    compile_loss = getattr(model, "_compile_loss", None)
    for entry in getattr(compile_loss, "_flat_losses", None) or []:
        loss = entry[1]
        if getattr(type(loss), ON_GLOBAL_BATCH, False):
            continue
        fn = getattr(loss, "fn", None) if type(loss) is ki.LossFunctionWrapper else None
        known = (
            getattr(fn, "__name__", None) in _PER_EXAMPLE_LOSS_FUNCTIONS
            if fn is not None
            else type(loss).__name__ in _PER_EXAMPLE_LOSSES
        )
        module = getattr(fn if fn is not None else type(loss), "__module__", "")
        if not (known and module.startswith("keras.")):
            return True
    compile_metrics = getattr(model, "_compile_metrics", None)
    for lists in (
        getattr(compile_metrics, "_flat_metrics", None) or [],
        getattr(compile_metrics, "_flat_weighted_metrics", None) or [],
    ):
        for metrics_list in lists:
            for metric in getattr(metrics_list, "metrics", None) or []:
                keras_own = type(metric).__module__.startswith("keras.")
                if not keras_own or type(metric) is keras.metrics.MeanMetricWrapper:
                    return True  # A class of one's own, or a function wrapped by Keras: check it.
    return False


def _unwrapped(loss):
    """The function a `LossFunctionWrapper` Keras made of a compiled function, else the loss object."""
    fn = getattr(loss, "fn", None)
    return fn if type(loss) is ki.LossFunctionWrapper and fn is not None else loss


def _resolve(path, y, y_pred):
    """`(y_true, y_pred)` of the output at `path` (CompileLoss' path into `y_pred`), or `None`."""
    try:
        y_p = y_pred
        for key in path or ():
            y_p = y_p[key]
        if not tree.is_nested(y):
            return (y, y_p) if not tree.is_nested(y_pred) else None
        y_t = y if tree.is_nested(y) and _same_paths(y, y_pred) else tree.pack_sequence_as(y_pred, tree.flatten(y))
        for key in path or ():
            y_t = y_t[key]
        return y_t, y_p
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def _same_paths(a, b):
    try:
        tree.assert_same_paths(a, b)
        return True
    except (ValueError, TypeError, AttributeError):
        return False


def _loss_values(loss, y_true, y_pred):
    y_pred = tree.map_structure(lambda v: ops.convert_to_tensor(v, dtype=loss.dtype), y_pred)
    y_true = tree.map_structure(lambda v: ops.convert_to_tensor(v, dtype=loss.dtype), y_true)
    return loss.call(y_true, y_pred)


def _parts(value, sizes):
    """The replicas' parts of `value` (a tensor or nested structure), the empty ones left out."""
    bounds = np.cumsum([0, *sizes])
    return [tree.map_structure(lambda v, a=a, b=b: v[a:b], value) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _ratio_terms_of(loss, y_true, y_pred):
    """The parts of `loss`'s value on a part of the batch, where it holds ratios of sums or is a sum; else `None`.

    A list of `(coefficient, value, divisor, weight, ratio)`, one per term of
    the value (`loss_terms.terms_of`: the value itself, or the terms of a sum
    of ratios): `ratio` is the traced `loss_terms.Ratio` (`None` for a term
    that is not one; `SUMMED` for a value that is a sum over the examples,
    `loss_terms.summed_terms`, which the step counts once per replica),
    `value` the term's (a ratio's without NaN), `divisor` and `weight` floats
    (`Ratio.divisor`, `Ratio.weight`). Traced once per part (the ratios and
    sums are read from the graph), on the host.
    """
    found = []

    def traced(t, p):
        value = _loss_values(loss, t, p)
        if not tf.is_tensor(value) or value.shape.rank != 0:
            return tf.zeros([0, 4])
        rows = []
        # As the step splits it (`loss_terms.split_ratios`): each ratio, each sum over the examples, the rest.
        terms = loss_terms.terms_of(value)
        if len(terms) == 1 and loss_terms.ratio_of(value) is None:
            terms = loss_terms.linear_terms(value) or terms
        for coefficient, term in terms:
            ratio = loss_terms.ratio_of(term)
            if ratio is None and _summed(term, t, p):
                ratio = SUMMED
            found.append((coefficient, ratio))
            if ratio is None or ratio is SUMMED:
                rows.append([tf.cast(term, tf.float32), tf.constant(-1.0), tf.constant(-1.0)])
            else:
                safe = tf.cast(loss_terms.ratio_without_nan(term), tf.float32)
                rows.append([safe, ratio.divisor, ratio.weight])
        return tf.stack([tf.stack(row) for row in rows])

    try:
        # Traced for any batch size, as the step's graph reads it (a static batch dimension here made the kept
        # entries of `boolean_mask`, of unknown length, look summed over another axis than the mask: a false alarm).
        pair = [y_true, y_pred]
        dense = all(isinstance(v, (np.ndarray, tf.Tensor)) for v in tree.flatten(pair))
        specs = tree.map_structure(lambda v: tf.TensorSpec([None, *np.shape(v)[1:]], v.dtype), pair) if dense else None
        # A concrete function, called directly: `tf.function.__call__` counts the traces of every closure of
        # `traced` together and told the user to fix their loop (TensorFlow's retracing warning, in a probe).
        function = tf.function(traced, autograph=False, input_signature=specs)
        concrete = function.get_concrete_function() if specs else function.get_concrete_function(y_true, y_pred)
        rows = concrete(y_true, y_pred).numpy()
    except Exception:  # noqa: BLE001  (a loss that cannot be traced here: taken for a mean over examples)
        return None
    if not any(ratio is not None for _, ratio in found) or len(found) != len(rows):
        return None
    return [(c, float(r[0]), float(r[1]), float(r[2]), ratio) for (c, ratio), r in zip(found, rows)]


SUMMED = "summed"  # `_ratio_terms_of`: a value that is a sum over the examples (each part counts once).


def _summed(value, y_true, y_pred):
    """Whether scalar `value`, traced from `y_true` and `y_pred`, is a sum over their rows, as the step reads it.

    `loss_terms.summed_terms` with the traced inputs as the batch's tensors.
    """
    leaves = step_state.data_leaves([y_true, y_pred])
    if not leaves:
        return False
    rows = leaves[0].shape[0]
    step = step_state.ReplicaStep(
        step_state.SUM, num_examples=tf.constant(rows) if rows is not None else None, data_leaves=leaves
    )
    return loss_terms.summed_terms(value, step) is not None


def _combined(per_part, counts):
    """The parts' scalar values combined as the step weights them: ratios by their denominators, sums once, the rest by examples.

    `per_part`: `_ratio_terms_of` of each part (the same terms on each);
    `counts`: their examples. `None` where a ratio's global denominator is 0.
    """
    combined = 0.0
    for k, (coefficient, _, _, _, ratio) in enumerate(per_part[0]):
        if ratio is SUMMED:
            combined += coefficient * sum(part[k][1] for part in per_part)
            continue
        if ratio is None:
            combined += coefficient * sum(n * part[k][1] for n, part in zip(counts, per_part)) / sum(counts)
            continue
        denominator = ratio.global_denominator(sum(part[k][2] for part in per_part))
        if not denominator:
            return None
        # A part of weight 0 (a ratio whose part kept no tokens: 0 / 0) counts nothing, as in the step.
        combined += coefficient * sum(part[k][3] * part[k][1] for part in per_part if part[k][3]) / denominator
    return combined


def _difference(values_of, y_true, y_pred, sizes, divisors_of=None):
    """The largest relative difference between whole-batch and per-part values, when over `RTOL`; else `None`.

    A scalar's parts combine weighted by their examples, or, where `divisors_of(y_true, y_pred)`
    reads ratios of sums in every part's value (`_ratio_terms_of`), each ratio by its share of
    the global denominator and the rest by examples, as the step weights them.
    """
    try:
        whole = np.asarray(values_of(y_true, y_pred), dtype="float64")
        parts = [
            np.asarray(values_of(t, p), dtype="float64") for t, p in zip(_parts(y_true, sizes), _parts(y_pred, sizes))
        ]
    except Exception:  # noqa: BLE001  (a loss that cannot run on a part: not for this check to say)
        return None
    counts = [s for s in sizes if s]
    if whole.ndim == 0:
        if any(p.ndim for p in parts):
            return float("inf")
        combined = None
        if divisors_of is not None:
            per_part = [divisors_of(t, p) for t, p in zip(_parts(y_true, sizes), _parts(y_pred, sizes))]
            if all(r is not None and len(r) == len(per_part[0]) for r in per_part):
                combined = _combined(per_part, counts)
        if combined is None:
            combined = sum(n * float(p) for n, p in zip(counts, parts)) / sum(counts)
    else:
        if any(p.ndim == 0 or p.shape[1:] != whole.shape[1:] for p in parts):
            return float("inf")
        combined = np.concatenate(parts, axis=0)
        if combined.shape != whole.shape:
            return float("inf")
    return _relative_excess(combined, whole)


def _relative_excess(got, expected):
    """`max |got - expected| / (|expected| + scale)` when some element is over `RTOL` of it, else `None`."""
    scale = 1e-2 * max(float(np.nanmax(np.abs(expected))) if expected.size else 0.0, 1e-6)
    both_nan = np.isnan(got) & np.isnan(expected)
    difference = np.where(both_nan, 0.0, np.abs(got - expected)) / (np.abs(expected) + scale)
    worst = float(np.max(np.where(np.isnan(difference), np.inf, difference))) if difference.size else 0.0
    return worst if worst > RTOL else None


def _coupled_metrics(model, y, y_pred, sample_weight, sizes):
    compile_metrics = getattr(model, "_compile_metrics", None)
    if compile_metrics is None:
        return []
    flat_true, flat_pred = tree.flatten(y), tree.flatten(y_pred)
    if len(flat_true) != len(flat_pred):
        return []
    found = []
    for lists, weighted in (
        (getattr(compile_metrics, "_flat_metrics", None) or [], False),
        (getattr(compile_metrics, "_flat_weighted_metrics", None) or [], True),
    ):
        for metrics_list, y_t, y_p in zip(lists, flat_true, flat_pred):
            for metric in getattr(metrics_list, "metrics", None) or []:
                weights = sample_weight if weighted and not tree.is_nested(sample_weight) else None
                difference = _metric_difference(metric, y_t, y_p, weights, sizes)
                if difference is not None:
                    found.append(Coupled("metric", metric.name, metric, difference))
    return found


def _metric_difference(metric, y_true, y_pred, sample_weight, sizes):
    if getattr(type(metric), ON_GLOBAL_BATCH, False):
        return None
    if isinstance(metric, keras.metrics.MeanMetricWrapper):

        def values_of(t, p):
            return metric._fn(t, p, **metric._fn_kwargs)

        try:
            if np.ndim(values_of(y_true[:1], y_pred[:1])) == 0:
                return None  # One number per batch: computed on the global batch already (`batch_metrics`).
        except Exception:  # noqa: BLE001
            return None
        return _difference(values_of, y_true, y_pred, sizes)
    if type(metric).__module__.startswith("keras.") or not all(
        getattr(v, "aggregation", "sum") in _COMBINED_BY for v in metric.variables
    ):
        return None
    return _summed_state_difference(metric, y_true, y_pred, sample_weight, sizes)


# How the replicas' states of a metric variable make the value it is read as, by the variable's
# aggregation (a sync-on-read variable, as Keras creates metric state under a strategy).
_COMBINED_BY = {
    "sum": lambda states: sum(states),
    "mean": lambda states: sum(states) / len(states),
    "only_first_replica": lambda states: states[0],
}


def _summed_state_difference(metric, y_true, y_pred, sample_weight, sizes):
    """A metric class of one's own: its result from the parts' combined state against the whole batch's.

    The parts' states combine as the replicas' do when the metric is read:
    summed, averaged or the first's, by each variable's aggregation
    (`_COMBINED_BY`; a running maximum kept with `aggregation="mean"` averages
    the replicas' maxima, 5.9e-2 off in a probe, unwarned before).

    Checked on the replicas' split and, where that is even, on one that is
    not (one example moved from the last part to the first, as a last batch
    splits): a state that adds up one number per batch (`total += mean(x)`,
    `count += 1`) sums the replicas' means, one device's only on even parts
    (a new-user probe: 8.6e-3 off, unwarned, when the first batch split evenly).
    """
    differences = [_summed_state_difference_on(metric, y_true, y_pred, sample_weight, sizes)]
    if len(set(sizes)) == 1 and sizes[-1] > 1:
        uneven = [sizes[0] + 1, *sizes[1:-1], sizes[-1] - 1]
        differences.append(_summed_state_difference_on(metric, y_true, y_pred, sample_weight, uneven))
    found = [d for d in differences if d is not None]
    return max(found) if found else None


def _summed_state_difference_on(metric, y_true, y_pred, sample_weight, sizes):
    try:
        variables = list(metric.variables)
        with keras.StatelessScope(state_mapping=[(v, v.value) for v in variables]) as scope:
            metric.reset_state()
        initial = [scope.get_current_value(v) if scope.get_current_value(v) is not None else v.value for v in variables]
        whole = metric.stateless_update_state(initial, y_true, y_pred, sample_weight=sample_weight)
        weights = _parts(sample_weight, sizes) if sample_weight is not None else [None] * len(_parts(y_true, sizes))
        states = [
            metric.stateless_update_state(initial, t, p, sample_weight=w)
            for t, p, w in zip(_parts(y_true, sizes), _parts(y_pred, sizes), weights)
        ]
        states += [initial] * (len(sizes) - len(states))  # Replicas without examples keep the initial state.
        combined = [
            _COMBINED_BY[getattr(v, "aggregation", "sum")]([s[i] for s in states]) for i, v in enumerate(variables)
        ]
        expected, got = _result_of(metric, variables, whole), _result_of(metric, variables, combined)
    except Exception:  # noqa: BLE001
        return None
    if got.shape != expected.shape:
        return float("inf")
    return _relative_excess(got, expected)


def _result_of(metric, variables, state):
    """`metric.result()` from `state` as one float64 vector (read inside the scope: a result may be a variable)."""
    with keras.StatelessScope(state_mapping=list(zip(variables, state))):
        results = [np.ravel(np.asarray(ops.convert_to_tensor(r), "float64")) for r in tree.flatten(metric.result())]
    return np.concatenate(results) if results else np.zeros([0])
