"""The comparison of the two runs: every variable's largest difference, what is over tolerance."""

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The numbers of both runs and what differs beyond `atol + rtol * |one device|`.

    Attributes:
        compared: List of `(path, keras.Variable)`, in report order.
        initial: Dict path -> NumPy array, each variable before training.
        reference: Dict path -> NumPy array after the one-device steps.
        got: Dict path -> NumPy array after the steps under the strategy.
        reference_logs: List of dicts (log name -> float), one per step, on one device.
        logs: The same under the strategy.
        atol: Float.
        rtol: Float.
        over: List of paths over tolerance, worst first.
        logs_over: List of `"step N: name"` over tolerance (or logged in one run only).
    """

    compared: list
    initial: dict
    reference: dict
    got: dict
    reference_logs: list
    logs: list
    atol: float
    rtol: float
    over: list
    logs_over: list

    @property
    def passed(self):
        return not self.over and not self.logs_over

    def differences(self):
        """Dict path -> Python float `max |got - reference|` (both NaN counts as equal, one NaN as inf)."""
        return {path: max_difference(self.got[path], self.reference[path]) for path, _ in self.compared}


def compare(compared, initial, reference, got, reference_logs, logs, atol, rtol):
    """Returns the `Comparison` of the two runs."""
    over = [path for path, _ in compared if excess(got[path], reference[path], atol, rtol) > 0]
    over.sort(key=lambda p: -excess(got[p], reference[p], atol, rtol))
    return Comparison(
        compared=compared,
        initial=initial,
        reference=reference,
        got=got,
        reference_logs=reference_logs,
        logs=logs,
        atol=atol,
        rtol=rtol,
        over=over,
        logs_over=_logs_over_tolerance(reference_logs, logs, atol, rtol),
    )


def max_difference(got, expected):
    if got.size == 0:
        return 0.0
    a, b = got.astype("float64"), expected.astype("float64")
    diff = np.where(np.isnan(a) & np.isnan(b), 0.0, np.abs(a - b))
    return float(np.max(np.where(np.isnan(diff), np.inf, diff)))


def excess(got, expected, atol, rtol):
    """Largest `|got - expected| - (atol + rtol * |expected|)` (inf for a NaN on one side or other shapes)."""
    if got.shape != expected.shape:
        return math.inf
    if got.size == 0:
        return -math.inf
    a, b = got.astype("float64"), expected.astype("float64")
    over = np.abs(a - b) - (atol + rtol * np.abs(b))
    over = np.where(np.isnan(a) & np.isnan(b), -np.inf, over)
    return float(np.max(np.where(np.isnan(over), np.inf, over)))


def within(got, expected, atol, rtol):
    """Whether two floats (or arrays) agree within `atol + rtol * |expected|`."""
    return excess(np.array(got), np.array(expected), atol, rtol) <= 0


def _logs_over_tolerance(reference_logs, logs, atol, rtol):
    over = []
    if len(reference_logs) != len(logs):
        over.append(f"steps logged: {len(reference_logs)} on one device, {len(logs)} under the strategy")
    for step, (expected, got) in enumerate(zip(reference_logs, logs), 1):
        for name in sorted(set(expected) | set(got)):
            if name not in expected or name not in got:
                over.append(f"step {step}: {name} (logged in one run only)")
            elif not within(got[name], expected[name], atol, rtol):
                over.append(f"step {step}: {name}")
    return over
