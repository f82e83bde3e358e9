"""A replica context for Keras' symbolic build, so layers that call collectives in `call` can be built.

Keras 3 builds a model (and its metric, loss and optimizer state) by tracing
`call` on symbolic inputs in a scratch graph (`Trainer._symbolic_build`), under
`strategy.scope()`: cross-replica context, where
`tf.distribute.get_replica_context()` returns `None`. A layer whose `call` runs
a collective (`get_replica_context().all_reduce(...)`, a cross-replica
statistic) then fails before training starts. tf.keras built such models in
their first step, inside `strategy.run`. Here the symbolic trace runs in a
replica context of the model's strategy whose collectives only keep shapes and
dtypes: the scratch graph is thrown away, only output specs and variables
(created under the strategy's scope as usual) are kept.
"""

import contextlib

import keras
import tensorflow as tf


class _ShapeOnlyReplicaContext(tf.distribute.ReplicaContext):
    """Replica 0 of `strategy` for a symbolic trace: collectives return values of the right shape.

    `all_reduce` returns its input, `all_gather` concatenates
    `num_replicas_in_sync` copies along `axis`. Nothing is communicated, so this
    context is safe on one worker of a multi-worker job (no peer waits for it).
    `merge_call` keeps TensorFlow's default: the function runs once, in
    cross-replica context, on the values given.
    """

    def all_reduce(self, reduce_op, value, options=None):
        del reduce_op, options
        return tf.nest.map_structure(tf.identity, value)

    def all_gather(self, value, axis, options=None):
        del options
        copies = self.num_replicas_in_sync
        return tf.nest.map_structure(lambda v: tf.concat([v] * copies, axis=axis), value)


@contextlib.contextmanager
def symbolic_replica_context(strategy, optimizer=None):
    """Runs the block in a replica context of `strategy` (replica 0) whose collectives keep only shapes.

    An optimizer built inside the block is built in cross-replica context, as
    Keras builds it under `strategy.scope()`: a variable its `build` assigns
    (ScheduleFreeAdamW copies the weights into its slots) would otherwise be
    written in replica 0's copy only, and the replicas would train apart.

    Args:
        strategy: The `tf.distribute.Strategy` whose scope the block also runs in.
        optimizer: Optional `keras.optimizers.Optimizer` the block may build.

    Distributed behavior:
        For symbolic traces only (Keras' build): values computed inside are
        wrong wherever a collective is involved. Not a collective: no worker
        waits for another.
    """
    with strategy.scope():
        if tf.distribute.get_replica_context() is not None:  # The default strategy's scope is one already.
            yield
            return
        with _ShapeOnlyReplicaContext(strategy, replica_id_in_sync_group=0), _built_in_cross_replica_context(optimizer):
            yield


@contextlib.contextmanager
def _built_in_cross_replica_context(optimizer):
    """While the block runs, `optimizer.build` called in a `_ShapeOnlyReplicaContext` runs in cross-replica context."""
    if optimizer is None or getattr(optimizer, "built", False):
        yield
        return
    own = optimizer.__dict__.get("build")  # Normally none: the class's `build`.
    build = optimizer.build

    def build_across_replicas(*args, **kwargs):
        context = tf.distribute.get_replica_context()
        if not isinstance(context, _ShapeOnlyReplicaContext):
            return build(*args, **kwargs)
        # `merge_call` of this context runs the function once, in cross-replica context, eagerly.
        return context.merge_call(lambda strategy: build(*args, **kwargs))

    optimizer.__dict__["build"] = build_across_replicas
    try:
        yield
    finally:
        if own is None:
            optimizer.__dict__.pop("build", None)
        else:
            optimizer.__dict__["build"] = own


def has_composite_inputs(data_spec):
    """Returns whether the `x` part of a batch spec has a ragged or sparse component."""
    x = data_spec[0] if isinstance(data_spec, tuple) else data_spec
    return any(isinstance(s, (tf.RaggedTensorSpec, tf.SparseTensorSpec)) for s in tf.nest.flatten(x))


def build_from_composite_spec(model, data_spec):
    """Keras' `Trainer._symbolic_build` (3.15) for inputs with ragged (or sparse) parts.

    Keras turns every spec into a dense `KerasTensor` and traces `call` on a
    dense placeholder, so a `call` that handles a `tf.RaggedTensor`
    (`x.to_tensor()`, `x.row_lengths()`) fails to build although the data is
    ragged. Here `call` is traced on placeholders of the real composite type;
    metric, loss and optimizer state are then built as Keras builds them, from
    `y`, `y_pred` and `sample_weight` (`x` is passed as `None`: the default
    `compute_loss` and `compute_metrics` do not read it).

    Args:
        model: The `keras.Model`.
        data_spec: `x`, `(x, y)` or `(x, y, sample_weight)` of `tf.TypeSpec`s
            for one replica's batch (`None` for absent parts).
    """
    from keras import tree
    from keras.src.backend.common.keras_tensor import KerasTensor
    from keras.src.backend.common.stateless_scope import StatelessScope
    from keras.src.backend.common.symbolic_scope import SymbolicScope
    from keras.src.trainers.data_adapters.data_adapter_utils import unpack_x_y_sample_weight

    x_spec, y_spec, sample_weight_spec = unpack_x_y_sample_weight(data_spec)
    with StatelessScope(), SymbolicScope(), tf.__internal__.FuncGraph("keras_dist_build").as_default():
        x = tf.nest.map_structure(_placeholder, x_spec)
        y_pred = tree.map_structure(
            lambda t: KerasTensor(t.shape, t.dtype) if tf.is_tensor(t) else t, model(x, training=False)
        )

    def symbolic(spec):
        return None if spec is None else KerasTensor(spec.shape, spec.dtype)

    y, sample_weight = tree.map_structure(symbolic, y_spec), tree.map_structure(symbolic, sample_weight_spec)
    backend = keras.src.backend
    if model._compile_metrics is not None and not model._compile_metrics.built:
        backend.compute_output_spec(model.compute_metrics, None, y, y_pred, sample_weight=sample_weight)
    if model._compile_loss is not None and not model._compile_loss.built:
        backend.compute_output_spec(model._compute_loss, None, y, y_pred, sample_weight=sample_weight, training=False)
    if model.optimizer is not None and not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    model._post_build()


def _placeholder(spec):
    """A scratch-graph placeholder of `spec`'s type: ragged and sparse specs give composite tensors."""
    if spec is None:
        return None
    if isinstance(spec, (tf.RaggedTensorSpec, tf.SparseTensorSpec)):
        return spec._from_components(tf.nest.map_structure(_placeholder, spec._component_specs))
    return tf.compat.v1.placeholder(spec.dtype, spec.shape)
