"""Why the two runs of `verify` differ: evidence from the numbers first, then the model's make-up.

Each check looks at one cause and returns its explanation (what was seen, why
it differs, how to fix it) or `None`; `diagnose` runs them in order and the
first that speaks is the likely cause, the others are also possible. Evidence
from the numbers (a loss off by the number of replicas at the first step,
weights that moved N times as far, weights equal but logs not, logs equal but
trainable weights not) comes before what the model contains (BatchNormalization
without `synchronized=True`, random layers, code written for global-batch
scaling), and oneDNN only when the differences are small.
"""

import contextlib
import dataclasses
import inspect
import math
import os
import re

import keras
import numpy as np

from keras_dist._model import DistributedModel, coupling
from keras_dist._runtime import batch_coupling, devices
from keras_dist._runtime import keras_internals as ki
from keras_dist._verify import compare, runs

# In a step of one's own: a loss scaled for the global batch (TensorFlow's guide), or random draws.
_GLOBAL_SCALING = re.compile(r"compute_average_loss|global_batch|GLOBAL_BATCH|num_replicas_in_sync")
_RANDOM_DRAWS = re.compile(r"\b(?:keras\.random|tf\.random|random)\.\w+\(")


@dataclasses.dataclass(frozen=True)
class _Evidence:
    comparison: compare.Comparison
    num_replicas: int
    global_batch_size: int
    random_layers: str
    device: str
    first_ref: dict
    first_got: dict
    first_logs_agree: bool
    loss_ratio: float | None
    update_ratio: float | None
    trainable_over: list
    step_source: str
    coupled: tuple = ()

    @property
    def share(self):
        """The examples of one replica's share of the first global batch, e.g. `"8"` or `"5-6"`."""
        low, high = self.global_batch_size // self.num_replicas, -(-self.global_batch_size // self.num_replicas)
        return f"{low}" if low == high else f"{low}-{high}"

    def first_step_losses(self):
        """`" (step 1's loss: ...)"` when step 1's logs differ, else `""`."""
        if self.first_logs_agree or "loss" not in self.first_ref or "loss" not in self.first_got:
            return ""
        return (
            f" (step 1's loss: {self.first_got['loss']:.6g} under the strategy, "
            f"{self.first_ref['loss']:.6g} on one device)"
        )


def diagnose(model, strategy, comparison, *, global_batch_size, random_layers, device, first_batch=None):
    """Returns `(likely cause, explanation, other causes)`; the causes are keys of `report.CAUSES`.

    `first_batch`: the first global batch as `fit` yields it, or `None` (then
    no loss is checked for coupling the batch's examples).
    """
    evidence = _evidence(model, strategy, comparison, global_batch_size, random_layers, device, first_batch)
    found = {}
    for cause, check in _CHECKS:
        if cause not in found:
            explanation = check(model, evidence)
            if explanation:
                found[cause] = explanation
    if not found:
        c = comparison
        worst = c.over[0] if c.over else (c.logs_over[0] if c.logs_over else "")
        found["unknown"] = (
            f"None of the known causes fits (worst: {worst}). Look for state a layer or step updates outside "
            "Keras variables, a custom layer that reduces over the batch (each replica sees only its share), "
            "or Python-side randomness; compare `model.predict` on one batch under both to see whether the "
            "forward pass already differs."
        )
    causes = list(found)
    return causes[0], found[causes[0]], tuple(causes[1:])


def _evidence(model, strategy, c, global_batch_size, random_layers, device, first_batch=None):
    first_ref, first_got = (c.reference_logs[0] if c.reference_logs else {}), (c.logs[0] if c.logs else {})
    loss_ratio = None
    if "loss" in first_ref and "loss" in first_got and first_ref["loss"]:
        loss_ratio = first_got["loss"] / first_ref["loss"]
    trainable = {id(v) for v in model.trainable_weights}
    paths = [p for p, v in c.compared if id(v) in trainable]
    moved_ref = math.sqrt(sum(float(np.sum((c.reference[p] - c.initial[p]) ** 2.0)) for p in paths))
    moved_got = math.sqrt(sum(float(np.sum((c.got[p] - c.initial[p]) ** 2.0)) for p in paths))
    return _Evidence(
        comparison=c,
        num_replicas=int(strategy.num_replicas_in_sync),
        global_batch_size=global_batch_size,
        random_layers=random_layers,
        device=device,
        first_ref=first_ref,
        first_got=first_got,
        first_logs_agree=all(
            name in first_got and compare.within(first_got[name], first_ref[name], c.atol, c.rtol) for name in first_ref
        ),
        loss_ratio=loss_ratio,
        update_ratio=moved_got / moved_ref if moved_ref else None,
        trainable_over=[p for p in c.over if p in paths],
        step_source=_own_step_source(model),
        coupled=_coupled(model, strategy, first_batch),
    )


def _near(ratio, target):
    return ratio is not None and abs(ratio / target - 1.0) < 0.05


def _off_by_replicas(ratio, num_replicas):
    return num_replicas > 1 and (_near(ratio, 1.0 / num_replicas) or _near(ratio, float(num_replicas)))


# ------------------------------------------------------------------ evidence from the numbers


def _coupled(model, strategy, first_batch):
    """The compiled losses and metrics that couple the examples of `first_batch` (`batch_coupling`), or `()`."""
    if first_batch is None or strategy.num_replicas_in_sync == 1 or _own_step_source(model):
        return ()
    try:
        batch = ki.unpack_x_y_sample_weight(first_batch)
        found = batch_coupling.find_coupled(model, batch, strategy.num_replicas_in_sync)
        # An added sum over the batch is counted as one from the first `fit` on (`coupling.check_once`): no cause.
        return tuple(c for c in found if not (c.kind == "added loss" and c.summed))
    except Exception:  # noqa: BLE001  (no evidence, then)
        return ()


def _batch_coupled_loss(model, e):
    """A compiled loss that couples the batch's examples (first: it changes the weights)."""
    if not any(c.kind in ("loss", "added loss") for c in e.coupled):
        return None
    return _batch_coupled(model, e)


def _batch_coupled(model, e):
    """A compiled loss or metric that couples the batch's examples (a metric: after `_batch_level_metric`)."""
    if not e.coupled:
        return None
    named = ", ".join(f"the {c.kind} {c.name!r}" for c in e.coupled)
    fixes = "; ".join(coupling.fix(c) for c in e.coupled)
    return (
        f"On the first global batch of {e.global_batch_size}, {named} gives other values on each replica's share "
        f"({e.share} examples) than on the whole batch: it couples the examples of a batch (an in-batch softmax, "
        "a contrastive, triplet or batch-wide loss), and each replica computes it on its share only"
        f"{e.first_step_losses()}. Fix: {fixes}: computed on the all-gathered global batch, counted once "
        "(docs/global_batch_losses.md)."
    )


def _global_batch_loss_in_numbers(model, e):
    if not _off_by_replicas(e.loss_ratio, e.num_replicas):
        return None
    seen = (
        f"Step 1's loss is {e.first_got['loss']:.6g} under the strategy and {e.first_ref['loss']:.6g} on one "
        f"device: {e.loss_ratio:.4g} times, off by the {e.num_replicas} replicas."
    )
    if model.custom_step_losses == "global" and not e.comparison.over:
        return (
            f"{seen} The weights match (`custom_step_losses = 'global'` sums the gradients as they are), but "
            "the step logs its loss scaled for the global batch: on each replica that is the replica's part "
            "of the loss, and the tracker averages the parts. Fix: log the mean over the step's own examples "
            "(e.g. `self.loss_tracker.update_state(ops.mean(per_example_loss))`)."
        )
    return (
        f"{seen} The loss is written for global-batch scaling (`tf.nn.compute_average_loss(..., "
        "global_batch_size=...)`, or a division by the global batch size), while keras-dist counts each "
        "replica's loss as the mean over that replica's own examples (`model.custom_step_losses == "
        "'mean'`): loss and gradients are scaled twice. Fix: write the loss as the mean over the examples "
        "the step sees (`ops.mean`, `self.compute_loss`), as keras.io does; or keep it, set "
        "`model.custom_step_losses = 'global'` (keras-dist then sums the gradients as they are) and log "
        "the mean over the step's own examples (a `Mean` tracker of the scaled loss averages the "
        "replicas' parts)."
    )


def _gradient_scale(model, e):
    if not (e.first_logs_agree and _off_by_replicas(e.update_ratio, e.num_replicas)):
        return None
    return (
        f"Step 1's logs agree (the forward pass is the same), but the weights moved {e.update_ratio:.4g} times "
        f"as far as on one device, about the {e.num_replicas} replicas: the gradients are scaled by the number "
        "of replicas. Typical: a `train_step` that multiplies or divides its loss or gradients by "
        "`num_replicas_in_sync`, or sums the gradients over the replicas itself before `apply_gradients` "
        "(keras-dist's optimizer already sums them). Fix: drop that scaling."
    )


def _batch_level_metric(model, e):
    c = e.comparison
    if c.over or not c.logs_over:
        return None
    names = sorted({entry.split(": ", 1)[1] for entry in c.logs_over if ": " in entry})
    return (
        f"The weights match, but the logged {names} differ: these values are computed from each replica's "
        f"share of the batch ({e.share} examples) and then combined, not from the global batch of "
        f"{e.global_batch_size}: a value a `train_step` returns directly, or a metric whose `update_state` "
        "overwrites its state instead of accumulating it (its state is summed over the replicas). Fix: log it "
        "with a `keras.metrics.Metric` that accumulates (e.g. `keras.metrics.Mean`, or a metric function in "
        "`compile(metrics=...)`) and return its `result()`."
    )


def _zero_gradient_noise(model, e):
    adaptive = [type(o).__name__ for o in runs.optimizers(model) if not isinstance(o, keras.optimizers.SGD)]
    if e.comparison.logs_over or not e.trainable_over or not adaptive:
        return None
    return (
        f"Every logged value agrees at every step, yet the trainable variables {e.trainable_over} differ: they "
        "barely change the loss, so their gradient is about zero (e.g. the bias of a layer followed by "
        "BatchNormalization, which subtracts it again) and consists of float rounding, which differs between "
        "one device and the replicas' shares. Adam-like optimizers divide by the gradient's own size, so that "
        f"noise moves them by full learning-rate steps in random directions ({', '.join(adaptive)}). State "
        "computed from them (a moving mean) follows. Harmless for the model's outputs. Fix: `use_bias=False` "
        "on a layer followed by BatchNormalization, or leave it."
    )


# ------------------------------------------------------------------ what the model contains


def _unsynchronized_batch_normalization(model, e):
    norms = [
        layer.name
        for layer in model._flatten_layers(include_self=False)
        if isinstance(layer, keras.layers.BatchNormalization)
        and not getattr(layer, "synchronized", False)
        and layer.trainable
    ]
    if e.num_replicas == 1 or not norms:
        return None
    return (
        f"BatchNormalization layers {norms} normalize each replica's share ({e.share} examples) of the "
        f"global batch of {e.global_batch_size} with that share's own mean and variance; one device uses the "
        f"whole batch's{e.first_step_losses()}. Fix: `BatchNormalization(synchronized=True)` computes the "
        "statistics over all replicas (one all-reduce per layer and step); or keep it: per-replica statistics "
        "are the usual choice in data-parallel training, not a bug."
    )


def _random_layers(model, e):
    layers = []
    for layer in model._flatten_layers(include_self=False):
        switchable = next((attribute for cls, attribute in runs.SWITCHABLE if isinstance(layer, cls)), None)
        if switchable is not None:
            if getattr(layer, switchable, 0):
                layers.append(layer.name)
        elif any(isinstance(v, keras.random.SeedGenerator) for v in vars(layer).values()):
            layers.append(layer.name)
    draws = bool(_RANDOM_DRAWS.search(e.step_source))
    if e.num_replicas == 1 or not (layers or draws):
        return None
    what = f"the layers {layers}" if layers else ""
    what += (" and " if layers and draws else "") + ("the step's own random draws" if draws else "")
    if e.random_layers == "off":
        switch = " Those left on cannot be switched off by `verify`."
    else:
        switch = (
            " To check everything else, run `verify(..., random_layers='off')`, which switches Dropout-like "
            "layers off during the check."
        )
    return (
        f"Random numbers: {what} draw their own numbers on each replica (keras-dist gives every replica its "
        "own seed), so the examples get other masks or noise than on one device: the same distribution, other "
        f"numbers{e.first_step_losses()}. Nothing to fix in training.{switch}"
    )


def _global_batch_loss_in_code(model, e):
    if e.num_replicas == 1 or model.custom_step_losses != "mean":
        return None
    if not (_GLOBAL_SCALING.search(e.step_source) or _scaled_compiled_loss(model)):
        return None
    return (
        "The step's loss looks written for global-batch scaling (its code mentions `compute_average_loss`, a "
        "global batch size or `num_replicas_in_sync`), while keras-dist counts each replica's loss as the mean "
        "over its own examples (`model.custom_step_losses == 'mean'`). Fix: set `model.custom_step_losses = "
        "'global'`, or compute the mean over the step's own examples."
    )


def _own_step_source(model):
    """The source of the `train_step`/`compute_loss` the model's own classes define ('' if none)."""
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


# ------------------------------------------------------------------ the platform


def _onednn(model, e):
    """When the differences are small, on a CPU with oneDNN on."""
    if not devices.onednn_enabled() or "GPU" in e.device.upper() or "TPU" in e.device.upper():
        return None
    c = e.comparison
    first_loss = None
    if "loss" in e.first_ref and "loss" in e.first_got:
        first_loss = abs(e.first_got["loss"] - e.first_ref["loss"]) / max(abs(e.first_ref["loss"]), 1e-12)
    relative = max(
        (
            compare.max_difference(c.got[p], c.reference[p]) / max(float(np.max(np.abs(c.reference[p]))), 1e-12)
            for p in c.over
            if c.reference[p].size
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


_CHECKS = (
    ("batch_coupled_loss", _batch_coupled_loss),
    ("global_batch_loss", _global_batch_loss_in_numbers),
    ("gradient_scale", _gradient_scale),
    ("batch_level_metric", _batch_level_metric),
    ("batch_coupled_loss", _batch_coupled),
    ("zero_gradient_noise", _zero_gradient_noise),
    ("unsynchronized_batch_normalization", _unsynchronized_batch_normalization),
    ("random_layers", _random_layers),
    ("global_batch_loss", _global_batch_loss_in_code),
    ("onednn", _onednn),
)
