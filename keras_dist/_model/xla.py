"""`compile(jit_compile=True)` under a multi-replica strategy: XLA per replica, collectives outside it.

Keras alone would compile the whole step across every replica, which fails.
Here `compile` passes `jit_compile=False` to Keras and remembers whether each
replica's forward and backward pass is to be compiled with XLA
(`_runtime.steps.compiled_forward_backward`); the gradient all-reduce and the
optimizer update run in the step's ordinary graph.
"""

import warnings

from keras_dist import _compat
from keras_dist._runtime import keras_internals as ki
from keras_dist._runtime import steps, variables

_REPLICA_JIT_COMPILE = "_keras_dist_replica_jit_compile"
_FORWARD_BACKWARD = "_keras_dist_forward_backward"


def take_jit_compile(model, kwargs, *, overrides_train_step):
    """Returns whether each replica's pass compiles with XLA; sets `kwargs["jit_compile"]` to what Keras gets.

    Args:
        model: The `DistributedModel` being compiled.
        kwargs: `compile`'s keyword arguments (changed in place).
        overrides_train_step: Boolean, `model`'s class has its own `train_step`.

    Raises:
        ValueError: `jit_compile=True` with an overriding `train_step`.
    """
    if not (_compat.is_active("jit_compile_mirrored") and variables.is_multi_replica(model._distribute_strategy)):
        return False
    jit_compile, run_eagerly = kwargs.get("jit_compile", "auto"), kwargs.get("run_eagerly", False)
    kwargs["jit_compile"] = False  # Keras would compile the step across every replica at once.
    if jit_compile is not True or run_eagerly:
        return False  # "auto": Keras itself picks no XLA under tf.distribute; run_eagerly wins, as in Keras.
    if overrides_train_step:
        raise ValueError(
            "`jit_compile=True` under a multi-replica strategy needs DistributedModel's own "
            f"`train_step`: keras-dist compiles each replica's forward and backward pass with XLA and "
            f"runs the gradient all-reduce outside it, and cannot split an overriding `train_step` "
            f"({type(model).__qualname__}.train_step) that way. Received: jit_compile=True, "
            f"num_replicas_in_sync={model._distribute_strategy.num_replicas_in_sync}. Fix: pass "
            "`jit_compile=False`, or compile your own forward and backward pass inside `train_step` "
            "with `tf.function(jit_compile=True)` and call `self.optimizer.apply` outside it."
        )
    if not ki.model_supports_jit(model):
        warnings.warn(
            "Model doesn't support `jit_compile=True` (a layer has `supports_jit=False`). "
            "Proceeding with `jit_compile=False`.",
            stacklevel=3,
        )
        return False
    return True


def remember(model, replica_jit_compile):
    """After Keras' `compile`: keep the choice, and save it with the model so a loaded one compiles again."""
    model.__dict__[_REPLICA_JIT_COMPILE] = replica_jit_compile
    if replica_jit_compile:
        ki.record_compile_argument(model, "jit_compile", True)


def rebuild_forward_backward(model):
    """Makes a new XLA-compiled replica pass for a new train function (`None` when XLA is not asked for).

    The trainable weights are read when the pass is traced: one per train function.
    """
    model.__dict__[_FORWARD_BACKWARD] = (
        steps.compiled_forward_backward(model) if model.__dict__.get(_REPLICA_JIT_COMPILE) else None
    )


def forward_backward(model):
    """The XLA-compiled replica pass of the current train function, or `None`."""
    return model.__dict__.get(_FORWARD_BACKWARD)
