"""A `train_step`/`test_step` the user wrote for one device, run as exact for the global batch.

`DistributedModel` runs such a step inside `user_step` (one per replica): the
replica's `step_state.ReplicaStep` (`EXAMPLES`, `user_step=True`) tells the
optimizer's `apply` to weight its gradients by the replica's example share, and
`DistributedModel.compute_loss` returns `user_step_loss`.
"""

import contextlib
import threading

import keras
import tensorflow as tf
from keras import tree
from tensorflow.python.eager import record

from keras_dist._runtime import keras_internals as ki
from keras_dist._runtime import layers, loss_terms, metric_results, step_state, steps

_LOCK = threading.Lock()


@contextlib.contextmanager
def user_step(model, data, *, options, marks=None, tape_all_reduce=None, metrics=None):
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
      returns) is the mean of the global batch's values;
    - `tape.gradient` of one value per example (the tf.keras guide's
      `loss = keras.losses.mean_squared_error(y, y_pred)`, shape `(batch,)`),
      which TensorFlow differentiates as the sum of the values, returns its
      gradients divided by the example share, so that after the weighting
      above they count once each: the gradient of the global batch's sum,
      as on one device (`_per_example_gradient`);
    - with `tape_all_reduce`, `tape.gradient` of a loss with respect to
      trainable variables returns the global batch's gradients: this
      replica's, weighted by its example share, summed over the replicas
      (`_global_gradient`). What the step then does with them (clips them by
      their global norm, `assign_sub`s them, perturbs the weights as SAM
      does) is what one device does, and `apply` sums nothing again;
    - with `metrics`, `result()` of each of them (and of the metrics nested
      in them) is computed from the state summed over the replicas
      (`metric_results`): the step's `{m.name: m.result() ...}` and what it
      computes from a result (a perplexity) are one device's values.

    Args:
        model: The `keras.Model` whose overridden step runs in the block.
        data: The per-replica batch handed to the step (its first leaf's
            leading dimension counts the examples).
        options: `tf.distribute.experimental.CommunicationOptions`.
        marks: `None`, or the timeline's `step_marks.StepMarksBuffer`: the
            step takes its `batch` timestamp here, the optimizer's `apply`
            the others (the first `apply` of the step's).
        tape_all_reduce: `None` (gradients stay this replica's until `apply`
            sums them), or `fn(gradients, variables) -> gradients`, the
            optimizer's all-reduce (a list of gradients of `variables`, in
            replica context; `None`s kept).
        metrics: `None`, or the `keras.metrics.Metric`s whose `result()` in
            the block is the global batch's (`model.metrics`).

    Yields:
        The `step_state.ReplicaStep` registered for this replica.
    """
    x, _, _ = ki.unpack_x_y_sample_weight(data)
    num_examples = steps.batch_size_of(x) if tree.flatten(x) else tf.constant(0)
    # The leading dimension of every tensor of the batch rides in the same all-reduce: a batch may zip inputs of
    # other batch sizes (keras.io's semi-supervised steps: a labelled and an unlabelled dataset), whose means
    # count by their own rows (`loss_terms.term_share`).
    leaves = step_state.data_leaves(data)
    first = next((t for t in tree.flatten(x) if t is not None), None)
    rows = tf.stack([tf.cast(tf.shape(t)[0], tf.float32) for t in leaves]) if leaves else None
    count = tf.reshape(tf.cast(num_examples, tf.float32), [1])
    summed = steps.sum_over_replicas(tf.concat([count, rows if leaves else tf.zeros([0])], 0), options)
    step = step_state.ReplicaStep(
        step_state.EXAMPLES,
        num_examples=num_examples,
        global_examples=summed[0],
        user_step=True,
        marks=marks.recorder() if marks is not None else None,
        tape_all_reduce=tape_all_reduce,
        options=options,
        data_leaves=leaves,
        leaf_counts=rows,
        global_leaf_counts=summed[1:],
        example_leaf=next((i for i, t in enumerate(leaves) if t is first), None),
        global_results=metric_results.GlobalResults(metrics, options) if metrics else None,
    )
    if step.marks is not None:
        step.marks.stamp("batch", data)
    loss_terms.one_device_scaling_installed()
    layers.weighted_state_installed()
    if metrics:
        metric_results.installed(metrics)
    _install_gradient()
    with step_state.running(step):
        try:
            yield step
        finally:
            loss_terms.release_replica_losses()


def _install_gradient():
    """Installs `_gradient` as `tf.GradientTape.gradient` (idempotent); outside a user's step it is TensorFlow's."""
    with _LOCK:
        if tf.GradientTape.gradient is not _gradient:
            tf.GradientTape.gradient = _gradient


def _gradient(self, target, sources, output_gradients=None, *args, **kwargs):
    step = step_state.current()
    if step is None or not step.user_step or output_gradients is not None:
        return loss_terms.TAPE_GRADIENT(self, target, sources, output_gradients, *args, **kwargs)
    variables = tf.nest.flatten(sources)
    replicated = [_replicated_trainable(v) for v in variables]
    if variables and not any(replicated):
        # With respect to this replica's own tensors (an input, an activation): its part of one device's.
        return _replica_part_gradient(self, target, sources, step, *args, **kwargs)
    if variables and not all(replicated) and all(r or isinstance(v, tf.Tensor) for v, r in zip(variables, replicated)):
        mixed = _mixed_gradient(self, target, sources, replicated, step, *args, **kwargs)
        if mixed is not None:
            return mixed
    if not variables or not all(replicated):
        return loss_terms.TAPE_GRADIENT(self, target, sources, None, *args, **kwargs)
    # The user's own persistent tape, asked inside its `with` block, records still: not another tape.
    with _paused(self):
        weights = _backward_weights(target, step)
        ratios = _share_targets(target, step, weighted=weights is not None)
    gradients = _weighted_backward(self, target, sources, ratios, weights, step, *args, **kwargs)
    if weights is None and ratios is None:
        # Weighted by `apply` afterwards: a per-example target counts once, a ratio by its denominator.
        with _paused(self):
            gradients = _per_example_gradient(target, gradients, step)
    with _paused(self):
        return _global_gradient(variables, gradients, step, weighted=weights is not None)


def _weighted_backward(tape, target, sources, ratios, weights, step, *args, **kwargs):
    """`tape.gradient` of `target`: each term by its own share (`ratios`, `_share_targets`), else by `weights`.

    `step.weighted_in_backward` is set while it runs where a share is applied in the backward pass.
    """
    step.weighted_in_backward = weights is not None
    try:
        if ratios is not None:  # Terms with shares of their own (ratios, other parts of the batch): each by its own.
            return loss_terms.TAPE_GRADIENT(tape, ratios[0], sources, ratios[1], *args, **kwargs)
        return _tape_gradient(tape, target, sources, weights, *args, **kwargs)
    finally:
        step.weighted_in_backward = False


def _mixed_gradient(tape, target, sources, replicated, step, *args, **kwargs):
    """One device's gradients for a list of weights and tensors (`tape.gradient(loss, [x] + model.trainable_variables)`).

    One backward pass, weighted by this replica's share as the weights' alone
    are (`_backward_weights`): the weights' parts summed over the replicas
    (`_global_gradient`), the tensors' kept as this replica's part
    (`_replica_part_gradient`), a tensor the whole batch shares summed. `None`
    where the weights' gradients are not summed here (another tape records,
    or no `tape_all_reduce`): the caller then returns this replica's own, as
    TensorFlow's tape does.
    """
    with _paused(tape):
        weights = _backward_weights(target, step)
        if weights is None:
            return None
        ratios = _share_targets(target, step, weighted=True)
    gradients = _weighted_backward(tape, target, sources, ratios, weights, step, *args, **kwargs)
    flat_sources, flat = tf.nest.flatten(sources), list(tf.nest.flatten(gradients))
    own = [i for i, r in enumerate(replicated) if r]
    other = [i for i, r in enumerate(replicated) if not r]
    with _paused(tape):
        summed = _global_gradient([flat_sources[i] for i in own], [flat[i] for i in own], step, weighted=True)
        parts = _shared_sources_summed([flat_sources[i] for i in other], [flat[i] for i in other], step)
    for i, value in zip(own, summed):
        flat[i] = value
    for i, value in zip(other, parts):
        flat[i] = value
    return tf.nest.pack_sequence_as(gradients, flat)


def _replica_part_gradient(tape, target, sources, step, *args, **kwargs):
    """The gradient of the global batch's `target` with respect to tensors of this replica's own (inputs, activations).

    keras.io's adversarial and saliency steps differentiate the loss with
    respect to the batch (`tape.watch(x)`; `x + eps * tape.gradient(loss, x)`).
    An example reaches the global batch's loss only through its replica's
    part of it, so one device's gradient is this replica's weighted by that
    part's share, as the weights' gradients are before they are summed
    (`_backward_weights`), and not summed: a batch mean's was `global examples
    / examples` times one device's (2x on 2 even replicas). A target of one
    value per example (WGAN-GP's critic output) keeps its own gradients. A
    tensor the whole batch shares is summed over the replicas
    (`_shared_sources_summed`).
    """
    with _paused(tape):
        ratios = _share_targets(target, step, weighted=True)
        weights = _share_weights(target, step) if ratios is None else None
    step.weighted_in_backward = ratios is not None or weights is not None
    try:
        if ratios is not None:
            gradients = loss_terms.TAPE_GRADIENT(tape, ratios[0], sources, ratios[1], *args, **kwargs)
        elif weights is None:
            return loss_terms.TAPE_GRADIENT(tape, target, sources, None, *args, **kwargs)
        else:
            gradients = _tape_gradient(tape, target, sources, weights, *args, **kwargs)
    finally:
        step.weighted_in_backward = False
    return _shared_sources_summed(sources, gradients, step)


def _shared_sources_summed(sources, gradients, step):
    """`gradients` (weighted by this replica's share) with those of tensors every replica shares summed over the replicas.

    A tensor the whole batch shares (a universal perturbation `delta` of shape
    `(1, d)` added to every example) gets one device's gradient only as the
    sum of every replica's part, as a weight does. A tensor of this
    replica's examples (its leading dimension unknown, or the batch's own)
    keeps its part: its examples are nowhere else.
    """
    flat_sources, flat = tf.nest.flatten(sources), tf.nest.flatten(gradients)
    if len(flat_sources) != len(flat):
        return gradients
    batch_rows = None
    if step.example_leaf is not None and step.data_leaves:
        batch_rows = step.data_leaves[step.example_leaf].shape[0]
    shared = [
        i
        for i, (source, gradient) in enumerate(zip(flat_sources, flat))
        if gradient is not None and not _rows_of_the_batch(source, batch_rows)
    ]
    if not shared:
        return gradients
    context = tf.distribute.get_replica_context()
    summed = context.all_reduce(
        tf.distribute.ReduceOp.SUM, [tf.convert_to_tensor(flat[i]) for i in shared], options=step.options
    )
    for i, value in zip(shared, summed):
        flat[i] = value
    return tf.nest.pack_sequence_as(gradients, flat)


def _rows_of_the_batch(source, batch_rows):
    """Whether `source` (a tensor) holds rows of this replica's examples: its leading dimension unknown when traced, or the batch's."""
    shape = getattr(source, "shape", None)
    if shape is None or shape.rank is None:
        return True
    if shape.rank == 0:
        return False
    return shape[0] is None or shape[0] == batch_rows


def _tape_gradient(tape, target, sources, weights, *args, **kwargs):
    """TensorFlow's `tape.gradient(target, sources, weights)`; a ratio of sums through its two sums, without NaN.

    A replica whose part of the batch kept no tokens divides 0 by 0
    (`loss_terms.ratio_output_gradients`): its gradients would be NaN, where
    one device's, over the global batch, are not.
    """
    if tf.is_tensor(target):
        with _paused(tape):
            weight = weights[0] if weights is not None else tf.ones([], target.dtype)
            through_sums = loss_terms.ratio_output_gradients(target, weight)
        if through_sums is not None:
            return loss_terms.TAPE_GRADIENT(tape, through_sums[0], sources, through_sums[1], *args, **kwargs)
    return loss_terms.TAPE_GRADIENT(tape, target, sources, weights, *args, **kwargs)


def _share_targets(target, step, *, weighted):
    """`(targets, output_gradients)` that differentiate a scalar `target` whose terms count by shares of their own; or `None`.

    keras.io's multi-task and captioning steps add masked ratios, each with
    its own mask (`r1 + 0.5 * r2`, `loss_terms.linear_terms`): one device's
    gradient is that of each global ratio, which each replica's ratio gives
    weighted by its own denominator's share, not by one share of the sum.
    A semi-supervised step zipping a labelled and an unlabelled dataset of
    other batch sizes adds means over each: each counts by its share of its
    own rows (`loss_terms.term_share`). Every other term counts by the
    example share. `weighted`: the shares are applied here
    (`_backward_weights`); else `apply` multiplies by the example share
    afterwards, and they are divided by it here. `None` where no term has a
    share of its own, or where `target` is one ratio (`_tape_gradient`).
    """
    if not tf.is_tensor(target) or not target.dtype.is_floating:
        return None
    terms = loss_terms.linear_terms(target)
    if terms is None:
        return None
    shares = [loss_terms.term_share(term, step) for _, term in terms]
    if not any(own for _, own in shares):
        return None
    if len(terms) == 1 and terms[0][0] == 1.0 and terms[0][1] is target and loss_terms.ratio_of(target) is not None:
        return None
    example_share = step.example_share()
    targets, output_gradients = [], []
    for (coefficient, term), (share, own) in zip(terms, shares):
        if not own:
            share = example_share if weighted else tf.constant(1.0)
        elif not weighted:
            share = tf.math.divide_no_nan(share, example_share)
        weight = tf.cast(coefficient * share, term.dtype)
        through = loss_terms.ratio_output_gradients(term, weight)
        parts, gradients = through if through is not None else ([term], [weight])
        targets.extend(parts)
        output_gradients.extend(gradients)
    return targets, output_gradients


def _paused(tape):
    """`tape.stop_recording()` while `tape` records (the user's own persistent tape, inside its block), else nothing."""
    return tape.stop_recording() if tape._recording else contextlib.nullcontext()


def _backward_weights(target, step):
    """`output_gradients` that weight `target` by the example share inside the backward pass, or `None`.

    The optimizer's share weighting, applied to the gradient after it is
    computed, is one device's only when the backward pass stays on this
    replica. A forward pass through a cross-replica collective (synchronized
    BatchNormalization's statistics) sends every replica's loss gradient back
    through the collective's gradient (an all-reduce): weighting the result by
    this replica's share then weights the other replicas' parts by it too.
    Weighting the target itself (`d(share x loss)`) weights each part by its
    own replica's share: of the examples, or, for a loss written as a ratio
    of sums (`sum(loss * mask) / sum(mask)`), of the global batch's
    denominator (`loss_terms.ratio_share`). `None` where the step's gradients are not summed here
    (`_global_gradient` keeps them this replica's: another tape records, or no
    `tape_all_reduce`), or where a leaf of `target` is not a floating tensor:
    `apply` weights those afterwards, as before.
    """
    if step.tape_all_reduce is None or record.could_possibly_record():
        return None
    return _share_weights(target, step)


def _share_weights(target, step):
    """`output_gradients` that weight `target` (a loss of this replica's part of the batch) by that part's share, or `None`.

    The share of the global batch's denominator for a ratio of sums
    (`loss_terms.ratio_share`), else the example share (1 for a target of one
    value per example). `None` where a leaf of `target` is not a floating tensor.
    """
    leaves = tree.flatten(target)
    if not leaves or not all(tf.is_tensor(t) and t.dtype.is_floating for t in leaves):
        return None
    ratio = loss_terms.ratio_share(leaves[0], step) if len(leaves) == 1 else None
    scale = ratio if ratio is not None else step.example_share() * _per_example_scale(leaves, step)
    return [tf.fill(tf.shape(t), tf.cast(scale, t.dtype)) for t in leaves]


def _global_gradient(variables, gradients, step, *, weighted=False):
    """`gradients` of `variables` (replicated trainable variables) summed over the replicas, where that is one device's.

    keras.io's steps use `tape.gradient` as one device's: public ones clip
    the result by its global norm (`tf.clip_by_global_norm`), update the
    weights with it by hand (`v.assign_sub(lr * g)`), or perturb the weights
    along it before a second pass (SAM). On a replica it was that replica's
    own gradient: each replica clipped its own, and the replicas' hand
    updates differed. Weighted by the example share and summed over the
    replicas (`step.tape_all_reduce`, the optimizer's own all-reduce), it is
    the gradient of the global batch's loss on every replica, and the
    optimizer's `apply` sums nothing again (`ReplicaStep.already_summed`).

    Under gradient accumulation too: `apply` adds the summed micro-batch
    gradients to each replica's sums and all-reduces nothing again.

    Left as this replica's (weighted and summed by `apply`): a gradient asked
    while another tape records (a gradient of a gradient: the sum would be
    differentiated), and every gradient of a step without `tape_all_reduce`
    (Keras' own sum inside `apply`). Such a gradient takes its variables out
    of `global_gradient_ids`, so that `apply` sums whatever it is given for them.
    """
    flat = tf.nest.flatten(gradients)
    if step.tape_all_reduce is None or record.could_possibly_record() or len(flat) != len(variables):
        step.global_gradient_ids.difference_update(id(v) for v in variables)
        return gradients
    if step.marks is not None:
        step.marks.stamp("gradients", flat)
    weigh = step.zeros_if_empty if weighted else step.by_share  # `weighted`: by `_backward_weights` already.
    summed = step.tape_all_reduce([weigh(g) for g in flat], variables)
    if step.marks is not None:
        step.marks.stamp("all_reduced", summed)
    step.global_gradient_ids.update(id(v) for v in variables)
    return tf.nest.pack_sequence_as(gradients, summed)


def _replicated_trainable(variable):
    """Whether `variable` is a trainable variable with one copy per replica (a Keras or TensorFlow one)."""
    if isinstance(variable, keras.Variable):
        return bool(variable.trainable) and isinstance(
            getattr(variable, "_value", None), tf.distribute.DistributedValues
        )
    return isinstance(variable, tf.distribute.DistributedValues) and bool(getattr(variable, "trainable", False))


def _per_example_gradient(target, gradients, step):
    """`gradients` of `target` divided by the example share where `target` holds one value per example.

    TensorFlow's gradient of a non-scalar target is the gradient of its sum:
    this replica's part of the global batch's sum, which counts once (a sum
    over the replicas), not by the example share the optimizer weights a
    user's step's gradients by (made for a mean over the examples). A
    target whose leaves all have one value per example of this replica's
    batch along their leading dimension (`loss_terms.per_example` when
    traced, the replica's example count when run) gets its gradients divided
    by the share (0 on a replica without examples); scalars (means, sums: a
    scalar sum still counts by the share), values over the gathered global
    batch, and mixed structures are left as they are. A ratio of sums
    (`loss_terms.ratio_share`: `sum(loss * mask) / sum(mask)`) gets them
    multiplied by `its denominator's share / example share`, so that `apply`
    counts it by its denominator, as `_backward_weights` does where the step
    sums its gradients itself (with gradient accumulation, or under another
    tape, it does not).
    """
    leaves = [t for t in tree.flatten(target) if tf.is_tensor(t)]
    if not leaves:
        return gradients
    ratio = loss_terms.ratio_share(leaves[0], step) if len(leaves) == 1 else None
    if ratio is not None:  # `apply` weights by the example share: this makes it the denominator's share.
        scale = tf.math.divide_no_nan(ratio, tf.cast(step.example_share(), ratio.dtype))
    else:
        scale = _per_example_scale(leaves, step)

    def scaled(gradient):
        if gradient is None:
            return None
        if isinstance(gradient, tf.IndexedSlices):
            factor = tf.cast(scale, gradient.values.dtype)
            return tf.IndexedSlices(gradient.values * factor, gradient.indices, gradient.dense_shape)
        return gradient * tf.cast(scale, gradient.dtype)

    return tf.nest.map_structure(scaled, gradients)


def _per_example_scale(leaves, step):
    """float32 scalar: `1 / example share` where every one of `leaves` (tensors) holds one value per example of this replica, else 1."""
    if not all(t.dtype.is_floating and loss_terms.per_example(t, step) for t in leaves):
        return tf.constant(1.0)
    # At run time too: a loss over the gathered global batch (keras_dist.ops.all_gather: keras.io's
    # dual encoder) has one value per global example, the same on every replica, and counts by the share.
    examples = tf.cast(step.num_examples, tf.int32)
    mine = tf.reduce_all([tf.equal(tf.shape(t, out_type=tf.int32)[0], examples) for t in leaves])
    return tf.where(mine, tf.math.divide_no_nan(1.0, step.example_share()), 1.0)


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
        loss = steps.zero_when_empty(compute_loss(), step.num_examples)  # Inside: the record's tape sees the total.
    if record.all_weighted_by_examples():
        return loss
    share = step.example_share()
    divisors = loss_terms.divisors_to_sum(record)
    summed = steps.sum_over_replicas(divisors, options) if divisors.shape[0] else divisors
    shares = loss_terms.term_shares(record, share, summed)
    part = loss_terms.global_surrogate(record, loss, share, shares)
    loss_terms.update_trackers(record, shares, model.distribute_strategy.num_replicas_in_sync)
    return tf.math.divide_no_nan(part, tf.cast(share, part.dtype))
