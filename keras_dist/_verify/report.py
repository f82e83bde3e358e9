"""`VerifyReport`: what `keras_dist.verify` compared, its verdict, the likely cause; and its text form."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import ClassVar

# What `VerifyReport.likely_cause` can be, with what each means.
CAUSES = {
    "batch_coupled_loss": "a compiled loss or metric couples the examples of a batch: each replica computes it on its part",
    "unsynchronized_batch_normalization": "BatchNormalization normalizes each replica's share with that share's statistics",
    "random_layers": "Dropout and other random layers draw other numbers on each replica than on one device",
    "global_batch_loss": "a loss written for global-batch scaling, counted again as a per-replica mean",
    "gradient_scale": "the gradients are scaled by the number of replicas",
    "batch_level_metric": "a logged value computed per replica's share of the batch, not from the global batch",
    "zero_gradient_noise": "a variable whose gradient is about zero: Adam-like optimizers scale rounding noise up to full steps",
    "onednn": "oneDNN's CPU kernels round differently at different batch sizes",
    "unknown": "none of the known causes fits",
}


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What `keras_dist.verify` trained and compared, its verdict and the likely cause of a difference.

    Passed means: every element of every compared variable, and every value
    `fit` logged at every step, satisfies
    `|under the strategy - on one device| <= atol + rtol * |on one device|`.
    `str(report)` is a table: the setting, the worst variables, every step's
    logs side by side, and the likely cause with its explanation.

    Attributes:
        passed: Boolean verdict (the same on every worker).
        atol: Float, the absolute tolerance used.
        rtol: Float, the relative tolerance used.
        weight_differences: Dict, variable path -> Python float
            `max |difference|` over its elements after the last step: the
            model's weights (trainable and not), then the optimizers'
            variables (iterations, learning rate, slots), in that order.
        shapes: Dict, variable path -> shape tuple.
        over_tolerance: Tuple of the paths of variables over tolerance, worst first.
        reference_logs: Tuple with one dict per step, log name ->
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
        strategy: String, the model's strategy (its class name).
        num_replicas: Integer, `num_replicas_in_sync`.
        num_workers: Integer, workers of the strategy.
        reference_device: String, the device the reference trained on.
        global_batch_sizes: Tuple of integers, examples in each global batch.
        random_layers: `"keep"` or `"off"`, as passed to `verify`.
        seconds: Float, wall time `verify` took on this worker.
        CAUSES: Class attribute, read-only mapping of every cause's key to
            what it means.
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
        return "\n".join([*_header(self), *_variables_table(self), *_logs_table(self), *_verdict(self)])


def _header(report):
    replicas = f"{report.num_replicas} replica{'s' if report.num_replicas != 1 else ''}"
    if report.num_workers > 1:
        replicas += f" on {report.num_workers} workers"
    batches = ", ".join(str(b) for b in report.global_batch_sizes)
    return [
        f"keras_dist.verify: {'PASSED' if report.passed else 'DIFFERS'}",
        f"  under the strategy: {report.strategy}, {replicas}",
        f"  reference:          one device, {report.reference_device}",
        f"  trained:            {len(report.global_batch_sizes)} steps, global batches of {batches} examples"
        + (", random layers off" if report.random_layers == "off" else ""),
        f"  tolerance:          |strategy - one device| <= atol + rtol * |one device|, atol={report.atol:g}, "
        f"rtol={report.rtol:g}, every element of every variable and every logged value",
        f"  variables:          {len(report.weight_differences)} compared, {len(report.over_tolerance)} over "
        f"tolerance; largest max |diff| {report.max_weight_difference:.3g}",
    ]


def _variables_table(report, shown=8):
    worst = sorted(report.weight_differences.items(), key=lambda item: -item[1])[:shown]
    if not worst:
        return []
    width = max(len("variable"), *(len(path) for path, _ in worst))
    lines = ["", f"  {'variable':<{width}}  {'shape':<14}  max |diff|  within"]
    for path, diff in worst:
        mark = "no" if path in report.over_tolerance else "yes"
        lines.append(f"  {path:<{width}}  {str(report.shapes.get(path, ())):<14}  {diff:<10.3g}  {mark}")
    if len(report.weight_differences) > len(worst):
        lines.append(f"  ... {len(report.weight_differences) - len(worst)} more, each smaller")
    return lines


def _logs_table(report):
    names = sorted({name for step in (*report.reference_logs, *report.logs) for name in step})
    if not names:
        return []
    width = max(len("log"), *(len(n) for n in names))
    lines = ["", f"  step  {'log':<{width}}  {'one device':>13}  {'strategy':>13}  {'|diff|':>9}"]
    for step, (expected, got) in enumerate(zip(report.reference_logs, report.logs), 1):
        for name in names:
            a, b = expected.get(name), got.get(name)
            diff = "" if a is None or b is None else f"{abs(a - b):9.2g}"
            lines.append(f"  {step:<4}  {name:<{width}}  {_number(a):>13}  {_number(b):>13}  {diff:>9}")
    return lines


def _verdict(report):
    if report.passed:
        return ["", "  likely cause: none (the runs agree within tolerance)"]
    lines = ["", f"  likely cause: {report.likely_cause} ({CAUSES[report.likely_cause or 'unknown']})"]
    lines += [f"  {line}" for line in _wrap(report.explanation or "", 100)]
    if report.other_causes:
        lines.append(f"  also possible: {', '.join(report.other_causes)}")
    if report.logs_over_tolerance:
        shown = report.logs_over_tolerance[:6]
        more = len(report.logs_over_tolerance) - len(shown)
        lines.append(f"  logs over tolerance: {', '.join(shown)}" + (f" (+{more} more)" if more > 0 else ""))
    return lines


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
