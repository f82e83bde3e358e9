"""Layer 3: what keras-dist installs on a Keras optimizer instance, in one place (private).

Owns: the methods `keras_dist.distributed_optimizer` replaces on one
optimizer *instance* (never its class), and the one attribute it keeps there:

- `apply`: Keras' `Optimizer.apply` applies each replica's gradients as given
  (under a strategy it relies on the loss being pre-scaled and on merge_call);
  the replacement sums them over the replicas first (packing, compression,
  example weighting), then calls the class's `apply` once per replica.
- `build`: Keras' `Optimizer.build` outside `strategy.scope()` fails ("Need to
  be inside `with strategy.scope()`") or creates variables no strategy mirrors;
  the replacement enters the optimizer's strategy first.
- `apply_gradients`, only where the optimizer's class overrides Keras' own (a
  user's subclass that edits the gradients first): the replacement sums them
  first, then calls the class's `apply_gradients` with the sums.
- `_keras_dist_state` (`DistributedOptimizerState`): the communication options
  and the per-replica gradient sums of accumulation.

Must not: decide policy. `keras_dist.collectives` supplies the replacements and
decides when they are used.
"""

import dataclasses
import types
from typing import Any

_STATE = "_keras_dist_state"


@dataclasses.dataclass
class DistributedOptimizerState:
    """keras-dist's state on one optimizer instance.

    Attributes:
        options: `keras_dist.CommunicationOptions` of the gradient all-reduce.
        sums: `keras_dist._runtime.accumulation.ReplicaGradientSums`, the
            per-replica running sums of gradient accumulation, or `None`.
        sums_variables: List of the variables `sums` is kept for, in order.
    """

    options: Any
    sums: Any = None
    sums_variables: list = dataclasses.field(default_factory=list)


def install(optimizer, *, options, apply, build, apply_gradients=None):
    """Replaces `apply` and `build` (and `apply_gradients`, if given) on `optimizer` (this instance); records `options`.

    Idempotent: calling it again updates `options` and keeps the methods
    already installed (also another library's bound methods, which are left
    in place as before).

    Args:
        optimizer: A `keras.optimizers.Optimizer`.
        options: The communication options to keep in its state.
        apply: Function `(optimizer, grads, trainable_variables=None)`, bound to it.
        build: Function `(optimizer, *args, **kwargs)`, bound to it.
        apply_gradients: `None`, or function `(optimizer, grads_and_vars)`,
            bound to it (for a class that overrides Keras' `apply_gradients`).
    """
    current = optimizer.__dict__.get(_STATE)
    if current is None:
        optimizer.__dict__[_STATE] = DistributedOptimizerState(options)
    else:
        current.options = options
    methods = (("apply", apply), ("build", build)) + (
        (("apply_gradients", apply_gradients),) if apply_gradients else ()
    )
    for name, function in methods:
        if not isinstance(optimizer.__dict__.get(name), types.MethodType):
            optimizer.__dict__[name] = types.MethodType(function, optimizer)


def state(optimizer):
    """Returns the `DistributedOptimizerState` of `optimizer`, or `None` when nothing was installed (or no optimizer)."""
    return None if optimizer is None else optimizer.__dict__.get(_STATE)


def has_installed(optimizer, name, function):
    """Returns whether this instance's method `name` is `function`, bound by `install`."""
    method = optimizer.__dict__.get(name) if optimizer is not None else None
    return isinstance(method, types.MethodType) and method.__func__ is function


def class_method(optimizer, name):
    """Returns the method `name` of `optimizer`'s class (Keras' own), bound to `optimizer`."""
    return types.MethodType(getattr(type(optimizer), name), optimizer)
