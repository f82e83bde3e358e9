"""The one place keras-dist replaces a strategy's `experimental_distribute_dataset`.

Keras' TensorFlow trainer hands every input pipeline it builds (training,
validation, evaluation, prediction) to `strategy.experimental_distribute_dataset`
and offers no hook of its own. keras-dist needs two: `keras_dist.data` chooses
each input's auto-shard policy and records its input plan, and
`keras_dist.callbacks` skips the batches a mid-epoch backup had done. Both
install them here, with `hooking`; the strategy object then has one
instance-level `experimental_distribute_dataset` (the class's method is never
changed) for as long as any hook is installed, and the method is gone again
when the last one leaves.

What happens on each worker: each worker's own strategy object is changed, for
the duration of one `fit`/`evaluate`/`predict` call; nothing is exchanged.
"""

import contextlib

_NAME = "experimental_distribute_dataset"
_MISSING = object()


def keras_distribute(strategy):
    """Returns the strategy class's own `experimental_distribute_dataset`, bound to `strategy` (no hook)."""
    return getattr(type(strategy), _NAME).__get__(strategy)


@contextlib.contextmanager
def hooking(strategy, hook):
    """Routes `strategy.experimental_distribute_dataset` calls through `hook` while the block runs.

    Args:
        strategy: A `tf.distribute.Strategy`.
        hook: Callable `hook(dataset, options, distribute_next)` returning the
            distributed dataset; `distribute_next(dataset, options=None)`
            distributes through the hooks installed before this one (then
            the method as it was before the first hook). A hook may call
            `keras_distribute(strategy)` instead, to bypass the others.

    Hooks nest: the one installed last runs first. Each leaves with its block.
    """
    wrapper = strategy.__dict__.get(_NAME)
    hooks = getattr(wrapper, "keras_dist_hooks", None)
    if hooks is None:
        before = strategy.__dict__.get(_NAME, _MISSING)
        underlying = getattr(strategy, _NAME)  # An instance attribute someone else set, or the class's method.
        hooks = []

        def distribute(dataset, options=None):
            return _run(hooks, len(hooks), underlying, dataset, options)

        distribute.keras_dist_hooks = hooks
        distribute.keras_dist_before = before
        setattr(strategy, _NAME, distribute)
        wrapper = distribute
    hooks.append(hook)
    try:
        yield
    finally:
        for i in range(len(hooks) - 1, -1, -1):
            if hooks[i] is hook:
                del hooks[i]
                break
        if not hooks and strategy.__dict__.get(_NAME) is wrapper:
            if wrapper.keras_dist_before is _MISSING:
                delattr(strategy, _NAME)
            else:
                setattr(strategy, _NAME, wrapper.keras_dist_before)


def _run(hooks, count, underlying, dataset, options):
    """Distributes `dataset` through the first `count` hooks, the last of them first."""
    if count == 0:
        return underlying(dataset, options=options)

    def distribute_next(next_dataset, options=None):
        return _run(hooks, count - 1, underlying, next_dataset, options)

    return hooks[count - 1](dataset, options, distribute_next)


# What TensorFlow's `input_lib._enable_get_next_as_optional` reads, newest name first.
_PARTIAL_BATCH_FLAGS = ("enable_partial_batch_handling", "experimental_enable_get_next_as_optional")


@contextlib.contextmanager
def without_per_step_agreement(strategy):
    """Distributes datasets without TensorFlow's per-step check that some worker still has data.

    Under several workers TensorFlow's distributed iterator asks, before
    every step of a finite dataset, whether any worker still has a batch (a
    one-element all-reduce, `input_lib._calculate_replicas_with_values`), so
    that workers whose input ran out first get empty batches instead of
    stopping while the others wait in a collective. Where every worker is
    known to have the same number of batches, the question is one collective
    per step for nothing. Datasets distributed while this block runs skip it
    (TensorFlow reads the strategy's flag when it builds the distributed
    dataset); the flag is as before when the block ends.

    Only `get_next()` is affected: `get_next_as_optional()` (Keras' loop with
    `steps_per_execution > 1`) always asks.

    Args:
        strategy: A `tf.distribute.MultiWorkerMirroredStrategy`.
    """
    extended = strategy.extended
    before = {name: extended.__dict__.get(name, _MISSING) for name in _PARTIAL_BATCH_FLAGS}
    for name in _PARTIAL_BATCH_FLAGS:
        setattr(extended, name, False)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is _MISSING:
                extended.__dict__.pop(name, None)
            else:
                setattr(extended, name, value)


def asks_every_step(distributed):
    """Returns whether `distributed`'s iterators check with the other workers before each step (TF's private flag)."""
    return bool(getattr(distributed, "_enable_get_next_as_optional", True))
