"""Layer 1: `global_batch(loss_or_metric)`, a compiled loss or metric computed on the whole global batch.

A loss that couples the examples of a batch (an in-batch softmax retrieval
loss, a contrastive or triplet loss, a Dice over the batch) sees only each
replica's part of the batch under data parallelism: another value, other
gradients. Wrapped, it is computed on the global batch on every replica
(`y_true`, `y_pred`, sample weights and the Keras mask all-gathered, the
gradient back to each replica's own part), and keras-dist counts it once:
one device's loss, gradients, logs and `evaluate`. On one device, or without
a strategy, the wrapper is the loss or metric itself. The work is in
`_runtime/global_batch.py`; the docs page is docs/global_batch_losses.md.
"""

from __future__ import annotations

from typing import Any

import keras

from keras_dist._runtime import batch_coupling as _batch_coupling
from keras_dist._runtime import global_batch as _runtime
from keras_dist._runtime import keras_internals as _ki

__all__ = ["GlobalBatchLoss", "GlobalBatchMetric", "global_batch"]


def global_batch(loss_or_metric: Any) -> GlobalBatchLoss | GlobalBatchMetric:
    """Returns `loss_or_metric` computed on the global batch under a strategy; itself on one device.

    Pass the result to `compile(loss=...)` (or in `metrics=[...]`) where the
    loss or metric couples the examples of a batch, e.g. an in-batch softmax
    retrieval loss (`logits = q @ c^T`, the labels `arange(batch)`), a
    contrastive, triplet or Dice loss:

    ```python
    model.compile(optimizer="adam", loss=keras_dist.global_batch(in_batch_softmax),
                  metrics=[keras_dist.global_batch(keras.metrics.MeanMetricWrapper(in_batch_top1))])
    ```

    Each replica then computes it on the whole global batch: its `y_true`,
    `y_pred`, `sample_weight` and Keras mask are all-gathered over the
    replicas in global order (uneven and empty parts included), the gradient
    reaches each replica's own part of `y_pred`, and keras-dist counts the
    loss once (its value is the same on every replica): the weights, the
    logged `loss` and `evaluate` are one device's, in keras-dist's own
    `train_step`/`test_step` and in a `train_step` of one's own that calls
    `self.compute_loss`. A per-example loss (MSE, cross-entropy) needs no
    wrapper: keras-dist already weights it exactly, without the gathers.

    Args:
        loss_or_metric: A `keras.losses.Loss` (e.g.
            `keras.losses.Dice()`), a loss function `fn(y_true, y_pred)`
            returning per-example values or one number, or a loss's string
            name: a `GlobalBatchLoss`. A `keras.metrics.Metric` (e.g.
            `keras.metrics.MeanMetricWrapper(fn)` for a function computed per
            batch): a `GlobalBatchMetric`. A `GlobalBatchLoss` in
            `metrics=[...]` is, as any loss there, the mean over batches of
            its value.

    Returns:
        `GlobalBatchLoss` (a `keras.losses.Loss`) or `GlobalBatchMetric` (a
        `keras.metrics.Metric`), with the wrapped object's name.

    Raises:
        TypeError: `loss_or_metric` is neither a loss (object, function or
            name) nor a metric.
        ValueError: A loss with `reduction=None` (per-example values of the
            global batch do not fit a replica's part of the batch).

    Distributed behavior:
        In replica context with several replicas a collective: every replica
        computes it (as every replica computes a compiled loss). Cost per
        step: each replica receives the global batch's `y_true`, `y_pred`,
        `sample_weight` and mask (`global_batch_size x` their bytes per
        example; e.g. a two-tower model's `y_pred` of two float32 embeddings
        of 64 values at a global batch of 1024: 512 KiB), and in the backward
        pass the gradient of the gathered `y_pred` (as many bytes) is summed
        over the replicas. A metric gathers its inputs again (no backward).
        Under `compile(jit_compile=True)` with several replicas it raises
        `ValueError` when traced (XLA compiles each replica alone).

    Example:
    >>> import keras, keras_dist
    >>> from keras import ops
    >>> def in_batch_softmax(y_true, y_pred):
    ...     q, c = y_pred[:, 0], y_pred[:, 1]
    ...     logits = ops.matmul(q, ops.transpose(c))
    ...     labels = ops.arange(ops.shape(q)[0])
    ...     return keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    >>> loss = keras_dist.global_batch(in_batch_softmax)
    >>> isinstance(loss, keras.losses.Loss), loss.name
    (True, 'in_batch_softmax')
    """
    if isinstance(loss_or_metric, (GlobalBatchLoss, GlobalBatchMetric)):
        return loss_or_metric
    if isinstance(loss_or_metric, keras.metrics.Metric):
        return GlobalBatchMetric(loss_or_metric)
    return GlobalBatchLoss(loss_or_metric)


def _as_loss(loss: Any) -> keras.losses.Loss:
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        return loss
    if callable(loss) and not isinstance(loss, type):
        return _ki.LossFunctionWrapper(loss, name=getattr(loss, "__name__", None))
    raise TypeError(
        "`keras_dist.global_batch` takes a loss (a `keras.losses.Loss`, a function `fn(y_true, y_pred)` or a "
        f"loss's name) or a `keras.metrics.Metric`. Received: {loss!r} of type {type(loss).__name__}. Fix: "
        "pass the loss object or function itself, e.g. `keras_dist.global_batch(keras.losses.Dice())`, or an "
        "instance of the metric class."
    )


@keras.saving.register_keras_serializable(package="keras_dist")
class GlobalBatchLoss(keras.losses.Loss):
    """A `keras.losses.Loss` computed on the global batch under a strategy (see `keras_dist.global_batch`).

    Args:
        loss: A `keras.losses.Loss`, a loss function or a loss's name.
        name: String, defaults to the loss's name.

    Raises:
        TypeError: `loss` is not a loss.
        ValueError: `loss.reduction` is `None` or `"none"`.
    """

    def __init__(self, loss: Any, name: str | None = None) -> None:
        loss = _as_loss(loss)
        if loss.reduction in (None, "none"):
            raise ValueError(
                "`keras_dist.global_batch` needs a loss that reduces the batch to one number. Received: "
                f"{loss.name!r} with reduction={loss.reduction!r}. Fix: use reduction='sum_over_batch_size' "
                "(the default), 'sum' or 'mean_with_sample_weight'."
            )
        super().__init__(name=name or loss.name, reduction=loss.reduction, dtype=loss.dtype)
        self.loss = loss

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        """The wrapped loss of the global batch's `y_true`, `y_pred` and `sample_weight` (float scalar tensor)."""
        return _runtime.loss_on_global_batch(self.loss, y_true, y_pred, sample_weight)

    def call(self, y_true: Any, y_pred: Any) -> Any:
        """The wrapped loss's unreduced values on the global batch (`(global_batch_size, ...)`, or its own shape)."""
        return _runtime.values_on_global_batch(self.loss, y_true, y_pred)

    def get_config(self) -> dict[str, Any]:
        """The wrapped loss serialized, and the name."""
        return {"loss": keras.losses.serialize(self.loss), "name": self.name}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GlobalBatchLoss:
        """Re-creates the wrapper from `get_config()`."""
        return cls(loss=keras.losses.deserialize(config["loss"]), name=config.get("name"))


@keras.saving.register_keras_serializable(package="keras_dist")
class GlobalBatchMetric(keras.metrics.Metric):
    """A `keras.metrics.Metric` updated with the global batch under a strategy (see `keras_dist.global_batch`).

    Its state is the wrapped metric's: under several replicas, replica 0's
    copy gains the global batch's update and the others none, so the state
    summed over the replicas (what keras-dist reads) holds each global batch
    once; `result()` is the wrapped metric's.

    Args:
        metric: A `keras.metrics.Metric`.
        name: String, defaults to the metric's name.

    Raises:
        TypeError: `metric` is not a `keras.metrics.Metric`.
    """

    def __init__(self, metric: keras.metrics.Metric, name: str | None = None) -> None:
        if not isinstance(metric, keras.metrics.Metric):
            raise TypeError(
                "`GlobalBatchMetric` wraps a `keras.metrics.Metric`. Received: "
                f"{metric!r} of type {type(metric).__name__}. Fix: pass an instance, e.g. "
                "`keras.metrics.MeanMetricWrapper(fn, name=...)` for a function."
            )
        super().__init__(name=name or metric.name, dtype=metric.dtype)
        self.metric = metric

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        """Updates the wrapped metric with the global batch (on replica 0 under several replicas)."""
        _runtime.update_metric_on_global_batch(self.metric, y_true, y_pred, sample_weight)

    def result(self) -> Any:
        """The wrapped metric's result."""
        return self.metric.result()

    def reset_state(self) -> None:
        """Resets the wrapped metric."""
        self.metric.reset_state()

    def get_config(self) -> dict[str, Any]:
        """The wrapped metric serialized, and the name."""
        return {"metric": keras.metrics.serialize(self.metric), "name": self.name}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GlobalBatchMetric:
        """Re-creates the wrapper from `get_config()`."""
        return cls(metric=keras.metrics.deserialize(config["metric"]), name=config.get("name"))


# Computed on the global batch already: the check for losses that couple a batch's examples leaves them alone.
setattr(GlobalBatchLoss, _batch_coupling.ON_GLOBAL_BATCH, True)
setattr(GlobalBatchMetric, _batch_coupling.ON_GLOBAL_BATCH, True)
