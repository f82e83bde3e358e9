"""Layer 2: how gradients travel between replicas, on TensorFlow's collective ops.

Owns: `CommunicationOptions` (implementation, packing, timeout, compression),
`distributed_optimizer` (sum gradients over replicas before the optimizer clips
and applies them; accumulation with one all-reduce per k micro-batches) and the
gradient all-reduce itself. Must not: write a transport or an all-reduce
of its own (TensorFlow's `ReplicaContext.all_reduce` does the work), build
models, or read data.
"""

from keras_dist.collectives._optimizer import distributed_optimizer, prepare_gradient_accumulation
from keras_dist.collectives._options import COMPRESSIONS, IMPLEMENTATIONS, CommunicationOptions

__all__ = [
    "COMPRESSIONS",
    "IMPLEMENTATIONS",
    "CommunicationOptions",
    "distributed_optimizer",
    "prepare_gradient_accumulation",
]
