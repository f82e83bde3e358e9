"""A compiled loss or metric that couples the examples of a batch: found once, on the first global batch, and named.

`fit` and `evaluate` remember where their first global batch can be taken
without side effects (`remembering_first_batch`); the first train or test
function made under several replicas runs `_runtime.batch_coupling`'s check on
it (one forward pass on the host, no collective: nothing for other workers to
wait for) and warns, once per model and on the chief, for each loss or metric
whose global-batch values the replicas' parts do not give, with the fix:
`keras_dist.global_batch`.
"""

import contextlib
import warnings

from keras_dist import errors
from keras_dist._runtime import batch_coupling, loss_terms
from keras_dist.strategy import _plan

_FIRST_BATCH = "_keras_dist_first_batch"
_CHECKED = "_keras_dist_coupling_checked"


@contextlib.contextmanager
def remembering_first_batch(model, arguments):
    """While `fit`/`evaluate` runs, `check_once` can take its first global batch (bound `arguments`)."""
    if model._distribute_strategy.num_replicas_in_sync == 1 or model.__dict__.get(_CHECKED):
        yield
        return
    x, y, sample_weight = arguments.get("x"), arguments.get("y"), arguments.get("sample_weight")
    batch_size = arguments.get("batch_size")
    previous = model.__dict__.get(_FIRST_BATCH)
    model.__dict__[_FIRST_BATCH] = lambda: batch_coupling.first_batch(x, y, sample_weight, batch_size)
    try:
        yield
    finally:
        model.__dict__[_FIRST_BATCH] = previous


def check_once(model, *, own_step):
    """Warns for each compiled loss and metric of `model` that couples a batch's examples (once per model).

    `own_step`: Boolean, keras-dist's own step runs (its `y_pred` is the
    model's output); a step of the user's is not checked.
    """
    getter = model.__dict__.get(_FIRST_BATCH)
    strategy = model._distribute_strategy
    if getter is None or model.__dict__.get(_CHECKED) or batch_coupling.is_suppressed():
        return
    model.__dict__[_CHECKED] = True
    if not own_step or any(getattr(layer, "stateful", False) for layer in model._flatten_layers()):
        return  # A stateful RNN would carry the check's batch into training.
    try:
        batch = getter()
        found = [] if batch is None else batch_coupling.find_coupled(model, batch, strategy.num_replicas_in_sync)
    except Exception:  # noqa: BLE001  (a check that cannot run says nothing; training is not its business)
        return
    for coupled in [c for c in found if c.kind == "added loss" and c.summed]:
        loss_terms.count_as_sum(*coupled.source)  # Before the step is traced: counted as the sum it is, exactly.
        found.remove(coupled)
    if not found or not _plan.is_chief(strategy):
        return
    for coupled in found:
        warnings.warn(message(coupled, strategy.num_replicas_in_sync), errors.KerasDistWarning, stacklevel=4)


def message(coupled, num_replicas):
    """The warning for one `batch_coupling.Coupled`: what was seen, why it matters, the fix."""
    difference = "other shapes" if coupled.difference == float("inf") else f"{coupled.difference:.2g}"
    if coupled.kind == "added loss":
        return (
            f"The loss that layer {coupled.name!r} adds with `add_loss` couples the examples of a batch: on the first "
            f"global batch its value differs from the {num_replicas} replicas' values on their parts, combined as "
            f"keras-dist combines them (largest relative difference: {difference}). It is a function of statistics "
            "over the batch (a mixture-of-experts load-balancing loss, `mean(p, axis=0) * mean(mask, axis=0)`), "
            "which each replica computes over its own examples only (as PyTorch DDP and tf.keras do), so training "
            f"differs from one device's. Fix: {fix(coupled)} (docs/global_batch_losses.md)."
        )
    if coupled.eager:
        return (
            f"The compiled loss {coupled.name!r} is a sum, or a ratio of sums, over the batch "
            "(`ops.sum(...)`, `sum(loss * mask) / sum(mask)`): keras-dist reads that from the traced graph of the "
            "step, and under `run_eagerly=True` there is none, so each of the "
            f"{num_replicas} replicas' values counts as a mean over its examples and training differs from one "
            f"device's (on the first global batch by {difference} relative). Fix: {fix(coupled)}."
        )
    if coupled.by_definition:
        seen = (
            f"The compiled {coupled.kind} {coupled.name!r} couples the examples of a batch: Keras computes it over "
            "the whole batch (its `axis` takes in the batch dimension, the default) or pairs the batch's examples, "
            f"so each of the {num_replicas} replicas computes another {coupled.kind} than one device does on the "
            f"global batch (on the first batch the values differ by {difference} relative; the gradients more), and "
        )
    else:
        seen = (
            f"The compiled {coupled.kind} {coupled.name!r} couples the examples of a batch: on the first global "
            f"batch its values differ from those computed on each of the {num_replicas} replicas' parts (split as "
            f"the replicas split it, or unevenly, as a last batch is; largest relative difference: {difference}), "
            f"so each replica computes another {coupled.kind} than one device "
            "does on the global batch (an in-batch softmax, contrastive, triplet or batch-wide loss sees fewer "
            "examples), and "
        )
    return seen + (
        ("training differs from one device's. " if coupled.kind == "loss" else "the logged value differs. ")
        + f"Fix: {fix(coupled)}, which computes it on the all-gathered global batch "
        "(docs/global_batch_losses.md)."
    )


def fix(coupled):
    """The line to write instead, e.g. "compile(loss=keras_dist.global_batch(in_batch_softmax))"."""
    wrapped = coupled.wrapped
    if coupled.eager:
        return "compile without `run_eagerly=True` (the default traces the step, where keras-dist reads the loss)"
    if coupled.kind == "added loss":
        return (
            "compute the batch statistics in that layer's `call` with `keras_dist.ops.batch_mean(values)` instead of "
            "`ops.mean(values, axis=0)`: the mean over the global batch on every replica"
        )
    if coupled.kind == "loss":
        what = getattr(wrapped, "__name__", None) or f"keras.losses.{type(wrapped).__name__}(...)"
        return f"compile(loss=keras_dist.global_batch({what}))"
    fn = getattr(wrapped, "_fn", None)
    if fn is not None and type(wrapped).__name__ == "MeanMetricWrapper":
        name = getattr(fn, "__name__", "fn")
        what = f"keras.metrics.MeanMetricWrapper({name}, name={coupled.name!r})"
    else:
        what = f"{type(wrapped).__name__}(...)"
    return f"compile(metrics=[keras_dist.global_batch({what})])"
