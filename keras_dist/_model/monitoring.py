"""The hooks that record what this worker is doing (`keras_dist.monitor`), around Keras' own loop.

Owns: the phase of each `fit`/`evaluate`/`predict` call, of each call of the
step functions Keras makes (`tracked_function`), and of each hook of each
callback (`tracking_callbacks`, patched on the callback instances for the
duration of one call and then removed). The agreement all-reduce and the
chief's writes record their own phases (keras_dist.callbacks._coordination).
Under several workers the first call starts the stall watchdog
(`keras_dist.monitor._stall`).

Cost on the training path: a few attribute writes per step and per callback hook.
"""

import contextlib
import functools
import time

import keras

from keras_dist._runtime import variables
from keras_dist.monitor import _stall
from keras_dist.monitor._progress import PROGRESS
from keras_dist.strategy import _cluster

_HOOKS = (
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_test_begin",
    "on_test_end",
    "on_test_batch_begin",
    "on_test_batch_end",
    "on_predict_begin",
    "on_predict_end",
    "on_predict_batch_begin",
    "on_predict_batch_end",
)
_STEP_KINDS = {"train": "step", "test": "test_step", "predict": "predict_step"}
_TRACKED = "_keras_dist_tracked"


@contextlib.contextmanager
def tracking_call(model, kind):
    """Records `kind` (`"fit"`, `"evaluate"` or `"predict"`) as this worker's phase for the call's duration."""
    if variables.is_multi_worker(model._distribute_strategy):
        info = _cluster.cluster_from_environment()
        _stall.ensure_started(info.task_name, {t: a for t, a in info.addresses().items() if t != info.task_name})
    with PROGRESS.phase(kind, kind, collective=True):  # Keras' loop between steps all-reduces metric results.
        yield


def tracked_function(function, kind):
    """Returns `function` (a train, test or predict function) recording each call as a phase.

    A train function's calls also count as finished steps (`Progress.steps_finished`,
    with their wall time for the median step time). `None` stays `None`, and a
    function already tracked is returned as it is. The `tf.function`s behind it
    stay reachable through `__wrapped__` (the retracing monitor counts their traces).

    Args:
        function: The callable Keras calls per execution (`model.train_function` ...), or `None`.
        kind: String, `"train"`, `"test"` or `"predict"`.
    """
    if function is None or getattr(function, _TRACKED, False):
        return function
    phase_kind = _STEP_KINDS[kind]

    @functools.wraps(function)
    def tracked(*args, **kwargs):
        number = PROGRESS.steps_finished + 1 if kind == "train" else None
        detail = f"train step {number}" if kind == "train" else f"{kind} step"
        phase = PROGRESS.enter(phase_kind, detail, collective=True)
        try:
            result = function(*args, **kwargs)
        finally:
            PROGRESS.leave(phase)
        if kind == "train":
            PROGRESS.step_finished(time.monotonic() - phase.since_monotonic)
        return result

    setattr(tracked, _TRACKED, True)
    return tracked


def track_predict_function(model):
    """Tracks `model.predict_function` (Keras' factory sets it and may return `None`); returns it."""
    model.predict_function = tracked_function(model.predict_function, "predict")
    return model.predict_function


def _tracked_hook(callback, name, hook):
    detail = f"{type(callback).__name__}.{name}"

    @functools.wraps(hook)
    def run(*args, **kwargs):
        if name == "on_epoch_begin" and args:
            PROGRESS.epoch = int(args[0])
        with PROGRESS.phase("callback", detail):
            return hook(*args, **kwargs)

    return run


@contextlib.contextmanager
def tracking_callbacks(callbacks):
    """Records each hook a callback of `callbacks` overrides as a `"callback"` phase, for the block's duration.

    The hooks are patched on the instances (so `isinstance` and Keras' own
    checks see the callbacks unchanged) and removed on exit.
    """
    patched = []
    # Keras' `fit` hands its `CallbackList` to the validation's `evaluate`: those callbacks are patched already.
    for callback in getattr(callbacks, "callbacks", callbacks) or ():
        for name in _HOOKS:
            if getattr(type(callback), name, None) is getattr(keras.callbacks.Callback, name) or name in vars(callback):
                continue
            hook = getattr(callback, name, None)
            if callable(hook):
                setattr(callback, name, _tracked_hook(callback, name, hook))
                patched.append((callback, name))
    try:
        yield
    finally:
        for callback, name in patched:
            vars(callback).pop(name, None)
