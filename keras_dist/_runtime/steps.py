"""Keras' TensorFlow step functions with keras-dist's distribution fixes threaded in.

`DistributedModel` calls these from its `train_step`, step-function factories
and build hook. They use Keras' private trainer attributes, which is why they
live in `_runtime`.
"""

import contextlib
import warnings

import keras
import tensorflow as tf
from keras import tree

from tensorflow.python.distribute.values import PerReplicaSpec

from keras_dist._runtime import build_context
from keras_dist._runtime import keras_internals as ki
from keras_dist._runtime import variables


def train_step(model, data, *, replica_loss_weight, forward_backward=None, weighting_by_examples=None, summed_metrics=None):
    """Runs Keras' TensorFlow `train_step` with a per-replica loss weight.

    Identical to `keras.Model.train_step` on the TensorFlow backend (3.15), except
    that the loss is multiplied by `replica_loss_weight(num_examples)` after the
    loss tracker reads it and before gradients are taken, and that the forward
    and backward pass may be a compiled function (`compiled_forward_backward`).

    Args:
        model: The `keras.Model` being trained.
        data: One per-replica batch: `x`, `(x, y)` or `(x, y, sample_weight)`.
        replica_loss_weight: Callable taking this replica's example count (int32
            scalar tensor) and returning a float scalar multiplier.
        forward_backward: `None` (the pass runs in the step's own graph) or
            what `compiled_forward_backward(model)` returned.
        weighting_by_examples: `None`, or a context manager factory taking
            the example count (`keras_dist.collectives._optimizer.
            weighting_by_examples`): the optimizer then weights this
            replica's gradients in the gradient all-reduce itself, and
            `replica_loss_weight` (a collective of its own) is not called.
        summed_metrics: `None`, or an object with `variables()` (the metric
            variables to sum over the replicas, or `None` when they cannot
            be) and `results(variables, sums)` (the metric results from their
            sums). With `weighting_by_examples`, the metric state is then
            updated before the optimizer's `apply` (it depends only on `y`,
            `y_pred` and `sample_weight`, so the numbers are the same) and
            summed in the gradient all-reduce: one collective per step.

    Returns:
        Dict of metric results, as `model.compute_metrics` returns them.

    Distributed behavior:
        Runs in replica context. `replica_loss_weight` may be a collective;
        every replica calls it once per step (before a compiled forward and
        backward pass, which cannot hold a collective), unless the example
        counts travel in the gradient all-reduce (`weighting_by_examples`),
        which is not done when `call` itself runs a collective.
    """
    x, y, sample_weight = ki.unpack_x_y_sample_weight(data)
    num_examples = batch_size_of(x)
    in_all_reduce = weighting_by_examples is not None
    if forward_backward is not None:  # Compiled: `call` cannot hold a collective there.
        loss_weight = tf.constant(1.0) if in_all_reduce else replica_loss_weight(num_examples)
        y_pred, loss, gradients = forward_backward(x, y, sample_weight, loss_weight)
    else:

        def loss_weight(collectives_in_call):
            # A collective in `call` (synchronized BatchNormalization, a cross-replica statistic) sends
            # the gradient of every replica's loss back through it: weight the losses themselves then.
            nonlocal in_all_reduce
            in_all_reduce = in_all_reduce and not collectives_in_call
            return tf.constant(1.0) if in_all_reduce else replica_loss_weight(num_examples)

        y_pred, loss, gradients = _forward_backward(model, x, y, sample_weight, loss_weight)
    model._loss_tracker.update_state(ki.unscale_loss_for_distribution(loss), sample_weight=num_examples)
    if gradients is None:
        warnings.warn("The model does not have any trainable weights.")
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    state = summed_metrics.variables() if in_all_reduce and summed_metrics is not None else None
    if state is None:
        with weighting_by_examples(num_examples) if in_all_reduce else contextlib.nullcontext():
            model.optimizer.apply_gradients(zip(gradients, model.trainable_weights))
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    if model._compile_metrics is not None:  # What Keras' `compute_metrics` does, before `apply` here.
        model._compile_metrics.update_state(y, y_pred, sample_weight)
    local_state = [tf.convert_to_tensor(v.value) for v in state]  # This replica's, read after the updates.
    with weighting_by_examples(num_examples, extras=local_state) as request:
        model.optimizer.apply_gradients(zip(gradients, model.trainable_weights))
    if request.extras_sums is None:  # `apply` did not all-reduce (not reached with keras-dist's optimizer).
        return model.get_metrics_result()
    return summed_metrics.results(state, request.extras_sums)


@contextlib.contextmanager
def _observing_collectives(refusal=None):
    """Yields a list that records each collective this replica's `call` starts (its replica context's methods).

    With `refusal` (a message), the first collective raises `ValueError(refusal)` instead.
    """
    context = tf.distribute.get_replica_context()
    calls = []
    if context is None or tf.distribute.in_cross_replica_context():
        yield calls
        return
    names = [n for n in ("all_reduce", "all_gather", "merge_call") if n not in context.__dict__]
    for name in names:
        original = getattr(context, name)

        def recording(*args, _name=name, _original=original, **kwargs):
            if refusal is not None:
                raise ValueError(refusal)
            calls.append(_name)
            return _original(*args, **kwargs)

        context.__dict__[name] = recording  # This context object only, for the forward pass.
    try:
        yield calls
    finally:
        for name in names:
            del context.__dict__[name]


def _forward_backward(model, x, y, sample_weight, loss_weight, *, scope=None, collective_refusal=None):
    """Returns `(y_pred, loss, gradients)`: one replica's forward and backward pass.

    `loss` is the replica's loss before `loss_weight` and loss scaling;
    `gradients` (one per `model.trainable_weights`, or `None` when there are
    none) are of the weighted, scaled loss. `loss_weight` is a float scalar
    tensor, or a callable taking whether the forward pass ran a collective
    (boolean, known when traced) and returning it. `scope`: optional callable
    returning a context manager entered inside the tape around the forward
    pass and the loss; `collective_refusal`: a message, raised as
    `ValueError` if `call` starts a collective.
    """
    with tf.GradientTape() as tape:
        with (scope or contextlib.nullcontext)(), _observing_collectives(collective_refusal) as collectives:
            y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
        if callable(loss_weight):
            loss_weight = loss_weight(bool(collectives))
        weighted = loss * tf.cast(loss_weight, loss.dtype)
        if model.optimizer is not None:
            weighted = model.optimizer.scale_loss(weighted)
    trainable_weights = model.trainable_weights
    gradients = tape.gradient(weighted, trainable_weights) if trainable_weights else None
    return y_pred, loss, gradients


class _StateCollectingScope(keras.StatelessScope):
    """A `keras.StatelessScope` that also notes which variables were read after this scope assigned them."""

    def __init__(self, state_mapping):
        super().__init__(state_mapping=state_mapping, collect_losses=True)
        self.assigned, self.read_after_assign, self.watching = set(), {}, True

    def add_update(self, update):
        self.assigned.add(id(update[0]))
        super().add_update(update)

    def get_current_value(self, variable):
        if self.watching and id(variable) in self.assigned:
            self.read_after_assign[id(variable)] = variable
        return super().get_current_value(variable)


def compiled_forward_backward(model):
    """Returns one replica's forward and backward pass compiled with XLA, for `train_step`.

    This is how `jit_compile=True` works under a multi-replica strategy: XLA
    compiles what each replica computes alone (the forward pass, the loss and
    its gradients) on the replica's device, while every synchronization point
    runs in the step's ordinary graph, as in tf.keras 2: the gradient
    all-reduce and the optimizer update, the metrics, and the layers' own
    state updates (BatchNormalization's moving statistics, seed generator
    states, the loss trackers): `call` runs under a `keras.StatelessScope`
    inside XLA and the new values are assigned after it, where an assignment
    to a mirrored variable may synchronize the replicas as it does without
    XLA. Build a new one whenever the train function is rebuilt: the
    trainable weights are read when it is traced.

    Returns:
        A callable taking `(x, y, sample_weight, loss_weight)` and returning
        `(y_pred, loss, gradients)`, as `_forward_backward` does.

    Raises:
        ValueError: When traced: `call` runs a collective (XLA cannot hold
            one); `call` assigns a variable the model does not track (its new
            value would have nowhere to go); or `call` reads a synchronized
            variable (aggregation other than "none") after assigning it in
            the same step (without XLA it would read the value synchronized
            over the replicas; under XLA only its own).
    """
    assigned = []  # The variables the pass assigns, in the order their values are returned; set when traced.
    refusal = (
        "With `jit_compile=True` under a multi-replica strategy, XLA compiles each replica's forward pass "
        "on its own, and a collective cannot run inside it; received a `call` that runs one (e.g. "
        "`BatchNormalization(synchronized=True)` or `get_replica_context().all_reduce`). Fix: pass "
        "`jit_compile=False`."
    )

    def forward_backward(x, y, sample_weight, loss_weight):
        holder = {}

        def scope():  # Entered inside the tape: the regularized weights are read where it watches them.
            mapping = [(v, v.value) for v in model.trainable_variables if getattr(v, "regularizer", None) is not None]
            holder["scope"] = _StateCollectingScope(mapping)
            return holder["scope"]

        y_pred, loss, gradients = _forward_backward(
            model, x, y, sample_weight, loss_weight, scope=scope, collective_refusal=refusal
        )
        state = holder["scope"]
        state.watching = False
        candidates = {id(v): v for v in [*model.variables, *model.metrics_variables]}
        assigned[:] = [v for i, v in candidates.items() if i in state.assigned]
        unknown = len(state.assigned) - len(assigned)
        if unknown:
            raise ValueError(
                "With `jit_compile=True` under a multi-replica strategy, the forward pass may only assign the "
                f"model's own variables (weights and metric state); it assigned {unknown} that "
                f"`{type(model).__name__}` does not track. Fix: create those variables in a layer of the "
                "model with `self.add_weight` (so that the model tracks them), or pass `jit_compile=False`."
            )
        synchronized = [v for v in state.read_after_assign.values() if getattr(v, "aggregation", "none") != "none"]
        if synchronized:
            raise ValueError(
                "With `jit_compile=True` under a multi-replica strategy, `call` read "
                f"{[v.path for v in synchronized]} after assigning it in the same step: without XLA that "
                "read sees the value synchronized over the replicas (the variable's aggregation is "
                f"{synchronized[0].aggregation!r}), under XLA per replica only this replica's own. Fix: pass "
                "`jit_compile=False`, or read the variable before assigning it."
            )
        return y_pred, loss, gradients, [state.get_current_value(v) for v in assigned]

    compiled = tf.function(forward_backward, jit_compile=True, reduce_retracing=True)

    def run(x, y, sample_weight, loss_weight):
        y_pred, loss, gradients, values = compiled(x, y, sample_weight, loss_weight)
        for variable, value in zip(assigned, values):
            variable.assign(value)
        return y_pred, loss, gradients

    return run


def batch_size_of(x):
    """Returns the leading dimension of the first non-`None` leaf of `x` (int32 scalar)."""
    return tf.shape(next(leaf for leaf in tree.flatten(x) if leaf is not None))[0]


def make_step_function(model, replica_step, *, add_replica_axis=False, synchronized_outputs=False):
    """Builds the function `fit`/`evaluate` call per execution, from a replica step.

    Uses Keras' own factory (`TensorFlowTrainer._make_function`): the
    `steps_per_execution` loop, `tf.function` compilation and output reduction
    stay Keras', except under several workers with `synchronized_outputs`.

    Args:
        model: The `keras.Model`.
        replica_step: Callable run in replica context on one per-replica batch,
            returning a structure of tensors.
        add_replica_axis: Boolean. Under `MultiWorkerMirroredStrategy` Keras
            reduces each output with `strategy.reduce("MEAN", value, axis=0)`;
            a leading axis of size 1 makes that the mean over replicas.
        synchronized_outputs: Boolean, `replica_step` returns the same values
            on every replica of every worker (keras-dist's own steps: metric
            results from state summed over all replicas). With
            `add_replica_axis` and `steps_per_execution == 1` (always the case
            under several workers), the outputs are then taken from this
            worker's first replica: Keras' reduction would cost two
            collectives per output per step, for the values already there.
    """
    if add_replica_axis and synchronized_outputs and model.steps_per_execution == 1:
        return _first_replica_step_function(model, replica_step)
    if add_replica_axis:
        step = replica_step

        def replica_step(data):
            return tree.map_structure(_with_replica_axis, step(data))

    return ki.TensorFlowTrainer._make_function(model, replica_step)


def _first_replica_step_function(model, replica_step):
    """Keras' `_make_function` for `steps_per_execution == 1` (3.15), with the outputs of the first local replica."""
    strategy = model.distribute_strategy

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        outputs = strategy.run(replica_step, args=(data,))
        return tree.map_structure(lambda value: strategy.experimental_local_results(value)[0], outputs)

    if not model.run_eagerly:
        one_step_on_data = tf.function(one_step_on_data, reduce_retracing=True, jit_compile=model.jit_compile)
    one_step_on_data = model._autoconvert_optionals(one_step_on_data)

    @tf.autograph.experimental.do_not_convert
    def one_step_on_iterator(iterator):
        return tf.experimental.Optional.from_value(one_step_on_data(iterator.get_next()))

    if not model.run_eagerly:
        one_step_on_iterator = tf.function(one_step_on_iterator, reduce_retracing=True)

    def function(iterator):
        if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            optional_outputs = one_step_on_iterator(iterator)
            if not optional_outputs.has_value():
                raise StopIteration
            return optional_outputs.get_value()
        for data in iterator:  # Keras' `zip(range(steps_per_execution), iterator)` with 1 step.
            return one_step_on_data(data)

    return function


def _with_replica_axis(value):
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return tf.expand_dims(value, 0)
    return value


def has_own_call(model):
    """Returns whether `model` defines `call` (a functional model does; a GAN that only has a `train_step` not)."""
    return type(model).call is not keras.Model.call


def build_without_call(model):
    """What Keras' `_symbolic_build` can build of a model that has no `call`, and what the steps must build.

    Nothing is traced: on one device Keras builds such a model (a GAN that
    trains through its own `train_step`) in the first step. Here the compiled
    optimizer is built on the trainable variables when every layer is built
    (the keras.io GAN's sub-models start with `keras.Input`); layers not built
    yet, and the optimizer then, build in the first step, once, outside the
    step function (`variables.build_outside_step`). Call it under the
    model's strategy scope.
    """
    unbuilt = [layer for layer in model._flatten_layers(include_self=False) if not layer.built]
    if model.distribute_strategy.num_replicas_in_sync > 1:
        for layer in unbuilt:
            variables.build_outside_step(layer)
    if model.optimizer is not None and not model.optimizer.built and not unbuilt:
        model.optimizer.build(model.trainable_variables)


def symbolic_build_from_spec(model, element_spec, *, composite_inputs=False):
    """Builds model, metric and optimizer state from a batch's element spec.

    Args:
        model: The `keras.Model`.
        element_spec: Nested `tf.TypeSpec` structure of one global batch.
        composite_inputs: Boolean, trace `call` on ragged/sparse placeholders where
            the inputs are ragged/sparse (`build_context.build_from_composite_spec`)
            instead of Keras' dense ones.
    """
    spec = tf.nest.map_structure(_one_replica_spec, element_spec, expand_composites=False)
    if composite_inputs and build_context.has_composite_inputs(spec):
        return build_context.build_from_composite_spec(model, spec)
    model._symbolic_build(data_batch=spec)


def _one_replica_spec(spec):
    """Returns the spec a model is built from: `None` for absent parts, one replica's for `PerReplicaSpec`."""
    if isinstance(spec, tf.OptionalSpec):
        return None
    if isinstance(spec, PerReplicaSpec):  # From a distributed dataset (e.g. a DatasetCreator).
        return spec._value_specs[0]
    return spec


def maybe_symbolic_build(model, iterator=None, data_batch=None):
    """Keras' own pre-build (takes a batch from `iterator`); kept for disabled fixes."""
    return ki.TensorFlowTrainer._maybe_symbolic_build(model, iterator=iterator, data_batch=data_batch)
