"""Keras' TensorFlow `train_step` and `test_step` with keras-dist's distribution fixes threaded in.

`DistributedModel.train_step`/`test_step` call these under several replicas:
each replica's forward and backward pass (also the XLA-compiled one,
`compiled_forward_backward`), its loss counted as in the global batch's, and
what the step tells the optimizer's gradient all-reduce (`step_state`). They use
Keras' private trainer attributes, which is why they live in `_runtime`. Next
to them: `user_steps` (a `train_step` the user wrote), `trainer_functions`
(the functions `fit` calls per execution) and `symbolic_build` (the pre-build).
"""

import contextlib
import dataclasses
import functools
import importlib.util
import os
import warnings

import keras
import tensorflow as tf
from keras import tree
from tensorflow.python.framework import ops as tf_ops

from keras_dist._runtime import empty_batch, gather, layers, loss_terms, step_state
from keras_dist._runtime import keras_internals as ki


def train_step(model, data, *, options, forward_backward=None, ride_along=False, summed_metrics=None, marks=None):
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
            returned (XLA per replica, which weights the loss by examples:
            used only when every loss term is a mean over examples, else
            this step runs the exact pass without XLA and warns).
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
    recorder = marks.recorder() if marks is not None else None
    # The batch's tensors: a layer's state that adds a sum over them counts it once (`layers._weighted_direct_assign`).
    step = step_state.ReplicaStep(
        step_state.SUM, num_examples=num_examples, marks=recorder, data_leaves=step_state.data_leaves(data)
    )
    if recorder is not None:
        recorder.stamp("batch", data)
    loss_terms.one_device_scaling_installed()  # Also for the XLA pass, which records no terms.
    layers.weighted_state_installed()
    with step_state.running(step):
        if forward_backward is not None and not forward_backward.weighted_by_examples(x, y, sample_weight):
            warnings.warn(_XLA_NOT_BY_EXAMPLES, stacklevel=2)
            forward_backward = None  # The exact step, without XLA: one device's numbers first.
        if forward_backward is not None:  # Compiled: `call` cannot hold a collective there.
            if ride_along and not forward_backward.custom_gradients(x, y, sample_weight):
                share = tf.constant(1.0)
                step.weighting = step_state.EXAMPLES_IN_ALL_REDUCE
            else:
                step.global_examples = sum_over_replicas(tf.reshape(tf.cast(num_examples, tf.float32), [1]), options)[0]
                share = step.example_share()
            y_pred, loss, gradients = forward_backward(x, y, sample_weight, share)
            loss = zero_when_empty(loss, num_examples)
            model._loss_tracker.update_state(loss, sample_weight=num_examples)
        else:
            y_pred, loss, gradients = _exact_forward_backward(model, x, y, sample_weight, step, ride_along, options)
        if recorder is not None:
            recorder.stamp("gradients", gradients)
        if gradients is None:
            warnings.warn("The model does not have any trainable weights.", stacklevel=2)
            return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        state = summed_metrics.variables() if summed_metrics is not None else None
        if state is None:
            _apply(model, gradients, step)
            return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if model._compile_metrics is not None:  # What Keras' `compute_metrics` does, before `apply` here.
            model._compile_metrics.update_state(y, y_pred, sample_weight)
        step.extras = [tf.convert_to_tensor(v.value) for v in state]  # This replica's, read after the updates.
        _apply(model, gradients, step)
    if step.extras_sums is None:  # `apply` did not carry them (accumulation: it all-reduces every k-th step).
        return model.get_metrics_result()
    return summed_metrics.results(state, step.extras_sums)


_XLA_NOT_BY_EXAMPLES = (
    "compile(jit_compile=True) on several replicas: a loss term of this model is not a mean over the batch's "
    "examples (a mask, a loss with reduction 'sum' or 'mean_with_sample_weight', a loss function returning one "
    "number with sample weights or summing over the batch, or a ratio your "
    "`compute_loss` computes). Each replica's part of such a loss counts by another weight than its share of the "
    "examples (the global batch's divisor, or once for a sum), which XLA on one replica cannot take before the "
    "backward pass; so keras-dist "
    "runs this train step without XLA, with one device's numbers. Expected: loss terms that are means over "
    "the examples, for XLA per replica. Fix: none is needed for correct numbers; to keep XLA, use such "
    "losses; to silence this, pass `jit_compile=False`."
)


def _apply(model, gradients, step):
    """`model.optimizer.apply_gradients`; raises if it did not weight by examples when `step` left that to it.

    The step leaves the weighting to the gradient all-reduce
    (`EXAMPLES_IN_ALL_REDUCE`) only when `ride_along` said the optimizer would
    do it; the optimizer's `apply` then carries the step's request and sets
    `step.extras_sums`. Were the two ever to disagree, the gradients of each
    replica's mean would be summed unweighted: an internal error, not a
    fallback.
    """
    model.optimizer.apply_gradients(zip(gradients, model.trainable_weights))
    if step.weighting == step_state.EXAMPLES_IN_ALL_REDUCE and step.extras_sums is None:
        raise RuntimeError(
            "keras-dist internal error: the train step left weighting each replica's gradients by its examples "
            "to the gradient all-reduce (the model's decision: `ride_along`, from "
            "`keras_dist.collectives._optimizer.weighs_examples_in_all_reduce`), but the optimizer's `apply` "
            f"({type(model.optimizer).__name__}) did not carry the step's request (the optimizer's decision: "
            "`_apply_summed`, e.g. it accumulates gradients), so the gradients would be summed unweighted. "
            "Expected: `apply` all-reduces the step's example counts with the gradients. Received: it did not. "
            "Fix: this is a bug in keras-dist; please report it with the optimizer's configuration."
        )


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
    leaves = step_state.data_leaves(data)  # As in `train_step`.
    with step_state.running(step_state.ReplicaStep(step_state.SUM, num_examples=num_examples, data_leaves=leaves)):
        with loss_terms.recording(model) as record:
            y_pred = model(x, training=False) if model._call_has_training_arg else model(x)
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False)
            loss = zero_when_empty(loss_terms.own_ratios(record, loss), num_examples)  # Inside: the tape sees it.
        if record.all_weighted_by_examples():
            model._loss_tracker.update_state(loss, sample_weight=num_examples)
        else:
            _global_loss(model, record, loss, num_examples, options)
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def sum_over_replicas(vector, options):
    """float32 `vector` summed over all replicas (one small all-reduce; no gradient through it)."""
    context = tf.distribute.get_replica_context()
    return tf.stop_gradient(context.all_reduce(tf.distribute.ReduceOp.SUM, tf.identity(vector), options=options))


def zero_when_empty(loss, num_examples):
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
    summed = sum_over_replicas(tf.concat([count, loss_terms.divisors_to_sum(record)], 0), options)
    global_examples = summed[0]
    share = tf.math.divide_no_nan(count[0], global_examples)
    shares = loss_terms.term_shares(record, share, summed[1:])
    part = loss_terms.global_surrogate(record, loss, share, shares)
    num_replicas = model.distribute_strategy.num_replicas_in_sync
    loss_terms.update_trackers(record, shares, num_replicas)
    loss_terms.update_own_trackers(record, share, shares, num_replicas)
    tracker = model._loss_tracker
    # A loss of one value per example (`reduction="none"`): `part` is this replica's sum, and Keras'
    # tracker logs the mean of every value.
    weight = global_examples if loss.shape.rank == 0 else 1.0
    tracker.total.assign_add(tf.cast(weight * tf.cast(part, tf.float32), tracker.total.dtype))
    tracker.count.assign_add(tf.cast(count[0], tracker.count.dtype))
    return part, global_examples


@contextlib.contextmanager
def observing_collectives(refusal=None):
    """Yields a list that records each collective this replica's `call` starts (its replica context's methods).

    With `refusal` (a message), the first collective raises `ValueError(refusal)` instead. Without,
    the gathers of `keras_dist.ops.all_gather` and `keras_dist.global_batch` are not recorded: their
    gradient is weighted as the step weights the replicas' gradients (`gather`), so they are exact in
    the one-collective step too.
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
            if not gather.weighted_gathers_running():
                calls.append(_name)
            return _original(*args, **kwargs)

        context.__dict__[name] = recording  # This context object only, for the forward pass.
    try:
        yield calls
    finally:
        for name in names:
            del context.__dict__[name]


_OWN_PACKAGES = ("tensorflow", "keras", "tf_keras", "keras_dist", "keras_hub", "keras_nlp", "keras_cv")


@functools.cache
def _own_package_directories():
    """The directories `_OWN_PACKAGES` are installed in (those installed), each ending in a separator."""
    directories = []
    for name in _OWN_PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            directories.append(os.path.join(os.path.realpath(location), ""))
    return tuple(directories)


@contextlib.contextmanager
def observing_custom_gradients():
    """Yields a list that receives, when the block ends, the custom gradients written outside TensorFlow and Keras.

    A gradient function a user writes (`keras.ops.custom_gradient`,
    `tf.custom_gradient`) may transform the upstream gradient in a way that is
    not linear in it (clip it, normalize it, take its sign). Where each
    replica differentiates its own mean loss and the replicas' gradients are
    weighted after the backward pass, the upstream gradient it receives is
    `global examples / examples` times one device's, and such a gradient
    function changes the numbers (a new-user probe: a clip of the upstream
    gradient, weights 0.64 relative off). Found from the ops the block adds
    to the graph being traced: an op whose `_gradient_op_type` names a
    registered gradient function (`_written_outside`: TensorFlow's wrappers
    unwrapped) defined outside TensorFlow's and Keras' own packages (their
    custom gradients, `swish` and `recompute_grad`, are linear in the
    upstream gradient). Eagerly there is no graph, and nothing is found.
    """
    found = []
    graph = tf.compat.v1.get_default_graph()
    first = None if tf.executing_eagerly() else len(graph.get_operations())
    try:
        yield found
    finally:
        if first is not None:
            found.extend(user_custom_gradients(graph.get_operations()[first:]))


def user_custom_gradients(operations):
    """The registered names of the custom gradients of `operations` written outside TensorFlow and Keras (a list)."""
    names = (_gradient_op_type(op) for op in operations)
    return [name for name in names if name is not None and _written_outside(_registered_gradient(name))]


def _registered_gradient(name):
    """The gradient function TensorFlow registered under `name` (`tf.RegisterGradient`), or `None`."""
    try:
        return tf_ops._gradient_registry.lookup(name)
    except LookupError:
        return None


def _gradient_op_type(op):
    try:
        name = op.get_attr("_gradient_op_type")
    except (ValueError, TypeError):
        return None
    return name.decode() if isinstance(name, bytes) else name


def _written_outside(function, depth=3):
    """Whether the gradient function `function` (TensorFlow's wrappers unwrapped) is defined outside `_OWN_PACKAGES`.

    `tf.custom_gradient` registers a wrapper of its own (`internal_grad_fn`,
    which closes over `tape_grad_fn`, which closes over the `grad_fn` the
    decorated function returned): the wrappers' closures are followed to the
    gradient function, and its file decides. (A function `tf.recompute_grad`
    recomputes is not a gradient function: its gradient function is
    TensorFlow's.)
    """
    code = getattr(function, "__code__", None)
    if code is None:
        return False
    if function.__name__ not in _TF_GRADIENT_WRAPPERS or not _in_own_packages(code.co_filename):
        return not _in_own_packages(code.co_filename)
    if depth == 0:
        return False
    cells = [_cell_contents(c) for c in (getattr(function, "__closure__", None) or ())]
    return any(_written_outside(f, depth - 1) for f in cells if callable(f))


_TF_GRADIENT_WRAPPERS = ("internal_grad_fn", "tape_grad_fn")  # tensorflow/python/ops/custom_gradient.py


def _in_own_packages(filename):
    return os.path.realpath(filename).startswith(_own_package_directories())


def _cell_contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # An empty cell.
        return None


def _training_forward(model, x, y, sample_weight):
    """`(y_pred, loss)`: the model's forward pass in training mode and Keras' loss of it (`_compute_loss`)."""
    y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
    return y_pred, model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)


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
        with (scope or contextlib.nullcontext)(), observing_collectives(collective_refusal):
            y_pred, loss = _training_forward(model, x, y, sample_weight)
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
        with (
            loss_terms.recording(model) as record,
            observing_collectives() as collectives,
            observing_custom_gradients() as custom_gradients,
        ):
            y_pred, loss = _training_forward(model, x, y, sample_weight)
            loss = zero_when_empty(loss_terms.own_ratios(record, loss), num_examples)  # Inside: the tape sees it.
        if ride_along and not collectives and not custom_gradients and record.all_weighted_by_examples():
            # A collective in `call` (synchronized BatchNormalization) sends the gradient of every replica's loss
            # back through it, and a custom gradient of one's own may not be linear in the upstream gradient:
            # the losses themselves are weighted then, below.
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


def _regularized_values(model):
    """`[(variable, its value)]` of the regularized trainable weights: a `StatelessScope` mapping, read where a tape watches."""
    return [(v, v.value) for v in model.trainable_variables if getattr(v, "regularizer", None) is not None]


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
        `(y_pred, loss, gradients)`, as `_forward_backward` does; its
        `weighted_by_examples(x, y, sample_weight)` says whether every loss
        term is a mean over examples (where the pass is exact), and
        `custom_gradients(x, y, sample_weight)` lists custom gradients of
        one's own in it.

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
        "on its own, and a collective cannot run inside it; received a `call` or a compiled loss that runs one "
        "(e.g. `BatchNormalization(synchronized=True)`, `get_replica_context().all_reduce`, "
        "`keras_dist.ops.all_gather` or a loss wrapped in `keras_dist.global_batch`). Fix: pass "
        "`jit_compile=False`."
    )

    def forward_backward(x, y, sample_weight, loss_weight):
        holder = {}

        def scope():  # Entered inside the tape: the regularized weights are read where it watches them.
            holder["scope"] = _StateCollectingScope(_regularized_values(model))
            return holder["scope"]

        with empty_batch.compiled_by_xla():
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

    def custom_gradients(x, y, sample_weight):
        """`observing_custom_gradients`' finding for the compiled pass on these inputs (traced once, kept)."""
        return user_custom_gradients(
            compiled.get_concrete_function(x, y, sample_weight, tf.constant(1.0)).graph.get_operations()
        )

    found = {}  # What a trace of the forward pass under `loss_terms.recording` saw, with and without sample weights.

    def weighted_by_examples(x, y, sample_weight):
        """Whether every loss term of the pass on these inputs is a mean over examples (`LossTerm.weighted_by_examples`).

        The XLA pass weights each replica's loss by its share of the examples, which is exact for such terms
        (the per-output loss logs of several outputs included, as the compiled steps' tests show).

        Traced, never run: the forward pass and the loss under `loss_terms.recording`, in a graph of its own.
        """
        key = sample_weight is None  # `fit(sample_weight=...)` later retraces the same pass with them.
        if key not in found:
            compiled.get_concrete_function(x, y, sample_weight, tf.constant(1.0))  # Its refusals first.

            def forward(x, y, sample_weight):
                # This graph's batch: a loss summing over its rows is read from it (`loss_terms.summed_terms`).
                inner = dataclasses.replace(
                    step_state.current(), data_leaves=step_state.data_leaves((x, y, sample_weight))
                )
                with (
                    step_state.running(inner),
                    _StateCollectingScope(_regularized_values(model)),
                    loss_terms.recording(model) as record,
                ):
                    record.inspecting = True
                    _, loss = _training_forward(model, x, y, sample_weight)
                    loss_terms.own_ratios(record, loss)
                # A loss function's scalar times its weights' factor needs the global batch's factor.
                found[key] = all(term.weighted_by_examples and not term.global_weights for term in record.terms)
                return tf.constant(0)

            tf.function(forward).get_concrete_function(x, y, sample_weight)
        return found[key]

    run.custom_gradients = custom_gradients
    run.weighted_by_examples = weighted_by_examples
    return run


def batch_size_of(x):
    """Returns the leading dimension of the first non-`None` leaf of `x` (int32 scalar; a constant where it is static)."""
    leaf = next(leaf for leaf in tree.flatten(x) if leaf is not None)
    static = leaf.shape[0] if leaf.shape.rank else None
    return tf.constant(static, tf.int32) if static is not None else tf.shape(leaf)[0]


def with_dynamic_batch(data):
    """`data` (a per-replica batch) with the leading dimension of each dense tensor leaf left unknown to the trace.

    Where every global batch splits into replicas of one size, each replica's
    step is traced with that static size: `ops.shape(x)[0]`, `tf.shape(x)[0]`
    and `ops.ones_like(x)` are then constants (Keras returns a static
    dimension as a Python int; TensorFlow folds the rest), which nothing tells
    from any other number. A step of the user's that divides by it
    (`ops.sum(err) / ops.shape(x)[0]`, a mean written by hand) was taken as a
    sum over the batch and counted once per replica: the loss and gradients
    2x one device's on 2 even replicas, where an uneven split (a dynamic
    dimension) was exact (a new-user probe, stop 51). With the dimension
    unknown, the row count stays `Shape` of the batch in the graph, which
    `loss_terms` counts as the global batch's. One device traces the same
    step with the global batch's static size, whose count is already
    the global one. `tf.raw_ops.PlaceholderWithDefault` is the identity at
    run time (and under XLA); ragged, sparse and rank-0 leaves, and leaves
    whose leading dimension is unknown already, are returned as they are.

    Returns:
        The same structure as `data`.
    """

    def dynamic(leaf):
        if not isinstance(leaf, tf.Tensor) or leaf.shape.rank in (None, 0) or leaf.shape[0] is None:
            return leaf
        shape = tf.TensorShape([None]).concatenate(leaf.shape[1:])
        return tf.raw_ops.PlaceholderWithDefault(input=leaf, shape=shape)

    return tree.map_structure(dynamic, data)
