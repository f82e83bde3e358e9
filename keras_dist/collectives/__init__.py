"""Layer 2: how gradients travel between replicas, on TensorFlow's collective ops.

Owns: `CommunicationOptions` (implementation, packing, timeout, compression) and
the gradient all-reduce `DistributedModel.train_step` runs before handing the
summed gradients to the optimizer. Must not: write a transport or an all-reduce
of its own (TensorFlow's `ReplicaContext.all_reduce` does the work), build
models, or read data.
"""

from keras_dist.collectives._options import COMPRESSIONS, IMPLEMENTATIONS, CommunicationOptions

__all__ = ["COMPRESSIONS", "IMPLEMENTATIONS", "CommunicationOptions"]
