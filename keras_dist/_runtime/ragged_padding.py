"""Runtime layer: a ragged batch made dense on a replica is padded to the global batch's longest row.

Owns: the wrap of `tf.RaggedTensor.to_tensor` (process-wide, installed by a
`DistributedModel`'s train, test and predict functions) that, in replica
context under a strategy of such a model with several replicas, pads each
ragged dimension the caller left open to the longest of all replicas, as one
device pads the global batch. Must not: change a dimension the caller fixed,
run outside a keras-dist model's replica context, or run inside a pass XLA
compiles (it holds a collective).

Why: one device densifies the global batch to its longest row; each replica
densified its own part to its own longest. A model whose numbers depend on
the padding (`TextVectorization` without `output_sequence_length`, keras.io's
text classification, followed by an unmasked `GlobalAveragePooling1D`; a
`call` doing `tokens.to_tensor()`) computed other numbers on N replicas (a
new-user probe: 1.6e-2 off in the weights on 2 replicas), and sequence
outputs of different lengths could not be put together by `predict`.
"""

import weakref

import tensorflow as tf

from keras_dist._runtime import empty_batch, strategy_info

_ORIGINAL = {}
_STRATEGIES = weakref.WeakSet()  # The strategies of keras-dist models whose step functions were made.


def installed(strategy):
    """Wraps `tf.RaggedTensor.to_tensor` (once) and pads as one device for `strategy`'s replicas (idempotent).

    Args:
        strategy: The `tf.distribute.Strategy` of a `DistributedModel`.
    """
    _STRATEGIES.add(strategy)
    if "to_tensor" not in _ORIGINAL:
        _ORIGINAL["to_tensor"] = tf.RaggedTensor.to_tensor
        tf.RaggedTensor.to_tensor = _to_tensor


def _to_tensor(self, default_value=None, name=None, shape=None):
    """`tf.RaggedTensor.to_tensor`, padded to the global batch's longest row in a keras-dist replica (`global_shape`)."""
    padded = global_shape(self, shape)
    if padded is None:
        return _ORIGINAL["to_tensor"](self, default_value=default_value, name=name, shape=shape)
    shape_tensor, static = padded
    result = _ORIGINAL["to_tensor"](self, default_value=default_value, name=name, shape=shape_tensor)
    result.set_shape(static)
    return result


def global_shape(ragged, shape=None):
    """`(shape tensor, static shape)` padding `ragged` as one device pads the global batch; `None` where nothing changes.

    Each ragged dimension (after the rows) that `shape` leaves open (`None`)
    gets the longest of all replicas (one all-gather of this replica's
    bounding shape in those dimensions); the rows and every dimension
    `shape` fixes stay as given.

    Args:
        ragged: A `tf.RaggedTensor` of known rank.
        shape: What `to_tensor` was given: `None`, or a list, tuple or
            `tf.TensorShape` of ints and `None` (a shape tensor is the
            caller's own: left as it is).

    Returns:
        `(int64 vector tensor, list of int or None)`: the shape to pass (-1
        for the rows) and the result's static shape; or `None` outside a
        replica of a keras-dist model's strategy with several replicas,
        inside a pass XLA compiles or a graph nested in the replica's (where
        MirroredStrategy cannot synchronize: there each replica pads its own
        part), or where no ragged dimension is open.

    Distributed behavior:
        Replica context; every replica calls it (the same trace).
    """
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    strategy = tf.distribute.get_strategy()
    if strategy not in _STRATEGIES or strategy.num_replicas_in_sync < 2 or empty_batch.compiling_by_xla():
        return None
    if strategy_info.in_nested_graph_of_replica():
        # Keras' `compute_output_spec` building the model, a `tf.cond` branch: MirroredStrategy synchronizes only
        # in the replica's own graph.
        return None
    rank = ragged.shape.rank
    if rank is None or tf.is_tensor(shape) or (isinstance(shape, (list, tuple)) and any(map(tf.is_tensor, shape))):
        return None
    given = tf.TensorShape(shape)
    if given.rank is None:
        given = tf.TensorShape([None] * rank)
    if given.rank != rank:
        return None  # TensorFlow's own error.
    dims = given.as_list()
    open_dims = [i for i in range(1, rank) if dims[i] is None and ragged.shape[i] is None]
    if not open_dims:
        return None
    bounding = tf.gather(tf.cast(ragged.bounding_shape(out_type=tf.int64), tf.float32), open_dims)
    gathered = tf.distribute.get_replica_context().all_gather(bounding[tf.newaxis], axis=0)
    longest = tf.cast(tf.reduce_max(gathered, axis=0), tf.int64)
    entries = [tf.constant(-1 if d is None else d, tf.int64) for d in dims]
    for position, i in enumerate(open_dims):
        entries[i] = longest[position]
    static = [d if d is not None else ragged.shape[i] for i, d in enumerate(dims)]
    return tf.stack(entries), static
