"""The switches of the compatibility fixes: on, off, forced, and the import-time warning.

`keras_dist._compat.registry` lists the fixes (`FIXES`) and the versions each was
verified on. A fix is active when the installed version is inside its `verified`
range, or the user forces it (`KERAS_DIST_FORCE_FIXES`), and it is not disabled
(the tests disable fixes to show the bug each one prevents). Outside its range a
fix is off: keras-dist then runs Keras' own code path, and warns once, at import,
naming the fixes that are off and how to force them. The remedies themselves are
small overrides in `keras_dist.DistributedModel` and `keras_dist._runtime`, taken
only when `is_active(name)` is true.
"""

import contextlib
import gc
import os
import warnings

import tensorflow as tf

from keras_dist import errors
from keras_dist._compat import versions
from keras_dist._compat.registry import FIXES as FIXES  # Re-exported.
from keras_dist._compat.registry import Fix as Fix  # Re-exported.
from keras_dist._env import DISABLE_FIXES_ENV, FORCE_FIXES_ENV

DISABLE_ENV = DISABLE_FIXES_ENV  # Comma-separated names: these fixes are off.
FORCE_ENV = FORCE_FIXES_ENV  # `all`, or comma-separated names: on even outside their verified range.

_disabled = set()


def _names_in_env(variable):
    return {n.strip() for n in os.environ.get(variable, "").split(",") if n.strip()}


def is_forced(name):
    """Returns whether `KERAS_DIST_FORCE_FIXES` turns fix `name` on outside its verified range."""
    forced = _names_in_env(FORCE_ENV)
    return "all" in forced or name in forced


def is_active(name):
    """Returns whether fix `name` is on: verified for (or forced on) the installed versions, and not disabled.

    Raises:
        KeyError: `name` is not a registered fix.
    """
    fix = FIXES[name]
    in_range = fix.applies_to_installed() or is_forced(name)
    return in_range and name not in _disabled and name not in _names_in_env(DISABLE_ENV)


def active_fixes():
    """Returns the list of `Fix` entries active for the installed versions."""
    return [fix for name, fix in FIXES.items() if is_active(name)]


def unverified_fixes():
    """Returns the `Fix` entries off because the installed version is outside their verified range (and not forced).

    A fix whose bug the installed version no longer has (`Fix.fixed_in`) is off
    because it is not needed, and is not listed.
    """
    return [
        fix
        for name, fix in FIXES.items()
        if not fix.applies_to_installed() and not is_forced(name) and not fix.fixed_upstream()
    ]


_warned = False


def warn_if_unverified():
    """Warns once per process when fixes are off because the installed Keras or TensorFlow is unverified.

    Called at `import keras_dist` (through `keras_dist._compat`). Silent on the
    verified versions, and after the first call.
    """
    global _warned
    off = unverified_fixes()
    if _warned or not off:
        return
    _warned = True
    installed = ", ".join(f"{package} {version}" for package, version in sorted(versions.INSTALLED.items()))
    ranges = ", ".join(sorted({f"{fix.package} {fix.verified}" for fix in off}))
    warnings.warn(
        f"keras-dist's compatibility fixes were verified on {ranges}; installed: {installed}. "
        f"{len(off)} of them are off on this version, so those cases run Keras' own code path, which may not "
        f"match one device (docs/compat.md): {', '.join(fix.name for fix in off)}. Fix: install a verified "
        f"version (pyproject.toml), or turn them on anyway with {FORCE_ENV}=all (or a comma-separated list of "
        "fix names) and check your numbers against one device.",
        errors.KerasDistWarning,
        stacklevel=2,
    )


def sums_activity_regularization():
    """Whether the installed Keras sums each activity regularizer's loss over the batch, and keras-dist counts it so.

    Keras before 3.14 adds `activity_regularizer(output)` as it is; 3.14 divides it by the
    batch size (keras-team/keras#22021). keras-dist's per-replica loss (`_runtime.loss_terms`)
    counts the summed form once per replica while fix `summed_activity_regularization` is on.
    Forcing the fix on a Keras that divides changes nothing: there the loss is a mean over examples.
    """
    return not versions.release_at_least("keras", "3.14") and is_active("summed_activity_regularization")


@contextlib.contextmanager
def collecting_after(strategy):
    """Context manager: runs Python's cycle collector once the block (a fit/evaluate/predict) exits.

    Fix `finished_epoch_iterator_cycle`, only under `MultiWorkerMirroredStrategy`:
    Keras' epoch iterator sits in a reference cycle with its own generator, so the
    finished call's tf.data pipeline is destroyed whenever the collector next runs;
    collecting here makes that happen on every worker at the same point, not inside
    a later call of one worker while the others wait for it. Costs about 0.2 s a call.

    Args:
        strategy: The model's `tf.distribute.Strategy`.
    """
    try:
        yield
    finally:
        if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and is_active(
            "finished_epoch_iterator_cycle"
        ):
            gc.collect()


@contextlib.contextmanager
def disabled(*names):
    """Context manager that turns fixes off, to reproduce the bugs they prevent.

    Functions already traced keep the behaviour they were traced with: build
    and compile models inside the block.
    """
    unknown = [n for n in names if n not in FIXES]
    if unknown:
        raise KeyError(f"Unknown fix name(s) {unknown}. Known: {sorted(FIXES)}.")
    added = set(names) - _disabled
    _disabled.update(added)
    try:
        yield
    finally:
        _disabled.difference_update(added)
