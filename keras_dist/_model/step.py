"""Which train/test step runs, and what keras-dist's own step is handed.

Under one replica, or with `example_weighted_loss` off, Keras' own step runs.
Otherwise `_runtime.steps.train_step` / `test_step` run, with the model's
`communication`, the XLA pass when `compile(jit_compile=True)` asked for one,
whether the optimizer weights each replica's gradients by its examples inside
the gradient all-reduce (`ride_along`, decided here, from the optimizer, once
per trace), the metric state that may travel with the gradients, and the
timeline's timestamps when one records this `fit`.
"""

from keras_dist import _compat
from keras_dist._model import metrics, monitoring, xla
from keras_dist._runtime import steps
from keras_dist.collectives import _optimizer as collectives_optimizer


def uses_keras_step(model):
    """Whether Keras' own step runs (one replica, or the fix off)."""
    return model._distribute_strategy.num_replicas_in_sync == 1 or not _compat.is_active("example_weighted_loss")


def train_step(model, data, *, overrides_metrics_result):
    """keras-dist's `train_step` on one per-replica batch (replica context); returns the metric results."""
    return steps.train_step(
        model,
        data,
        options=model.communication.to_tensorflow(),
        forward_backward=xla.forward_backward(model),
        ride_along=collectives_optimizer.weighs_examples_in_all_reduce(getattr(model, "optimizer", None)),
        summed_metrics=metrics.SummedMetrics(model, overrides_metrics_result=overrides_metrics_result),
        marks=monitoring.step_marks_of(model),
    )


def test_step(model, data):
    """keras-dist's `test_step` on one per-replica batch (replica context); returns the metric results."""
    return steps.test_step(model, data, options=model.communication.to_tensorflow())
