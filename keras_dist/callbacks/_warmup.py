"""`LearningRateWarmup`: gradual warm-up to the learning rate scaled for the global batch."""

import math
from typing import Any, cast

import keras

from keras_dist._runtime import keras_internals


class LearningRateWarmup(keras.callbacks.Callback):
    """Raises the learning rate linearly, every step, to the rate scaled for the global batch.

    The linear scaling rule and gradual warm-up of Goyal et al., 2017,
    "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (sections 2.1
    and 2.2): when the batch grows k times, multiply the learning rate by k,
    and reach that rate gradually, starting from the unscaled rate, over the
    first epochs. As in Horovod's `LearningRateWarmupCallback`, the rate
    after warm-up is left alone, so a schedule callback placed after this one
    (e.g. `ReduceLROnPlateau`) takes over from it.

    Args:
        warmup_epochs: Number (int or float) of epochs to warm up over. Needs
            a known number of steps per epoch (`fit` with arrays, a dataset
            of known size, or `steps_per_epoch`).
        warmup_steps: Integer number of training steps (batches; micro-batches
            under gradient accumulation) to warm up over, instead of
            `warmup_epochs`.
        base_batch_size: Integer, the batch size (examples) the compiled
            learning rate was tuned for. The target rate is
            `compiled_rate * global_batch_size / base_batch_size`. Default:
            the per-replica batch, i.e. k = `num_replicas_in_sync`, the rule
            Horovod applies per worker.
        target_learning_rate: Float, the rate to reach, instead of the linear
            scaling rule (then `base_batch_size` is not used and warm-up
            starts from the compiled rate).
        verbose: 0 or 1; 1 prints the start and target rates on the chief.

    Raises:
        ValueError: At construction, when neither or both of `warmup_epochs`
            and `warmup_steps` are given, or one is not > 0; at
            `on_train_begin`, when the optimizer's learning rate is a
            `LearningRateSchedule` (not settable), or when `warmup_epochs` is
            used and the number of steps per epoch is unknown.

    Distributed behavior:
        Every worker computes the same rate from the same step count; the
        global batch size comes from `model.input_plan` (set by
        `DistributedModel.fit`), else from `batch_size` in `fit`'s params.
    """

    def __init__(
        self,
        warmup_epochs: float | None = None,
        warmup_steps: int | None = None,
        *,
        base_batch_size: int | None = None,
        target_learning_rate: float | None = None,
        verbose: int = 0,
    ) -> None:
        super().__init__()
        if (warmup_epochs is None) == (warmup_steps is None):
            raise ValueError(
                "LearningRateWarmup needs exactly one of `warmup_epochs` and `warmup_steps`. "
                f"Received: warmup_epochs={warmup_epochs!r}, warmup_steps={warmup_steps!r}. "
                "Fix: e.g. LearningRateWarmup(warmup_epochs=5)."
            )
        length = warmup_epochs if warmup_epochs is not None else warmup_steps
        if not isinstance(length, (int, float)) or isinstance(length, bool) or not length > 0:
            raise ValueError(f"The warm-up length must be a number > 0. Received: {length!r}. Fix: pass e.g. 5.")
        if base_batch_size is not None and (not isinstance(base_batch_size, int) or base_batch_size < 1):
            raise ValueError(
                f"`base_batch_size` must be an integer number of examples >= 1. Received: {base_batch_size!r}."
            )
        self.warmup_epochs = warmup_epochs
        self.warmup_steps = warmup_steps
        self.base_batch_size = base_batch_size
        self.target_learning_rate = target_learning_rate
        self.verbose = verbose
        self.start_learning_rate: float | None = None
        self.target: float | None = None
        self._total_steps: int | None = None

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        optimizer = self.model.optimizer
        if keras_internals.uses_learning_rate_schedule(optimizer):
            raise ValueError(
                "LearningRateWarmup sets the optimizer's learning rate each step, which a "
                "LearningRateSchedule does not allow. Received: a schedule. Fix: compile with a float "
                "learning rate, or build the warm-up into your schedule (keras.optimizers.schedules.CosineDecay "
                "has `warmup_steps`)."
            )
        if self.warmup_steps is not None:
            self._total_steps = int(self.warmup_steps)
        else:
            steps_per_epoch = (self.params or {}).get("steps")
            if not steps_per_epoch:
                raise ValueError(
                    "LearningRateWarmup(warmup_epochs=...) needs the number of steps per epoch, which this "
                    "input does not give. Received: steps=None. Fix: pass `steps_per_epoch` to fit, or use "
                    "`warmup_steps`."
                )
            self._total_steps = max(1, int(math.ceil(self.warmup_epochs * steps_per_epoch)))
        # Steps count from the optimizer's own counter, so a run restored by BackupAndRestore in the
        # middle of the warm-up continues it: the current rate is then the one set for the last step
        # taken (step - 1), from which the compiled rate is recovered.
        step = _optimizer_step(self.model)
        current = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        if step >= self._total_steps:
            self.start_learning_rate = None  # Warm-up already done: the rate is left alone.
            return
        fraction = max(0, step - 1) / self._total_steps
        if self.target_learning_rate is not None:
            self.target = float(self.target_learning_rate)
            self.start_learning_rate = (current - self.target * fraction) / (1.0 - fraction)
        else:
            scale = self._batch_scale()
            self.start_learning_rate = current / (1.0 + (scale - 1.0) * fraction)
            self.target = self.start_learning_rate * scale
        if self.verbose and _is_chief(self.model):
            print(
                f"LearningRateWarmup: {self.start_learning_rate:g} -> {self.target:g} over "
                f"{self._total_steps} steps (from step {step})",
                flush=True,
            )

    def _batch_scale(self):
        plan = getattr(self.model, "input_plan", None)
        global_batch = getattr(plan, "global_batch_size", None) if getattr(plan, "usage", None) == "fit" else None
        if global_batch is None:
            global_batch = (self.params or {}).get("batch_size")
        replicas = getattr(getattr(self.model, "distribute_strategy", None), "num_replicas_in_sync", 1)
        if self.base_batch_size is None:
            return float(replicas)
        if global_batch is None:
            raise ValueError(
                "LearningRateWarmup(base_batch_size=...) needs the global batch size, which this input does "
                "not give. Fix: pass `target_learning_rate` instead."
            )
        return global_batch / self.base_batch_size

    def learning_rate_at(self, step: int) -> float:
        """Returns the rate (float) for optimizer step `step` (0-based `optimizer.iterations`)."""
        start, target = cast(float, self.start_learning_rate), cast(float, self.target)  # set by on_train_begin
        fraction = min(1.0, step / cast(int, self._total_steps))
        return start + (target - start) * fraction

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.start_learning_rate is None:
            return
        step = _optimizer_step(self.model)
        if step < self._total_steps:
            self.model.optimizer.learning_rate = self.learning_rate_at(step)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        # The warm-up ends on the target rate, set once, right after its last step: a scheduler
        # placed after this callback (on_epoch_begin) takes over from there.
        if self.start_learning_rate is not None and _optimizer_step(self.model) == self._total_steps:
            self.model.optimizer.learning_rate = self.target

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["learning_rate"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


def _optimizer_step(model):
    """Training steps taken: the optimizer's raw counter (micro-batches under gradient accumulation)."""
    return int(keras.ops.convert_to_numpy(keras_internals.raw_iterations(model.optimizer)))


def _is_chief(model):
    from keras_dist.strategy import _plan

    return _plan.is_chief(getattr(model, "distribute_strategy", None))
