"""`ThroughputMonitor` and `RetracingMonitor`: what a distributed run does per second and per trace."""

import time
import warnings
from typing import Any

import keras
import numpy as np

from keras_dist import errors
from keras_dist._runtime import keras_internals

_now = time.perf_counter  # Seconds; a name of its own so that tests can substitute a clock.


class ThroughputMonitor(keras.callbacks.Callback):
    """Adds training throughput and step-time percentiles to each epoch's logs.

    Per epoch, in the logs (so `History`, `CSVLogger` and `TensorBoard` placed
    after this callback record them too):

    - `examples_per_second`: examples of all replicas per second of
      training (global batch size x steps / seconds from the first step's
      start to the last step's end; validation excluded).
    - `examples_per_second_per_replica`: the same, divided by
      `num_replicas_in_sync`.
    - `step_seconds_p50`, `step_seconds_p90`: percentiles of the time of
      one step, in seconds (each step waits for its results, so the times
      are real, not dispatch times).

    - With `flops_per_example`: `model_flops_per_second` (training FLOPs of
      the model per example x examples per second), and, when the peak of
      the accelerators is known (`peak_flops_per_second`, or a GPU listed in
      `PEAK_FLOPS` found by name), `model_flops_utilization`: that rate over
      the peak of all replicas (model FLOPs utilization, as defined by
      Chowdhery et al., 2022, "PaLM", appendix B).

    The global batch size is `global_batch_size`, else comes from
    `model.input_plan` (`DistributedModel`), else from `fit`'s `batch_size`;
    a partial last batch is counted as full. Where none says it (a dataset
    whose batch dimension is not static, e.g. from `bucket_by_length`), the
    examples/s and FLOP/s figures are left out, with one warning.
    The first `skip_steps` steps of the first epoch (tracing, warm-up) are
    left out.

    Args:
        skip_steps: Integer >= 0, steps left out at the start of training
            (default 1: the step that traces the function).
        flops_per_example: Float, floating-point operations of one training
            step per example (forward and backward; about 6 x parameters for
            dense models, PaLM's rule), or `None`.
        peak_flops_per_second: Float, peak FLOP/s of one replica's device in
            the dtype you train in, or `None` to look the GPU up in
            `PEAK_FLOPS` (no figure on CPUs).
        global_batch_size: Integer > 0, examples per step over all replicas,
            or `None` to read it from the input plan or `fit`'s `batch_size`.

    Distributed behavior:
        Runs on every worker; every worker measures its own steps, which
        are synchronous, so the figures agree to timing noise.
    """

    # Dense bf16/fp16 tensor-core peaks from the vendors' datasheets, FLOP/s per GPU.
    PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "V100": 125e12, "T4": 65e12}

    def __init__(
        self,
        skip_steps: int = 1,
        *,
        flops_per_example: float | None = None,
        peak_flops_per_second: float | None = None,
        global_batch_size: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(skip_steps, int) or skip_steps < 0:
            raise ValueError(f"`skip_steps` must be an integer >= 0. Received: {skip_steps!r}.")
        for name, value in (("flops_per_example", flops_per_example), ("peak_flops_per_second", peak_flops_per_second)):
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"`{name}` must be a number > 0 or None. Received: {value!r}.")
        if global_batch_size is not None and not (isinstance(global_batch_size, int) and global_batch_size > 0):
            raise ValueError(f"`global_batch_size` must be an integer > 0 or None. Received: {global_batch_size!r}.")
        self.skip_steps = skip_steps
        self.global_batch_size = global_batch_size
        self._warned = False
        self.flops_per_example = flops_per_example
        self.peak_flops_per_second = peak_flops_per_second
        self._seen = 0
        self._step_times: list[float] = []
        self._start: float | None = None

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._step_times = []

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._start = _now()

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        _wait_for(logs)
        self._seen += 1
        if self._seen > self.skip_steps and self._start is not None:
            # One callback batch is `steps_per_execution` steps: the time of one step is its share.
            steps_per_execution = getattr(self.model, "steps_per_execution", 1) or 1
            self._step_times.append((_now() - self._start) / steps_per_execution)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is None or not self._step_times:
            return
        times = np.array(self._step_times)  # Seconds per step.
        logs["step_seconds_p50"] = float(np.percentile(times, 50))
        logs["step_seconds_p90"] = float(np.percentile(times, 90))
        global_batch_size = self._global_batch_size()
        if not global_batch_size:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    "ThroughputMonitor: the global batch size is unknown (the dataset's batch dimension is not "
                    "static and fit got no `batch_size`), so examples/s are left out; step times are reported. "
                    "Fix: pass `ThroughputMonitor(global_batch_size=...)`.",
                    errors.KerasDistWarning,
                    stacklevel=2,
                )
            return
        replicas = getattr(getattr(self.model, "distribute_strategy", None), "num_replicas_in_sync", 1)
        # A short last execution counts as full.
        logs["examples_per_second"] = global_batch_size * len(times) / float(times.sum())
        logs["examples_per_second_per_replica"] = logs["examples_per_second"] / replicas
        if self.flops_per_example:
            logs["model_flops_per_second"] = self.flops_per_example * logs["examples_per_second"]
            peak = self.peak_flops_per_second or _gpu_peak_flops(self.PEAK_FLOPS)
            if peak:
                logs["model_flops_utilization"] = logs["model_flops_per_second"] / (peak * replicas)

    def _global_batch_size(self):
        if self.global_batch_size:
            return self.global_batch_size
        plan = getattr(self.model, "input_plan", None)
        if getattr(plan, "usage", None) == "fit" and getattr(plan, "global_batch_size", None):
            return plan.global_batch_size
        return (self.params or {}).get("batch_size") or 0


def _gpu_peak_flops(table):
    """Returns the table's peak for the first GPU whose name contains a listed model, else `None`."""
    import tensorflow as tf

    for gpu in tf.config.list_physical_devices("GPU"):
        name = tf.config.experimental.get_device_details(gpu).get("device_name", "")
        for model, peak in table.items():
            if model in name:
                return peak
    return None


def _wait_for(logs):
    """Blocks until the step that produced `logs` has finished (TensorFlow runs it asynchronously)."""
    for value in (logs or {}).values():
        keras.ops.convert_to_numpy(value)
        return


class RetracingMonitor(keras.callbacks.Callback):
    """Counts traces of the train, test and predict functions; warns when they retrace.

    Each `tf.function` trace builds a new graph for every replica (seconds,
    each time); a trace per new input shape (variable-length sequences, a
    partial last batch, Python scalars as inputs) is a retracing storm. Per
    epoch this adds `train_traces` (new traces of the train function during
    the epoch) to the logs and warns once per function whose traces keep
    growing after the first epoch, with the input signatures it was traced
    for and how to fix it.

    Args:
        max_traces_per_epoch: Integer >= 0: more new traces than this in an
            epoch after the first one warn (default 1: the partial last
            batch may cost one).

    Distributed behavior:
        Runs on every worker; warnings print on every worker that retraces.
    """

    FUNCTIONS = ("train_function", "test_function", "predict_function")

    def __init__(self, max_traces_per_epoch: int = 1) -> None:
        super().__init__()
        if not isinstance(max_traces_per_epoch, int) or max_traces_per_epoch < 0:
            raise ValueError(f"`max_traces_per_epoch` must be an integer >= 0. Received: {max_traces_per_epoch!r}.")
        self.max_traces_per_epoch = max_traces_per_epoch
        self.traces: dict[str, int] = {}
        self._at_epoch_begin: dict[str, int] = {}
        self._warned: set[str] = set()

    def tracing_count(self, name: str) -> int:
        """Returns how many times the `tf.function`s behind `model.<name>` were traced (0 before it exists).

        Keras 3 wraps its `tf.function`s in plain Python closures (the train
        and test functions); the `tf.function`s are found in the closure.
        """
        return sum(f.experimental_get_tracing_count() for f in _tf_functions_in(getattr(self.model, name, None)))

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._at_epoch_begin = {name: self.tracing_count(name) for name in self.FUNCTIONS}

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        for name in self.FUNCTIONS:
            total = self.tracing_count(name)
            new = total - self._at_epoch_begin.get(name, 0)
            self.traces[name] = total
            if name == "train_function" and logs is not None:
                logs["train_traces"] = new
            if epoch > 0 and new > self.max_traces_per_epoch and name not in self._warned:
                self._warned.add(name)
                warnings.warn(self._message(name, epoch, new), errors.KerasDistWarning, stacklevel=2)

    def _message(self, name, epoch, new):
        signatures = []
        for function in _tf_functions_in(getattr(self.model, name)):
            try:
                signatures.append(function.pretty_printed_concrete_signatures())
            except Exception:  # noqa: BLE001 (a description only)
                pass
        signatures = "\n".join(signatures) or "(not available)"
        return (
            f"model.{name} was traced {new} times in epoch {epoch} (expected: at most "
            f"{self.max_traces_per_epoch} after the first epoch). Each trace rebuilds the step for every "
            f"replica. Received input signatures:\n{signatures[:2000]}\nFix: give batches static shapes "
            "(pad variable-length inputs to a few bucket lengths, e.g. "
            "`tf.data.Dataset.bucket_by_sequence_length(..., pad_to_bucket_boundary=True)`, or pad to one "
            "length), use `drop_remainder=True` for the partial last batch, and pass tensors, not Python "
            "numbers, as inputs. See docs/callbacks.md#retracing."
        )


# The `tf.function`s behind a Keras train/test/predict function (`tests` use this name).
_tf_functions_in = keras_internals.tf_functions_behind
