"""Layer 1: collectives a step of one's own needs for losses that see the whole batch.

A loss that couples the examples of a batch (SimCLR/CLIP-style InfoNCE,
in-batch negatives, batch-hard triplets) sees only its replica's part of the
batch under data parallelism: fewer negatives, another loss, other weights.
In a `train_step` of one's own, gather what the loss compares:

```python
z = self.projector(self.encoder(x))
z = keras_dist.ops.all_gather(z)                  # the global batch, on every replica
labels = keras_dist.ops.global_batch_offset(x) + ops.arange(ops.shape(x)[0])
```

Each is the identity (offset 0) on one device and outside any strategy, so the
program still runs unchanged on one device. Docs: `docs/global_batch_losses.md`.
"""

from typing import Any

from keras_dist._runtime import gather as _gather
from keras_dist._runtime import global_batch as _global_batch


def all_gather(values: Any, axis: int = 0) -> Any:
    """Every replica's `values` concatenated along `axis`, in global order, on every replica; differentiable.

    Args:
        values: A tensor or nested structure of tensors, `(n_r, ...)` along
            `axis` on replica r (uneven and empty parts allowed); integer
            tensors are gathered without a gradient. Every replica calls it
            with the same structure, dtypes and other dimensions.
        axis: Python int, the batch axis (default 0).

    Returns:
        The same structure, each tensor `(sum_r n_r, ...)` along `axis`,
        replica 0's part first; `values` itself on one replica or outside
        any strategy.

    Raises:
        RuntimeError: called in the cross-replica context of a strategy with
            several replicas (outside a step).

    Gradient: each replica's own part receives the sum over the replicas of
    the gradients of their losses with respect to it (TensorFlow's
    reduce-scatter), weighted as keras-dist weights the replicas' gradients, so
    a loss computed from the gathered values as one device computes it trains
    to one device's weights on any split (PyTorch Lightning's
    `all_gather(sync_grads=True)`, Horovod's `hvd.allgather`).

    Communication: one all-gather per tensor (N times its bytes received by
    each replica), and one all-reduce of the gathered gradient in the backward
    pass.
    """
    return _gather.all_gather(values, axis=axis)


def global_batch_offset(values: Any) -> Any:
    """int32 scalar tensor: the position of this replica's first example in `all_gather`'s global batch.

    Args:
        values: A tensor or nested structure whose first tensor's leading
            dimension is this replica's number of examples.

    Returns:
        int32 scalar tensor: the examples of the replicas before this one
        (0 on replica 0, on one replica, and outside any strategy).

    Raises:
        RuntimeError: called in cross-replica context with several replicas.
    """
    return _gather.global_batch_offset(values)


def batch_mean(values: Any) -> Any:
    """The mean of `values` over the global batch's examples (axis 0), on every replica; differentiable.

    For a loss a layer adds from statistics over the batch, such as a
    mixture-of-experts load-balancing loss (keras.io's Switch Transformer:
    `mean(router_probs, axis=0) * mean(expert_mask, axis=0)`): each replica
    computing them over its own examples (as PyTorch DDP and tf.keras do)
    adds another loss than one device, and trains elsewhere. Write
    `keras_dist.ops.batch_mean(router_probs)` where the layer wrote
    `ops.mean(router_probs, axis=0)`; keras-dist counts the scalar the layer
    adds once over the replicas, so the weights are one device's.

    Args:
        values: A float tensor `(n_r, ...)` on replica r (uneven and empty
            parts allowed); every replica calls it with the same trailing
            dimensions and dtype.

    Returns:
        A tensor `(...)` of `values`' dtype: the sum of every replica's rows
        over the global batch's row count; `ops.mean(values, axis=0)` on one
        replica or outside any strategy's replica context (0 where the global
        batch is empty).

    Gradient: each replica's rows receive the gradient of every replica's use
    of the mean (the all-reduce's gradient is the all-reduce of the
    gradients), as one device's rows receive it.

    Communication: one all-reduce of the trailing dimensions' values and a
    count per call, in the forward pass, and one of their gradients in the
    backward pass. Under `compile(jit_compile=True)` with several replicas
    keras-dist refuses a collective in `call` (XLA compiles each replica alone).
    """
    return _global_batch.batch_mean(values)


def num_replicas() -> int:
    """Python int: the replicas the global batch is split over (1 on one device and outside any strategy)."""
    return _gather.num_replicas()


__all__ = ["all_gather", "batch_mean", "global_batch_offset", "num_replicas"]
