"""The hooks that record what this worker is doing (`keras_dist.monitor`), around Keras' own loop.

Owns: the phase of each `fit`/`evaluate`/`predict` call, of each call of the
step functions Keras makes (`tracked_function`), and of each hook of each
callback (`tracking_callbacks`, patched on the callback instances for the
duration of one call and then removed). The agreement all-reduce and the
chief's writes record their own phases (keras_dist.callbacks._coordination).
Under several workers the first call starts the stall watchdog
(`keras_dist.monitor._stall`). With a `keras_dist.callbacks.Timeline` among the
callbacks of `fit` (`recording_timeline`), the train step also takes timestamps
at its phase boundaries (`keras_dist._runtime.step_marks`), read after each call.

Cost on the training path: a few attribute writes per step and per callback hook.
"""

import contextlib
import functools
import time

import keras
import tensorflow as tf

from keras_dist._runtime import step_marks, variables
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
# In the model's `__dict__` (not attributes: Keras would track the variables and save them):
_STEP_MARKS = "_keras_dist_step_marks"  # The buffer the train step writes its timestamps to now, or None.
_STEP_MARKS_BUFFER = "_keras_dist_step_marks_buffer"  # Kept: every fit with a timeline reuses one trace.
_BUILT_WITH = "_keras_dist_train_function_step_marks"  # What the train function was traced with.


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


def step_marks_of(model):
    """Returns the `StepMarksBuffer` the train step should write its timestamps to, or `None` (the timeline is off)."""
    return model.__dict__.get(_STEP_MARKS)


def train_function_is_current(model):
    """Whether the train function was traced with the timestamps the timeline wants now (always, when it is off)."""
    return model.__dict__.get(_BUILT_WITH) is step_marks_of(model)


def train_function_built(model):
    """Notes that the train function was just traced with `step_marks_of(model)`."""
    model.__dict__[_BUILT_WITH] = step_marks_of(model)


def _times_inside_the_step(model):
    """Whether keras-dist's step can take timestamps inside itself here (else the timeline has the step call only)."""
    strategy = model._distribute_strategy
    return (
        strategy.num_replicas_in_sync > 1
        and not isinstance(strategy, tf.distribute.TPUStrategy)  # Timestamps do not compile for TPUs.
        and (getattr(model, "steps_per_execution", 1) or 1) == 1  # One call, one step: its phases are the call's.
    )


@contextlib.contextmanager
def recording_timeline(model, timeline):
    """Records the block (one `fit`) with `timeline` (a `Timeline`), the train step's timestamps included.

    The train step takes them while the block runs (`step_marks_of`); the
    train function is traced anew when it was traced without them, and again
    in the first `fit` without a timeline.
    """
    buffer = None
    if _times_inside_the_step(model):
        buffer = model.__dict__.get(_STEP_MARKS_BUFFER)
        if buffer is None:
            buffer = model.__dict__[_STEP_MARKS_BUFFER] = step_marks.StepMarksBuffer(model._distribute_strategy)
    model.__dict__[_STEP_MARKS] = buffer
    try:
        with timeline.recording(model, buffer.read if buffer is not None else None):
            yield
    finally:
        model.__dict__[_STEP_MARKS] = None
