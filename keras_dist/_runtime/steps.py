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

from keras_dist._runtime import build_context, loss_terms, step_state, variables
from keras_dist._runtime import keras_internals as ki


def train_step(model, data, *, options, forward_backward=None, ride_along=False, summed_metrics=None):
    """Keras' TensorFlow `train_step`, with every replica's loss counted as in the global batch's.

    Each replica computes its loss exactly as one device would on its part
    of the batch (Keras' `1 / num_replicas_in_sync` scaling is off), and the
    loss is recorded term by term (`loss_terms`). Then one of two ways:

    - every term is a mean over examples (compiled losses without masks, a
      loss function returning one number, `add_loss`, regularizers) and the
      optimizer can weight in the all-reduce (`ride_along`): the gradients
      travel as `examples x gradient` with the example counts and the metric
      state in one all-reduce, and are divided by the global examples there;
    - otherwise (masks, `"sum"` reductions, `"mean_with_sample_weight"`,
      several outputs with their loss trackers, a collective in `call`,
      compression, accumulation): one small all-reduce first sums the
      examples and each term's divisor, and each replica's loss becomes its
      part of the global batch's loss (`loss_terms.global_surrogate`), whose
      gradients are summed as they are.

    Args:
        model: The `keras.Model` being trained (several replicas in sync).
        data: One per-replica batch: `x`, `(x, y)` or `(x, y, sample_weight)`.
        options: `tf.distribute.experimental.CommunicationOptions` for the
            small all-reduce of the counts and divisors.
        forward_backward: `None`, or what `compiled_forward_backward(model)`
            returned (XLA per replica: terms are weighted by examples).
        ride_along: Boolean, the optimizer's `apply` can weight the
            gradients by the example counts inside the gradient all-reduce
            (`keras_dist.collectives._optimizer.weighs_examples_in_all_reduce`).
        summed_metrics: `None`, or an object with `variables()` (the metric
            variables to sum in the gradient all-reduce, or `None` when they
            cannot be) and `results(variables, sums)`. The metric state is
            then updated before `apply` (it depends only on `y`, `y_pred` and
            `sample_weight`) and summed with the gradients.

    Returns:
        Dict of metric results, as `model.compute_metrics` returns them.

    Distributed behavior:
        Runs in replica context; every replica takes the same branch (it is
        fixed when the step is traced), so every replica calls the same
        collectives.
    """
    x, y, sample_weight = ki.unpack_x_y_sample_weight(data)
    num_examples = batch_size_of(x)
    step = step_state.ReplicaStep(step_state.SUM, num_examples=num_examples)
    loss_terms.one_device_scaling_installed()  # Also for the XLA pass, which records no terms.
    with step_state.running(step):
        if forward_backward is not None:  # Compiled: `call` cannot hold a collective there.
            if ride_along:
                share = tf.constant(1.0)
                step.weighting = step_state.EXAMPLES_IN_ALL_REDUCE
            else:
                step.global_examples = _sum_over_replicas(tf.reshape(tf.cast(num_examples, tf.float32), [1]), options)[
                    0
                ]
                share = step.example_share()
            y_pred, loss, gradients = forward_backward(x, y, sample_weight, share)
            loss = _zero_when_empty(loss, num_examples)
            model._loss_tracker.update_state(loss, sample_weight=num_examples)
        else:
            y_pred, loss, gradients = _exact_forward_backward(model, x, y, sample_weight, step, ride_along, options)
        if gradients is None:
            warnings.warn("The model does not have any trainable weights.", stacklevel=2)
            return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        state = summed_metrics.variables() if summed_metrics is not None else None
        if state is None:
            model.optimizer.apply_gradients(zip(gradients, model.trainable_weights))
            return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if model._compile_metrics is not None:  # What Keras' `compute_metrics` does, before `apply` here.
            model._compile_metrics.update_state(y, y_pred, sample_weight)
        step.extras = [tf.convert_to_tensor(v.value) for v in state]  # This replica's, read after the updates.
        model.optimizer.apply_gradients(zip(gradients, model.trainable_weights))
    if step.extras_sums is None:  # `apply` did not all-reduce (not reached with keras-dist's optimizer).
        return model.get_metrics_result()
    return summed_metrics.results(state, step.extras_sums)


def test_step(model, data, *, options):
    """Keras' TensorFlow `test_step`, with the logged loss the global batch's (see `train_step`).

    Args:
        model: The `keras.Model` (several replicas in sync).
        data: One per-replica batch.
        options: `tf.distribute.experimental.CommunicationOptions` for the
            small all-reduce of the counts and divisors (only when a loss
            term is not a mean over examples).

    Returns:
        Dict of metric results, as `model.compute_metrics` returns them.
    """
    x, y, sample_weight = ki.unpack_x_y_sample_weight(data)
    num_examples = batch_size_of(x)
    with step_state.running(step_state.ReplicaStep(step_state.SUM, num_examples=num_examples)):
        with loss_terms.recording(model) as record:
            y_pred = model(x, training=False) if model._call_has_training_arg else model(x)
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False)
            loss = _zero_when_empty(loss, num_examples)  # Inside: the record's tape sees the total.
        if record.all_weighted_by_examples():
            model._loss_tracker.update_state(loss, sample_weight=num_examples)
        else:
            _global_loss(model, record, loss, num_examples, options)
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


@contextlib.contextmanager
def user_step(model, data, *, options):
    """Runs a `train_step`/`test_step` the user wrote for one device (the block) as exact for the global batch.

    keras.io writes such a step with its replica's own mean loss
    (`ops.mean(...)`, `self.compute_loss(...)`, a `keras.losses.Loss`),
    `tape.gradient`, `optimizer.apply_gradients` (once per optimizer: a GAN
    has two) and `keras.metrics.Mean` loss trackers. While the block runs on
    this replica:
    - Keras' `1 / num_replicas_in_sync` loss scaling is off (one device's
      numbers on this replica's examples);
    - the optimizer weights this replica's gradients by its share of the
      global batch's examples before summing them (one small all-reduce of
      the example counts, here, before the step);
    - `DistributedModel.compute_loss` returns `global examples / examples x`
      this replica's part of the global batch's loss (`user_step_loss`);
    - a scalar `keras.metrics.Mean.update_state(value)` counts the value by
      this replica's example share, so that the tracker's result (summed over
      the replicas, or averaged as Keras does with the values a step
      returns) is the mean of the global batch's values.

    Args:
        model: The `keras.Model` whose overridden step runs in the block.
        data: The per-replica batch handed to the step (its first leaf's
            leading dimension counts the examples).
        options: `tf.distribute.experimental.CommunicationOptions`.

    Yields:
        The `step_state.ReplicaStep` registered for this replica.
    """
    x, _, _ = ki.unpack_x_y_sample_weight(data)
    num_examples = batch_size_of(x) if tree.flatten(x) else tf.constant(0)
    count = tf.reshape(tf.cast(num_examples, tf.float32), [1])
    step = step_state.ReplicaStep(
        step_state.EXAMPLES,
        num_examples=num_examples,
        global_examples=_sum_over_replicas(count, options)[0],
        user_step=True,
    )
    loss_terms.one_device_scaling_installed()
    with step_state.running(step):
        yield step


def user_step_loss(model, compute_loss, step, options):
    """`compute_loss()` inside a user's step (`user_step`), made exact for the global batch.

    Returns `global examples / examples x` this replica's part of the global
    batch's loss: the loss itself when every term is a mean over examples;
    otherwise (masks, `"sum"` reductions, sample-weight means) each term is
    counted by its own divisor, summed over the replicas in one small
    all-reduce. The optimizer then weights the gradients by the example share
    (`user_step`), which makes them those of the global batch's loss; a
    scalar `Mean` tracker of the value logs the global batch's loss.
    Per-output loss trackers get the global values (`loss_terms.update_trackers`).
    """
    with loss_terms.recording(model) as record:
        loss = _zero_when_empty(compute_loss(), step.num_examples)  # Inside: the record's tape sees the total.
    if record.all_weighted_by_examples():
        return loss
    share = step.example_share()
    divisors = loss_terms.divisors_to_sum(record)
    summed = _sum_over_replicas(divisors, options) if divisors.shape[0] else divisors
    shares = loss_terms.term_shares(record, share, summed)
    part = loss_terms.global_surrogate(record, loss, share, shares)
    loss_terms.update_trackers(record, shares, model.distribute_strategy.num_replicas_in_sync)
    return tf.math.divide_no_nan(part, tf.cast(share, part.dtype))


def _sum_over_replicas(vector, options):
    """float32 `vector` summed over all replicas (one small all-reduce; no gradient through it)."""
    context = tf.distribute.get_replica_context()
    return tf.stop_gradient(context.all_reduce(tf.distribute.ReduceOp.SUM, tf.identity(vector), options=options))


def _zero_when_empty(loss, num_examples):
    """`loss`, or 0 on a replica without examples (a loss function's own mean is NaN there; its gradient is not)."""
    return tf.where(num_examples > 0, loss, tf.zeros_like(loss))


def _global_loss(model, record, loss, num_examples, options):
    """Returns this replica's part of the global batch's loss, and gives the loss trackers the global values.

    One all-reduce sums the examples and the terms' divisors. The main loss
    tracker gains `global examples x part` and `examples` (summed over the
    replicas: the global batch's loss weighted by its examples, as Keras
    weights each batch on one device); each per-output tracker its term's
    global value (`loss_terms.update_trackers`).
    """
    count = tf.reshape(tf.cast(num_examples, tf.float32), [1])
    summed = _sum_over_replicas(tf.concat([count, loss_terms.divisors_to_sum(record)], 0), options)
    global_examples = summed[0]
    share = tf.math.divide_no_nan(count[0], global_examples)
    shares = loss_terms.term_shares(record, share, summed[1:])
    part = loss_terms.global_surrogate(record, loss, share, shares)
    loss_terms.update_trackers(record, shares, model.distribute_strategy.num_replicas_in_sync)
    tracker = model._loss_tracker
    tracker.total.assign_add(tf.cast(global_examples * tf.cast(part, tf.float32), tracker.total.dtype))
    tracker.count.assign_add(tf.cast(count[0], tracker.count.dtype))
    return part, global_examples


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
    tensor (the replica's example share, or 1 when the all-reduce weights
    by examples). Used by the XLA pass (`compiled_forward_backward`). `scope`: optional callable
    returning a context manager entered inside the tape around the forward
    pass and the loss; `collective_refusal`: a message, raised as
    `ValueError` if `call` starts a collective.
    """
    with tf.GradientTape() as tape:
        with (scope or contextlib.nullcontext)(), _observing_collectives(collective_refusal):
            y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
        weighted = loss * tf.cast(loss_weight, loss.dtype)
        if model.optimizer is not None:
            weighted = model.optimizer.scale_loss(weighted)
    trainable_weights = model.trainable_weights
    gradients = tape.gradient(weighted, trainable_weights) if trainable_weights else None
    return y_pred, loss, gradients


def _exact_forward_backward(model, x, y, sample_weight, step, ride_along, options):
    """Returns `(y_pred, loss, gradients)` of one replica, its gradients those of its part of the global loss.

    Sets `step.weighting` (and `step.num_examples` / `step.global_examples`)
    to tell the optimizer's all-reduce how to sum the gradients; updates the
    loss trackers. `loss` is this replica's loss as one device computes it on
    its examples (0 without examples).
    """
    num_examples = step.num_examples
    with tf.GradientTape() as tape:
        with loss_terms.recording(model) as record, _observing_collectives() as collectives:
            y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
            loss = _zero_when_empty(loss, num_examples)  # Inside: the record's tape sees the total.
        if ride_along and not collectives and record.all_weighted_by_examples():
            # A collective in `call` (synchronized BatchNormalization) sends the gradient of every replica's loss
            # back through it: the losses themselves are weighted then, below.
            step.weighting = step_state.EXAMPLES_IN_ALL_REDUCE
            model._loss_tracker.update_state(loss, sample_weight=num_examples)
            to_differentiate = loss
        else:
            to_differentiate, step.global_examples = _global_loss(model, record, loss, num_examples, options)
            step.weighting = step_state.SUM
        if model.optimizer is not None:
            to_differentiate = model.optimizer.scale_loss(to_differentiate)
    trainable_weights = model.trainable_weights
    gradients = tape.gradient(to_differentiate, trainable_weights) if trainable_weights else None
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
