"""Layer 3: the terms a Keras loss is made of, recorded while a replica computes it.

Keras reduces every loss to one number per replica in
`keras.src.losses.loss.reduce_weighted_values`, each with its own divisor:
the elements of the per-example losses (`"sum_over_batch_size"`), the
unmasked tokens (a mask), the sample weights' sum
(`"mean_with_sample_weight"`), or none (`"sum"`); a loss function that returns
one number is taken as it is. The global batch's loss is, per term,
`sum_r(S_r) / sum_r(D_r)`, which no weighting of the replicas' values by
their example counts alone gives once the divisors are not proportional to
the examples. Under a strategy Keras also divides each reduced loss by
`num_replicas_in_sync` (`scale_loss_for_distribution`), but not a loss
function's own scalar (a loss function returning `ops.mean(...)`: the
gradient and the logged loss doubled on 2 replicas).

What this module does, while a keras-dist step runs on a replica (its
`step_state.ReplicaStep` is registered):
- Keras' distribution scaling is off (`scale_loss_for_distribution` and its
  inverse are the identity, and so is TensorFlow's in `tf.nn.compute_average_loss`
  without a `global_batch_size` and `tf.nn.scale_regularization_loss`), so each
  replica computes exactly what one device computes on its part of the batch;
- inside `recording(model)`, every reduction is recorded as a `LossTerm`
  (its value, how it is weighted across replicas, its divisor), and the
  per-output loss trackers' states are noted before Keras updates them, so
  that the step can give them the global batch's value instead.
`global_surrogate` then builds the per-replica loss whose sum over the
replicas is the global batch's loss, in value and in gradient. On a Keras
before 3.14 the activity regularizers' losses are recorded too: those Keras
versions sum them over the batch, so each replica's counts once
(`_compat.sums_activity_regularization`); from 3.14 Keras divides them by the
batch size, a mean over examples like the rest of the loss.

The functions of `keras.src.losses.loss` are replaced by dispatchers once, the
first time a keras-dist step needs them; outside a keras-dist step they call
Keras' own, unchanged.
"""

import contextlib
import dataclasses
import functools
import inspect
import sys
import threading
import weakref

import numpy as np
import tensorflow as tf
from keras import ops, tree
from keras.src.layers import layer as keras_layer
from keras.src.losses import loss as keras_loss
from keras.src.metrics import reduction_metrics
from keras.src.trainers import trainer as keras_trainer

from keras_dist import _compat
from keras_dist._runtime import batch_metrics, step_state
from keras_dist._runtime import keras_internals as ki

EXAMPLES = "examples"  # Weighted by the replica's share of the examples (a mean over examples).
DIVISOR = "divisor"  # Weighted by the replica's share of the term's own divisor (tokens, weights).
SUM = "sum"  # Counted as it is (a sum over the examples).

_ORIGINAL = {
    "reduce_weighted_values": keras_loss.reduce_weighted_values,
    "scale_loss_for_distribution": keras_loss.scale_loss_for_distribution,
    "unscale_loss_for_distribution": keras_loss.unscale_loss_for_distribution,
    "mean_update_state": reduction_metrics.Mean.update_state,
    "sum_update_state": reduction_metrics.Sum.update_state,
    "add_loss": keras_layer.Layer.add_loss,
    "get_own_losses": keras_layer.Layer._get_own_losses,
    "clear_losses": keras_layer.Layer._clear_losses,
    "loss_call": keras_loss.Loss.__call__,
    "aggregate_additional_loss": keras_trainer.Trainer._aggregate_additional_loss,
    "compute_average_loss": tf.nn.compute_average_loss,
    "scale_regularization_loss": tf.nn.scale_regularization_loss,
}
# TensorFlow's own (`user_steps` wraps `tf.GradientTape.gradient` for the user's steps at run time).
TAPE_GRADIENT = tf.GradientTape.gradient
_LOSS_DEPTH = threading.local()  # `value`: the `Loss.__call__`s running on this thread (a replica's).
# The body of `Layer.__call__` (under its traceback filter): where Keras adds each activity regularizer's loss.
_LAYER_CALL_CODE = inspect.unwrap(keras_layer.Layer.__call__).__code__
_RECORDS = {}  # id(replica context) -> LossRecord, inside `recording`.
_INSTALL_LOCK = threading.Lock()


@dataclasses.dataclass
class LossTerm:
    """One reduced loss of one replica.

    Attributes:
        value: Float scalar tensor, the reduced loss as one device computes it
            on this replica's examples (non-scalar for `reduction=None`).
        kind: `EXAMPLES`, `DIVISOR` or `SUM`.
        divisor: float32 scalar tensor (for `DIVISOR`): this replica's part of
            the divisor Keras divided by (unmasked elements, or the sample
            weights' sum).
        proportional: Boolean, known when traced: the divisor is the
            replica's examples times a constant (no mask, a static
            per-example shape), so `EXAMPLES` weighting is exact for it.
        ratio: `None`, or the `Ratio` a loss function's own scalar is
            written as (for `DIVISOR`): its share is `ratio.share`.
        parts: `None`, or, for a loss function's scalar that adds ratios of
            sums or sums over the batch to others (`split_ratios`), its
            `(coefficient, term, index)` parts: each ratio is a `DIVISOR`
            term of its own (`index`), each sum a `SUM` term, and this term
            counts the rest by examples.
        global_weights: Boolean: a loss function's scalar times a factor of
            its sample weights (`global_weight_factor`), the global batch's
            factor where the step ran (not in a trace that only inspects).
        own_rows: `None`, or (a `SUM` of a loss function's scalar summed
            over the batch, `summed_terms`) a bool scalar tensor, at run
            time: the rows it sums are this replica's examples; else (a
            gathered global batch, the same on every replica) it counts by
            the example share.
        weight_factor: `None`, or (`global_weights` where the step ran) the
            float32 scalar the term's `parts` were multiplied by.
    """

    value: object
    kind: str
    divisor: object = None
    proportional: bool = False
    ratio: object = None
    parts: object = None
    global_weights: bool = False
    own_rows: object = None
    weight_factor: object = None

    @property
    def weighted_by_examples(self):
        return self.kind == EXAMPLES or (self.kind == DIVISOR and self.proportional)


@dataclasses.dataclass
class TrackerUpdate:
    """A per-output loss tracker (`keras.metrics.Mean`) Keras updates in `CompileLoss`, with its state before."""

    tracker: object
    term: int  # Index in `LossRecord.terms` of the loss it tracks, or -1.
    total: object
    count: object


@dataclasses.dataclass
class OwnTrackerUpdate:
    """A scalar `keras.metrics.Mean` or `Sum` `update_state(value)` of the model's own code in keras-dist's step, with the state before.

    Keras' `compute_loss` docstring overrides it with such a tracker. `count`
    is `None` for a `Sum`. Its
    `terms` are `value`'s (`terms_of`), each `(coefficient, tensor, index)`:
    `index` is the ratio's `LossTerm` in the record, or `None`.
    """

    tracker: object
    terms: list
    total: object
    count: object


@dataclasses.dataclass
class LossRecord:
    """What `recording` saw: the loss terms in order, and the per-output and own tracker updates."""

    model: object
    terms: list = dataclasses.field(default_factory=list)
    trackers: list = dataclasses.field(default_factory=list)
    tape: object = None
    own_trackers: list = dataclasses.field(default_factory=list)
    # A ratio's tensor name (a sum's `("sum", name)`, `_sum_index`) -> its index in `terms`.
    ratio_terms: dict = dataclasses.field(default_factory=dict)
    inspecting: bool = False  # A trace that is never run (`steps.compiled_forward_backward`): no collective in it.

    def all_weighted_by_examples(self):
        """Whether every term is a mean over examples and no tracker needs the global batch."""
        return not self.trackers and not self.own_trackers and all(t.weighted_by_examples for t in self.terms)


def _install():
    batch_metrics.install()
    with _INSTALL_LOCK:
        if keras_loss.reduce_weighted_values is not _recording_reduce_weighted_values:
            keras_loss.reduce_weighted_values = _recording_reduce_weighted_values
            keras_loss.scale_loss_for_distribution = _scale_loss_for_distribution
            keras_loss.unscale_loss_for_distribution = _unscale_loss_for_distribution
            reduction_metrics.Mean.update_state = _mean_update_state
            reduction_metrics.Sum.update_state = _sum_update_state
            keras_layer.Layer.add_loss = _recording_add_loss
            keras_layer.Layer._get_own_losses = _replica_get_own_losses
            keras_layer.Layer._clear_losses = _replica_clear_losses
            keras_loss.Loss.__call__ = _counting_loss_call
            keras_trainer.Trainer._aggregate_additional_loss = _recording_aggregate_additional_loss
            tf.nn.compute_average_loss = _compute_average_loss
            tf.nn.scale_regularization_loss = _scale_regularization_loss


def one_device_scaling_installed():
    """Installs the dispatchers (idempotent): inside a keras-dist step, Keras' distribution scaling is off."""
    _install()


def _scale_loss_for_distribution(value):
    if step_state.current() is not None:
        return value
    return _ORIGINAL["scale_loss_for_distribution"](value)


def _compute_average_loss(per_example_loss, sample_weight=None, global_batch_size=None):
    """`tf.nn.compute_average_loss`; inside a keras-dist step, without `global_batch_size`, this replica's mean.

    TensorFlow's custom-training guide divides each replica's sum by its rows
    times `num_replicas_in_sync` (the default `global_batch_size`): one device
    divides by its rows. keras-dist weights each replica's loss by its share
    of the examples itself (as Keras' `scale_loss_for_distribution`, off here),
    so the replicas' count came in twice: a third of one device's loss and
    gradient on 3 replicas (a new-user probe, in a compiled loss function and
    in a `train_step`). With `global_batch_size` given, the sum over it is read
    as a sum over the batch (`summed_examples`), unchanged.
    """
    if global_batch_size is None and step_state.current() is not None:
        rows = tf.shape(ops.convert_to_tensor(per_example_loss))[0]
        return _ORIGINAL["compute_average_loss"](per_example_loss, sample_weight, global_batch_size=rows)
    return _ORIGINAL["compute_average_loss"](per_example_loss, sample_weight, global_batch_size=global_batch_size)


def _scale_regularization_loss(regularization_loss):
    """`tf.nn.scale_regularization_loss`; inside a keras-dist step, the sum, as one device's (not over the replicas)."""
    if step_state.current() is not None:
        return tf.reduce_sum(regularization_loss)
    return _ORIGINAL["scale_regularization_loss"](regularization_loss)


def _unscale_loss_for_distribution(value):
    if step_state.current() is None:
        return _ORIGINAL["unscale_loss_for_distribution"](value)
    record = _RECORDS.get(step_state.replica_key())
    if record is not None:
        _note_tracker(record)
    return value


def _mean_update_state(self, values, sample_weight=None):
    """`keras.metrics.Mean.update_state`; in a step on several replicas, a scalar (one weight or none) counts by its share.

    On one device a loss tracker gains the batch's loss and a count of one per
    batch. On a replica it gains `replicas x share x value` with weight
    `1 / replicas`: summed over the replicas (Keras' epoch logs) that is the
    global batch's mean of the values with a count of one, and so is the mean
    over the replicas of each replica's result (the logs a step returns).
    A ratio of sums (`ratio_share`) counts by its share of the denominator,
    a sum over the examples (`update_state(ops.sum(correct))`) once, and a
    sum of such terms and others (`linear_ratio_terms`) counts each term by
    its own share (`shared_value`). A vector that is not one row per example
    (a count per class, `ops.sum(one_hot, axis=0)`; a mean per column) counts
    the same way, entry by entry (`shared_tensor`): each replica added its
    own entries and a count of them, 1/N of one device's mean for the counts
    (a new-user probe, stop 51). Rows are Keras' own update. In keras-dist's
    own step, an update while the loss is recorded (an overridden
    `compute_loss`) gets the global value with the loss's shares
    (`update_own_trackers`), one after it (an overridden `compute_metrics`)
    counts as in a user's step.
    """
    original = _ORIGINAL["mean_update_state"]
    step = step_state.current()
    if step is None or type(self).update_state is not _mean_update_state:
        return original(self, values, sample_weight)
    weight = _one_weight(sample_weight, self.dtype, step)
    if sample_weight is not None and (weight is None or not step.user_step):
        return original(self, values, sample_weight)  # Weights per example: Keras' own update of the rows.
    if not step.user_step and _noted_in_own_step(self, values):
        return original(self, values, sample_weight)
    values = tf.convert_to_tensor(values)
    num_replicas = tf.distribute.get_replica_context().num_replicas_in_sync
    if num_replicas == 1 or values.shape.rank is None or per_example(values, step):
        return original(self, values, sample_weight)  # Rows: each replica adds its own, and counts them.
    _count_global_examples(step)
    values = _global_if_extreme(values, step)
    share = shared_value if values.shape.rank == 0 else shared_tensor
    value = share(tf.cast(values, self.dtype), step, self.dtype)
    weight = tf.constant(1.0, self.dtype) if weight is None else weight
    return original(self, value * num_replicas, sample_weight=weight / num_replicas)


def _one_weight(sample_weight, dtype, step):
    """`sample_weight` as a `dtype` scalar where it is one number for the whole global batch, else `None`.

    A Python number (`sample_weight=1.0`), or a scalar tensor computed from
    none of the batch's tensors (a constant, the step count), which every
    replica holds alike. One device's `Mean` gains `weight x value` and a
    count of `weight`; a replica then gains its share of that, as without a
    weight (a new-user probe, stop 51: `update_state(loss, sample_weight=1.0)`
    in a step of one's own logged the replicas' values averaged, 6.48 vs
    6.53). Not a scalar computed from the batch, such as the row count Keras'
    own `train_step` weights its loss tracker by: that is each replica's own.
    """
    if sample_weight is None or isinstance(sample_weight, bool):
        return None
    if isinstance(sample_weight, (int, float)):
        return tf.constant(float(sample_weight), dtype)
    if not tf.is_tensor(sample_weight) or sample_weight.shape.rank != 0:
        return None
    if tf.get_static_value(sample_weight) is not None:
        return tf.cast(sample_weight, dtype)
    indices = {t.name: i for i, t in enumerate(step.data_leaves) if isinstance(t, tf.Tensor)}
    if not indices or not hasattr(sample_weight, "op"):
        return None
    found, complete = _leaves_above(sample_weight, indices, set())
    return tf.cast(sample_weight, dtype) if complete and not found else None


def _sum_update_state(self, values, sample_weight=None):
    """`keras.metrics.Sum.update_state`; in a step on several replicas, a value that is not one row per example counts by its share.

    On one device a `Sum` gains the global batch's value. Its state is summed
    over the replicas, so each replica adds its share: a scalar term by term
    (`shared_value`: a loss by its share of the examples or of its divisor, a
    sum over the examples once, a value alike on every replica, such as
    `optimizer.iterations`, by the example share, whose sum is 1), any other
    tensor by `shared_tensor`; a tensor with one row per example (each
    replica holds its own rows) as it is. Before, a `Sum` of `compute_loss`'
    value or of the step count read 2x one device's on 2 replicas (a new-user
    probe, stop 50). In keras-dist's own step, an update while the loss is
    recorded (an overridden `compute_loss`) gets the global value with the
    loss's shares (`update_own_trackers`), one after it (an overridden
    `compute_metrics`) counts as in a user's step. With `sample_weight`,
    Keras' own update (a weighted sum of rows).
    """
    original = _ORIGINAL["sum_update_state"]
    step = step_state.current()
    if step is None or sample_weight is not None or type(self).update_state is not _sum_update_state:
        return original(self, values, sample_weight)
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return original(self, values, sample_weight)
    if not step.user_step and _noted_in_own_step(self, values):
        return original(self, values, sample_weight)
    values = tf.cast(tf.convert_to_tensor(values), self.dtype)
    if values.shape.rank != 0 and (values.shape.rank is None or per_example(values, step)):
        return original(self, values, sample_weight)  # Rows: each replica adds its own.
    _count_global_examples(step)
    values = _global_if_extreme(values, step)
    share = shared_value if values.shape.rank == 0 else shared_tensor
    return original(self, share(values, step, self.dtype))


def _global_if_extreme(values, step):
    """`values`, or the global batch's where it is a largest or smallest entry of the batch's values (`global_extreme`).

    A tracker of `ops.max(abs_error)` gained each replica's maximum, by its
    share: the replicas' maxima averaged, not the batch's (a new-user probe,
    stop 51: 3.81 against 4.31).
    """
    extreme = global_extreme(values, step)
    return values if extreme is None else tf.cast(extreme, values.dtype)


def _noted_in_own_step(tracker, values):
    """In keras-dist's own step: notes `tracker`'s update for `update_own_trackers` where the loss is being recorded.

    Returns whether it was left to Keras' own update (to be given the global
    value there, or not a tracker of the model's own). Outside the loss's
    recording (an overridden `compute_metrics`, after `apply`) it returns
    `False`: the update counts by its share as in a user's step (a new-user
    probe, stop 51: a `Mean` of a batch's MAE there was 1e-2 off on uneven
    splits, a `Sum` of the loss in `compute_loss` 2x one device's).
    """
    record = _RECORDS.get(step_state.replica_key())
    if record is None:
        return False
    _note_own_tracker(record, tracker, values)
    return True


def _count_global_examples(step):
    """Sets `step.global_examples` where the step has not counted them yet (one small all-reduce)."""
    if step.global_examples is None:
        count = tf.reshape(tf.cast(step.num_examples, tf.float32), [1])
        context = tf.distribute.get_replica_context()
        step.global_examples = tf.stop_gradient(
            context.all_reduce(tf.distribute.ReduceOp.SUM, count, options=step.options)
        )[0]


def _note_own_tracker(record, tracker, values):
    """Notes a scalar update of a `Mean` tracker of the model's own in keras-dist's step (`OwnTrackerUpdate`).

    On one device the tracker gains the global batch's value and a count of
    one; here each replica would gain its own value and a count of one, so
    the logs were the mean of the replicas' values (a new-user probe: 3.6e-3
    off on uneven splits, NaN with a replica without examples).
    `update_own_trackers` gives it the global value once the step has the
    shares. Keras' own trackers (the total loss's, the compiled losses') are
    given theirs elsewhere.
    """
    values = tf.convert_to_tensor(values)
    model = record.model
    keras_trackers = [
        getattr(model, "_loss_tracker", None),
        *getattr(getattr(model, "_compile_loss", None), "metrics", []),
    ]
    if values.shape.rank != 0 or any(tracker is t for t in keras_trackers):
        return
    if tf.distribute.get_replica_context().num_replicas_in_sync == 1:
        return
    terms = [(coefficient, term, _ratio_index(record, term)) for coefficient, term in terms_of(values)]
    count = getattr(tracker, "count", None)  # A `Sum` has none.
    before = (tf.convert_to_tensor(tracker.total.value), None if count is None else tf.convert_to_tensor(count.value))
    record.own_trackers.append(OwnTrackerUpdate(tracker, terms, *before))


def _ratio_index(record, tensor):
    """The index in `record.terms` of `tensor`'s `DIVISOR` term when it is a ratio (`ratio_of`), added once; else `None`.

    The term's value is the ratio recomputed without NaN (`ratio_without_nan`),
    watched by the record's tape: `own_ratios` builds the loss from it.
    """
    ratio = ratio_of(tensor)
    if ratio is None:
        return None
    name = tensor.name
    if name not in record.ratio_terms:
        safe = ratio_without_nan(tensor)
        if record.tape is not None:
            record.tape.watch(safe)
        record.terms.append(LossTerm(safe, DIVISOR, ratio.divisor, proportional=False, ratio=ratio))
        record.ratio_terms[name] = len(record.terms) - 1
    return record.ratio_terms[name]


def _split_index(record, tensor):
    """`_ratio_index(record, tensor)`, else `_sum_index(record, tensor)`: the index of its recorded term, or `None`."""
    index = _ratio_index(record, tensor)
    return index if index is not None else _sum_index(record, tensor)


def _sum_index(record, tensor):
    """The index in `record.terms` of `tensor`'s `SUM` term where it is a sum over the examples, added once; else `None`.

    The term's value is a copy of `tensor` watched by the record's tape, counted
    once per replica where it sums this replica's rows (a gathered global batch
    by the example share, `LossTerm.own_rows`).
    """
    step = step_state.current()
    summed = summed_examples(tensor, step) if step is not None else None
    if summed is None:
        return None
    key = ("sum", tensor.name)
    if key not in record.ratio_terms:
        value = tf.identity(tensor)
        if record.tape is not None:
            record.tape.watch(value)
        record.terms.append(LossTerm(value, SUM, own_rows=_this_replicas_rows(summed, step)))
        record.ratio_terms[key] = len(record.terms) - 1
    return record.ratio_terms[key]


def own_ratios(record, total):
    """`total`, the loss a `compute_loss` of the model's own returned, with its ratios of sums recorded as terms.

    Keras records nothing of a loss an overridden `compute_loss` computes
    itself (no Keras reduction runs): `sum(ce * mask) / sum(mask)` there was
    counted by examples (a new-user probe: weights 7.7e-2 off). Its ratios,
    alone or in a sum (`linear_ratio_terms`), are recorded as `DIVISOR`
    terms, and the returned loss is rebuilt from them (the same value, 0
    where a replica kept nothing, not NaN), so that the step weights each by
    its own share. Left as it is where Keras recorded terms itself (the
    override calls Keras' `compute_loss`), or where no ratio is found.

    Args:
        record: The step's `LossRecord` (inside `recording`).
        total: The loss `compute_loss` returned (a tensor).

    Returns:
        A scalar tensor of `total`'s dtype, or `total`.
    """
    if record.tape is None or not tf.is_tensor(total) or total.shape.rank != 0 or not hasattr(total, "op"):
        return total
    if len(record.terms) != len(record.ratio_terms):
        return total  # Keras recorded terms: the compiled loss, reduced by Keras.
    parts = [(coefficient, term, _ratio_index(record, term)) for coefficient, term in terms_of(total)]
    if all(index is None for _, _, index in parts):
        return total
    return _rebuilt(record, parts, total.dtype)


def _rebuilt(record, parts, dtype):
    """`sum(coefficient x term)` over `parts` (`(coefficient, term, index)`), each ratio its recorded term's value."""
    values = [term if index is None else record.terms[index].value for _, term, index in parts]
    return tf.add_n([tf.cast(c * tf.cast(v, dtype), dtype) for (c, _, _), v in zip(parts, values)])


def _part_value(record, part, shares, example_share, dtype, *, through_terms=False):
    """`coefficient x term x share` of one part (`(coefficient, term, index)`): a ratio by its own share.

    With `through_terms`, a part that is not a ratio itself but is computed
    from terms the record holds (a tracker of `super().compute_loss(...)`'s
    result: the compiled loss's masked mean) counts each such term by that
    term's share, the rest by the examples (`_by_recorded_shares`).
    """
    coefficient, term, index = part
    if index is None:
        if through_terms:
            return coefficient * _by_recorded_shares(record, term, example_share, shares, dtype)
        return coefficient * _times_share(term, example_share, dtype)
    return coefficient * _times_share(record.terms[index].value, shares[index], dtype)


def _by_recorded_shares(record, value, example_share, shares, dtype):
    """This replica's part of scalar `value`'s global value: `example_share x value`, each recorded term by its share.

    `value` is linear in the record's terms (as a loss is in its terms):
    `(share_i - example_share) x d value / d term_i x term_i` is added for
    each term not weighted by examples, as `global_surrogate` weights the
    loss. Summed over the replicas it is the global batch's value. A part
    whose share is 0 (no examples, no kept entries) adds 0, not 0 x NaN.
    """
    adjust = [(i, t) for i, t in enumerate(record.terms) if not t.weighted_by_examples]
    result = _times_share(value, example_share, dtype)
    if not adjust or record.tape is None:
        return result
    zero = tf.UnconnectedGradients.ZERO
    weights = TAPE_GRADIENT(record.tape, value, [t.value for _, t in adjust], unconnected_gradients=zero)
    for (i, term), weight in zip(adjust, weights):
        weighted = tf.reduce_sum(tf.stop_gradient(tf.cast(weight, dtype)) * tf.cast(term.value, dtype))
        result += _times_share(weighted, shares[i], dtype) - _times_share(weighted, example_share, dtype)
    return result


def _times_share(value, share, dtype):
    """`value x share` (scalars, as `dtype`); 0 where the share is 0 (no examples, no tokens kept: 0 / 0 there)."""
    kept = tf.where(tf.not_equal(share, 0), tf.cast(value, dtype), tf.zeros([], dtype))
    return kept * tf.cast(share, dtype)


def update_own_trackers(record, example_share, shares, num_replicas):
    """Gives each `OwnTrackerUpdate` this batch's global value: `total += share-weighted value`, a `Mean`'s `count += 1 / replicas`.

    Each term counts by its share (a ratio's of its denominator, every other
    term's of the examples; a value computed from the compiled loss's terms,
    such as `super().compute_loss(...)`'s result, by those terms' shares);
    summed over the replicas the tracker gains the global batch's value and a
    count of one, as on one device (the compiled masked loss's tracker was
    4.3e-2 off, counted by examples, before).
    """
    for update in record.own_trackers:
        dtype = update.tracker.total.dtype
        value = tf.add_n(
            [_part_value(record, part, shares, example_share, dtype, through_terms=True) for part in update.terms]
        )
        update.tracker.total.assign(update.total + value)
        if update.count is not None:  # A `Mean`'s count of one batch; a `Sum` has none.
            update.tracker.count.assign(update.count + tf.cast(1.0 / num_replicas, update.tracker.count.dtype))


def terms_of(value):
    """`[(coefficient, term), ...]` summing to `value` (a scalar tensor): its ratios apart (`linear_ratio_terms`), else itself."""
    return linear_ratio_terms(value) or [(1.0, value)]


def term_share(term, step):
    """`(share, own)`: this replica's share of a scalar `term` of a user's step; `own` unless it is the example share.

    A ratio of sums counts by its share of the denominator (`ratio_share`); a
    sum over the examples (`summed_examples`) counts once, as each
    replica's part of the global batch's sum (share 1; by the example share
    where, at run time, it sums more rows than this replica's: a gathered
    global batch); a
    value computed from a tensor of the batch other than the one the examples
    are counted from, and not from that one (the unlabelled half of a batch
    zipping two datasets of other batch sizes), by its share of that tensor's
    rows (`_data_leaf_of`); a value over the rows of several such tensors
    concatenated (one forward pass over both parts) by their rows together;
    anything else by the example share.
    """
    ratio = ratio_share(term, step)
    if ratio is not None:
        return ratio, True
    summed = summed_examples(term, step)
    if summed is not None:
        return _sum_share(summed, step), True
    index = _data_leaf_of(term, step)
    if index is not None:
        return step.leaf_share(index), True
    return step.example_share(), False


def summed_examples(term, step):
    """The per-example tensor scalar `term` is the `Sum` of (through casts), where it is a sum over the examples; else `None`.

    keras.io and public scripts write a loss or a logged count as
    `ops.sum(per_example_values)` (a count of correct predictions, a sum of
    squared errors, TensorFlow's `tf.reduce_sum(loss) / GLOBAL_BATCH_SIZE`).
    One device's value is the global batch's sum: each replica's sum counts
    once, not by its share of the examples. The summed tensor's leading
    dimension is the batch's (`per_example`) and it is computed from the
    step's batch (read from the traced graph): a weight penalty
    `ops.sum(ops.square(kernel))` whose kernel has as many rows as a static
    per-replica batch is not (it was counted once per replica, 4.2e-2 off).
    """
    if not tf.is_tensor(term) or term.shape.rank != 0 or not hasattr(term, "op"):
        return None
    summed = _rows_counted(term)
    if summed is None:
        reduction = _batch_reduction(term)
        if reduction is None:
            return None
        # The sum over the batch axis first, then the rest (`ops.mean(ops.sum(loss, axis=0))`: per time step).
        summed = reduction[1] if reduction[0] == "Sum" else None
        if reduction[0] == "Mean" or not per_example(reduction[1], step):
            summed = _summed_over_batch_axis(reduction[1])
    return summed if summed is not None and _from_the_batch(summed, step) else None


def summed_terms(value, step):
    """The tensors scalar `value` sums the rows of, where each of its terms is a sum over the examples; else `None`.

    A compiled loss function returning `ops.sum(squared_errors)`, or
    TensorFlow's `tf.reduce_sum(loss) / GLOBAL_BATCH_SIZE`: read as a sum of
    terms (`linear_terms`: `+`, `-`, products and quotients by constants),
    each a sum over the examples (`summed_examples`). One device's value is
    the global batch's, so each replica's counts once (it was counted by the
    example share, and the first-batch check warned: 0.15 off in the kernel
    on 3 replicas). `None` where a term is anything else (a mean, a
    constant), eagerly, or where `value` is no scalar tensor.

    Args:
        value: A scalar tensor (the loss function's value), or anything else.
        step: The `step_state.ReplicaStep` running (its `data_leaves`).

    Returns:
        A list of the summed tensors (each with one row per example), or `None`.
    """
    terms = linear_terms(value)
    if not terms:
        return None
    summed = [summed_examples(term, step) for _, term in terms]
    return summed if all(t is not None for t in summed) else None


def _from_the_batch(tensor, step):
    """Whether `tensor` has one row per example (`per_example`) and is computed from the step's batch (its graph)."""
    if not per_example(tensor, step):
        return False
    indices = {t.name: i for i, t in enumerate(step.data_leaves) if isinstance(t, tf.Tensor)}
    found, _ = _leaves_above(tensor, indices, set()) if indices else (set(), True)
    return bool(found)


def _sum_share(summed, step):
    """float32 scalar: the share of a sum over `summed`'s rows: 1 where they are this replica's examples.

    At run time: a sum over the gathered global batch (`keras_dist.ops.all_gather`:
    TFRS' in-batch softmax, corpus c24) has one value per global example, the
    same on every replica: by the example share.
    """
    return tf.where(_this_replicas_rows(summed, step), tf.constant(1.0), step.example_share())


def _this_replicas_rows(tensor, step):
    """bool scalar, at run time: `tensor` has as many rows as this replica has examples (not a gathered batch)."""
    return tf.equal(tf.shape(tensor, out_type=tf.int32)[0], tf.cast(step.num_examples, tf.int32))


def batch_sum_parts(value, step, dtype):
    """`(summed, rest)`, `value`'s terms that are sums over this replica's examples and the others (as `dtype`); or `None`.

    `value` (a tensor of any shape) is read as a sum of terms through `+`,
    `-`, negation and products or quotients by a constant (the graph, when
    traced). A term is a sum over the examples where it is a `Sum` over the
    batch axis (`ops.sum(x, axis=0)`, or over every axis: `summed_examples`)
    of a tensor computed from the step's batch, or its count of rows
    (`ops.shape(x)[0]`), and those rows are this replica's examples (at run
    time: not a gathered global batch). `summed` and `rest` broadcast to
    `value`'s shape and add up to it. `None` where no term is such a sum,
    eagerly, or outside a step.
    """
    if step is None or not hasattr(value, "op") or value.shape.rank is None:
        return None
    terms = []
    if not _tensor_terms(value, 1.0, terms):
        return None
    sums = [(c, t, _batch_sum(t, step)) for c, t in terms]
    if all(summed is None for _, _, summed in sums):
        return None
    shape = tf.shape(value)
    summed, rest = tf.zeros(shape, dtype), tf.zeros(shape, dtype)
    for coefficient, term, rows in sums:
        term = tf.cast(coefficient, dtype) * tf.cast(term, dtype)
        if rows is None:
            rest += term
            continue
        mine = _this_replicas_rows(rows, step)
        summed += tf.where(mine, term, tf.zeros_like(term))
        rest += tf.where(mine, tf.zeros_like(term), term)
    return summed, rest


def _batch_sum(term, step):
    """The tensor whose rows `term` sums (`batch_sum_parts`), or `None`."""
    if term.shape.rank == 0:
        return summed_examples(term, step)
    summed = _summed_over_batch_axis(term)
    return summed if summed is not None and _from_the_batch(summed, step) else None


def _tensor_terms(tensor, coefficient, terms):
    """`_linear_terms` for a tensor of any shape: appends its terms (broadcasting to it); False past `_LINEAR_TERMS_MAX`."""
    if len(terms) >= _LINEAR_TERMS_MAX:
        return False
    op = _through(tensor.op)
    parts = _linear_parts(op) if op is not None else None
    if parts is None:
        terms.append((coefficient, tensor))
        return True
    return all(_tensor_terms(t, coefficient * factor, terms) for factor, t in parts)


def _linear_parts(op):
    """`[(factor, input), ...]` summing to `op`'s output: `+`, `-`, `add_n`, negation, a product or quotient by a constant; else `None`."""
    inputs = list(op.inputs)
    if op.type in ("AddV2", "Add", "AddN"):
        return [(1.0, t) for t in inputs]
    if op.type == "Sub" and len(inputs) == 2:
        return [(1.0, inputs[0]), (-1.0, inputs[1])]
    if op.type == "Neg" and len(inputs) == 1:
        return [(-1.0, inputs[0])]
    constants = [_scalar_constant(t) for t in inputs] if len(inputs) == 2 else [None, None]
    if op.type == "Mul" and (constants[0] is None) != (constants[1] is None):
        return [(constants[0], inputs[1])] if constants[0] is not None else [(constants[1], inputs[0])]
    if op.type in _DIVISIONS and constants[0] is None and constants[1]:
        return [(1.0 / constants[1], inputs[0])]
    return None


_EXTREMES = {"Max": tf.reduce_max, "Min": tf.reduce_min}


def global_extreme(value, step):
    """The global batch's value of scalar `value`, a largest or smallest entry of the batch's values; else `None`.

    A step that returns `ops.max(abs_error)` (a new-user probe: Keras'
    average over the replicas of each one's maximum, 9.36 against 7.81 on
    even splits): a `Max` or `Min` (through casts) over every entry of a
    tensor with a row per example computed from the step's batch. Each
    replica's value is gathered (one `all_gather` of a scalar) and reduced
    again, so every replica holds the global one. A replica without
    examples holds the reduction's identity (the lowest or highest number),
    which the second reduction passes over. Read from the traced graph;
    eagerly, `None`.
    """
    if not tf.is_tensor(value) or value.shape.rank != 0 or not hasattr(value, "op"):
        return None
    op = _through(value.op)
    if op is None or op.type not in _EXTREMES or not op.inputs:
        return None
    reduced = op.inputs[0]
    if reduced.shape.rank is None or reduced.shape.rank < 1 or not _from_the_batch(reduced, step):
        return None
    context = tf.distribute.get_replica_context()
    gathered = context.all_gather(tf.reshape(value, [1]), axis=0, options=step.options)
    return _EXTREMES[op.type](gathered)


def shared_tensor(value, step, dtype):
    """`value`, a tensor of rank >= 1 a user's step returns, times this replica's share of it, as `dtype`.

    A sum over the batch axis of a tensor computed from the batch (a count
    per class, `ops.sum(correct, axis=0)`) counts once (`_sum_share`); any
    other (a mean per column over the examples, `ops.mean(sq, axis=0)`) by
    the example share, which also gives one device's value for one that is
    the same on every replica (the shares add up to 1). A value with one row
    per example is returned as it is. Summed over the replicas: one device's
    value of the global batch (a new-user probe: a per-column mean was each
    replica's mean averaged, 0.52 against 0.59 on uneven replicas).
    """
    if per_example(value, step):
        return value
    summed = _batch_sum(value, step) if hasattr(value, "op") else None
    share = _sum_share(summed, step) if summed is not None else step.example_share()
    return _times_share(value, share, dtype)


def _summed_over_batch_axis(tensor):
    """The tensor `tensor` is the `Sum` over the leading (batch) axis of, among others (through casts); else `None`."""
    op = _through(tensor.op)
    if op is None or op.type != "Sum" or len(op.inputs) != 2:
        return None
    summed, axes = op.inputs
    axes = tf.get_static_value(axes)
    rank = summed.shape.rank
    if axes is None or rank is None or rank < 1:
        return None
    return summed if 0 in {int(a) % rank for a in np.ravel(axes)} else None


def _rows_counted(term):
    """The tensor whose rows scalar `term` counts (`ops.shape(x)[0]`, through casts), or `None`.

    The count of a replica's examples is the sum over them of 1: one device's
    is the global batch's count (a `Mean` tracker of the rows per batch).
    """
    op = _through(term.op)
    if op is None or op.type != "StridedSlice" or len(op.inputs) != 4:
        return None
    shape = _through(op.inputs[0].op)
    begin = tf.get_static_value(op.inputs[1])
    if shape is None or shape.type != "Shape" or begin is None or np.ravel(begin).tolist() != [0]:
        return None
    return shape.inputs[0]


def shared_value(value, step, dtype):
    """Scalar `value` of a user's step times this replica's share of it, term by term (`user_terms`, `term_share`), as `dtype`.

    Summed over the replicas, that is one device's value of the global batch
    (0 where a term's share is 0: a replica without examples).
    """
    return tf.add_n([c * _times_share(term, term_share(term, step)[0], dtype) for c, term in user_terms(value, step)])


def user_terms(value, step):
    """The terms a scalar `value` of a user's step counts by (`linear_terms`), where one has a share of its own; else `[(1.0, value)]`."""
    terms = linear_terms(value)
    if terms and any(term_share(term, step)[1] for _, term in terms):
        return terms
    return [(1.0, value)]


_ANCESTRY_LIMIT = 100_000  # Operations walked back from one value, at most.


def _data_leaf_of(value, step):
    """The index in `step.data_leaves` of the tensor of the batch `value` is computed from, or `None`.

    `None` where that is the tensor the examples are counted from (or it is
    one of several `value` is computed from), where `value` comes from none
    (a weight penalty), or outside a user's step. Read from the graph when
    traced (walking back from `value` to the batch's tensors), once per
    value; eagerly, `None`.
    """
    leaves = step.data_leaves
    if not leaves or step.example_leaf is None or step.leaf_counts is None or not hasattr(value, "op"):
        return None
    cached = step.leaves_of.get(id(value))
    if cached is not None and cached[0] is value:
        return cached[1]
    indices = {t.name: i for i, t in enumerate(leaves) if isinstance(t, tf.Tensor)}  # Not ragged or sparse ones.
    # Not through keras-dist's own counts (`compute_loss` in a step of one's own is 0 where the batch's first
    # tensor has no rows): read from that tensor, they would tie any value to it (a probe: `self.compute_loss`
    # on the labelled part of a batch whose unlabelled part comes first, weights 7.3e-2 off).
    counts = (step.num_examples, step.global_examples, step.leaf_counts, step.global_leaf_counts)
    skipped = {t.op.name for t in counts if isinstance(t, tf.Tensor) and hasattr(t, "op")}
    joined = _joined_leaves(value, indices, skipped)
    if joined is not None:
        step.leaves_of[id(value)] = (value, joined)
        return joined
    found, complete = _leaves_above(value, indices, skipped)
    index = None if not found or step.example_leaf in found or not complete else min(found)
    step.leaves_of[id(value)] = (value, index)
    return index


def _leaves_above(value, indices, skipped):
    """`(found, complete)`: the indices (`indices`: tensor name -> index) of the leaves `value` is computed from.

    Walks the traced graph back from `value`, not through the operations named
    in `skipped`; `complete` is False where it stopped at `_ANCESTRY_LIMIT`.
    """
    seen, found, pending = set(skipped), set(), [value]
    while pending and len(seen) < _ANCESTRY_LIMIT:
        tensor = pending.pop()
        if tensor.name in indices:
            found.add(indices[tensor.name])
            continue
        if tensor.op.name not in seen:
            seen.add(tensor.op.name)
            pending.extend(tensor.op.inputs)
    return found, not pending


_CONCATENATIONS = {"ConcatV2": -1, "Concat": 0}  # Operation type -> the position of its `axis` input.


def _joined_leaves(value, indices, skipped):
    """The tuple of leaves whose rows `value` is computed over, joined by one concatenation along the rows; or `None`.

    A new-user probe: a step running one forward pass over
    `concatenate([labelled, unlabelled])` and taking the mean of all its rows
    counted that mean by the labelled part's rows (weights 7e-3 off on an
    uneven last batch). Found by walking back from `value` only through
    operations that keep every row (`_row_keeping_inputs`) to a
    concatenation along axis 0 whose inputs come from one leaf each, from at
    least two leaves; or to a slice or split of such a concatenation that
    takes whole parts back out (`_selected_leaves`: `both[n:]`, a 1-tuple
    there). Any other row selection on the way ends the walk there: such a
    value is read as before (`_leaves_above`).
    """
    seen, joined, pending = set(skipped), set(), [value]
    while pending and len(seen) < _ANCESTRY_LIMIT:
        tensor = pending.pop()
        op = tensor.op
        key = op.name if len(op.outputs) == 1 else tensor.name  # A split's outputs hold other rows.
        if tensor.name in indices or key in seen:
            continue
        seen.add(key)
        leaves = _concatenated_leaves(op, indices, skipped)
        if leaves is not None and len(set(leaves)) > 1:
            joined.add(tuple(sorted(set(leaves))))
            continue
        selected = _selected_leaves(tensor, indices, skipped)
        if selected is not None:
            joined.add(selected)
            continue
        pending.extend(_row_keeping_inputs(op))
    if pending or len(joined) != 1:
        return None
    return joined.pop()


def _concatenated_leaves(op, indices, skipped):
    """The leaf of each tensor `op` concatenates along the rows, in order, where each comes from one leaf; else `None`."""
    parts = _row_concatenation_parts(op)
    if parts is None:
        return None
    leaves = []
    for part in parts:
        found, complete = _leaves_above(part, indices, skipped)
        if not complete or len(found) != 1:
            return None
        leaves.append(next(iter(found)))
    return leaves


def _concatenation_below(tensor, indices, skipped):
    """`_concatenated_leaves` of the one row concatenation `tensor` holds every row of (through row-keeping operations)."""
    seen, found, pending = set(skipped), [], [tensor]
    while pending and len(seen) < _ANCESTRY_LIMIT:
        current = pending.pop()
        if current.name in indices or current.op.name in seen:
            continue
        seen.add(current.op.name)
        leaves = _concatenated_leaves(current.op, indices, skipped)
        if leaves is not None:
            found.append(leaves)
            continue
        pending.extend(_row_keeping_inputs(current.op))
    return found[0] if len(found) == 1 and not pending else None


def _selected_leaves(tensor, indices, skipped):
    """The leaves of the whole parts of a row concatenation that `tensor` slices or splits back out, or `None`.

    `both[n:]`, `both[:n]` and `tf.split(both, [n, m])` where `both`
    concatenates the batch's parts along the rows and `n` is the first part's
    row count (`ops.shape(part)[0]`): a probe's FixMatch-style step counted
    the unlabelled rows' mean by the labelled part's rows (1.9e-2 off).
    """
    op = tensor.op
    if op.type not in ("StridedSlice", "SplitV") or (op.type == "StridedSlice" and _strided_slice_keeps_rows(op)):
        return None
    leaves = _concatenation_below(op.inputs[0], indices, skipped)
    if leaves is None:
        return None
    if op.type == "SplitV":
        if tf.get_static_value(op.inputs[2]) != 0 or op.inputs[1].op.type != "Pack":
            return None
        sizes, index = list(op.inputs[1].op.inputs), tensor.value_index
        bounds = [_leading_parts(size, leaves[j : j + 1], indices, skipped) for j, size in enumerate(sizes[:index])]
        if len(sizes) != len(leaves) or any(b != 1 for b in bounds):
            return None
        return (leaves[index],)
    try:
        masks = {name: op.get_attr(name) for name in ("begin_mask", "end_mask", "shrink_axis_mask", "new_axis_mask")}
    except ValueError:
        return None
    strides = tf.get_static_value(op.inputs[3])
    if masks["shrink_axis_mask"] & 1 or masks["new_axis_mask"] & 1 or strides is None or strides[0] != 1:
        return None
    begin = 0 if masks["begin_mask"] & 1 else _slice_bound(op.inputs[1], leaves, indices, skipped)
    end = len(leaves) if masks["end_mask"] & 1 else _slice_bound(op.inputs[2], leaves, indices, skipped)
    if begin is None or end is None or not 0 <= begin < end <= len(leaves):
        return None
    return tuple(sorted(set(leaves[begin:end])))


def _slice_bound(vector, leaves, indices, skipped):
    """How many leading parts the first entry of a slice's begin or end `vector` closes, or `None`."""
    static = tf.get_static_value(vector)
    if static is not None:
        return 0 if len(static) and static[0] == 0 else None
    if vector.op.type != "Pack":
        return None
    return _leading_parts(vector.op.inputs[0], leaves, indices, skipped)


def _leading_parts(size, leaves, indices, skipped):
    """1 where scalar `size` is the first of `leaves`' row count (`tf.shape(part)[0]`), else `None`."""
    op = size.op
    if op.type != "StridedSlice" or op.inputs[0].op.type != "Shape" or not op.get_attr("shrink_axis_mask") & 1:
        return None
    begin = tf.get_static_value(op.inputs[1])
    if begin is None or len(begin) != 1 or begin[0] != 0:
        return None
    found, complete = _leaves_above(op.inputs[0].op.inputs[0], indices, skipped)
    return 1 if complete and found == {leaves[0]} else None


def _row_concatenation_parts(op):
    """The tensors `op` concatenates along axis 0 (the rows), or `None`."""
    position = _CONCATENATIONS.get(op.type)
    if position is None:
        return None
    inputs = list(op.inputs)
    axis = tf.get_static_value(inputs[position])
    parts = inputs[:-1] if position == -1 else inputs[1:]
    rank = parts[0].shape.rank if parts else None
    if axis is None or np.ndim(axis) != 0 or rank is None or int(axis) % max(rank, 1) != 0:
        return None
    return parts


def _row_keeping_inputs(op):
    """The inputs of `op` whose every row (leading index) reaches its output: all, except where `op` picks rows.

    A slice or split along the rows picks rows: that input is left out; a
    gather along them (a boolean mask is one) keeps only its indices' rows.
    """
    inputs = list(op.inputs)
    if op.type in ("Split", "SplitV", "Unpack", "DynamicPartition"):
        return []
    if op.type == "StridedSlice":
        return inputs[:1] if _strided_slice_keeps_rows(op) else []
    if op.type == "Slice":
        begin, size = tf.get_static_value(inputs[1]), tf.get_static_value(inputs[2])
        keeps = begin is not None and size is not None and len(begin) and begin[0] == 0 and size[0] == -1
        return inputs[:1] if keeps else []
    if op.type in ("GatherV2", "ResourceGather", "Gather"):
        axis = tf.get_static_value(inputs[2]) if op.type == "GatherV2" else 0
        if axis is not None and int(axis) != 0:
            return inputs
        return inputs[1:2]  # The rows of the indices (an embedding lookup's ids), not of the table.
    return inputs


def _strided_slice_keeps_rows(op):
    """Whether a `StridedSlice` keeps every row of its input (`x[:, 0]`, `x[..., :3]`), not `x[:n]` or `x[0]`."""
    try:
        begin_mask, end_mask = op.get_attr("begin_mask"), op.get_attr("end_mask")
        ellipsis_mask, shrink_mask = op.get_attr("ellipsis_mask"), op.get_attr("shrink_axis_mask")
        new_axis_mask = op.get_attr("new_axis_mask")
    except ValueError:
        return False
    if ellipsis_mask & 1:
        return True
    if shrink_mask & 1 or new_axis_mask & 1:
        return False
    begin, strides = tf.get_static_value(op.inputs[1]), tf.get_static_value(op.inputs[3])
    if begin is None or strides is None or not len(begin):
        return False
    return bool((begin_mask & 1 or begin[0] == 0) and end_mask & 1 and strides[0] == 1)


def _recording_add_loss(self, loss):
    """`Layer.add_loss`; inside `recording`, the losses that are sums over the examples are recorded as `SUM` terms.

    Keras sums every added loss (`Trainer._aggregate_additional_loss`:
    `ops.sum`). Two kinds are sums over the batch's examples, so that one
    device's loss holds the global batch's sum and each replica's part counts
    once (`SUM`), not by its share of the examples as the rest of `total`
    (and a scalar the user adds, which may be a mean) does:
    - a value with one entry per example (its leading dimension is the
      batch's, `per_example`), such as keras.io's OCR `CTCLayer` adding
      `ctc_batch_cost`, shape `(batch, 1)`;
    - on a Keras before 3.14, `activity_regularizer(output)` as
      `Layer.__call__` adds it (keras-team/keras#22018; 3.14 divides it by the
      batch size; compat fix `summed_activity_regularization`);
    - one number that the first-batch check found to be a sum over the batch
      (`count_as_sum`: keras.io's guide's `add_loss(ops.sum(inputs) * 0.1)`,
      counted as a mean, half of one device's on 2 replicas, before).
    """
    step = step_state.current()
    record = _RECORDS.get(step_state.replica_key()) if step is not None else None
    own = _replica_losses(self, create=True)
    values = tree.flatten(loss)
    if record is not None:
        activity = sys._getframe(1).f_code is _LAYER_CALL_CODE and _compat.sums_activity_regularization()
        first = len(own) if own is not None else len(getattr(self, "_losses", []))
        for position, value in enumerate(values, start=first):
            if tf.is_tensor(value) and (activity or per_example(value, step) or counts_as_sum(self, position)):
                record.terms.append(LossTerm(value, SUM))
                if record.tape is not None:
                    record.tape.watch(value)
    if own is None or not all(tf.is_tensor(v) for v in values):
        return _ORIGINAL["add_loss"](self, loss)  # Keras' own (and its error for a value that is not a tensor).
    own.extend(values)
    return None


def _recording_aggregate_additional_loss(self, loss):
    """`Trainer._aggregate_additional_loss` (Keras sums each added loss); inside `recording`, records unrecorded batch sums.

    keras.io's steps run the model first and call `self.compute_loss` after:
    a layer's `add_loss` of one value per example (or of one number that is
    a sum over the batch, `ops.sum(inputs) * 0.1`: `user_terms`) ran outside
    the recording, so its sum counted by the example share (a new-user
    probe: 7.9e-2 off in the weights, 6.3e-2 on even splits). A value
    recorded where it was added (keras-dist's own step) is not recorded again.
    """
    result = _ORIGINAL["aggregate_additional_loss"](self, loss)
    step = step_state.current()
    record = _RECORDS.get(step_state.replica_key()) if step is not None else None
    if (
        record is None
        or not tf.is_tensor(loss)
        or not tf.is_tensor(result)
        or any(t.value is loss for t in record.terms)
    ):
        return result
    if loss.shape.rank == 0:
        terms = linear_terms(loss) if step.user_step else None
        summed = bool(terms) and all(summed_examples(t, step) is not None for _, t in terms)
    else:
        summed = per_example(loss, step)
    if summed:
        record.terms.append(LossTerm(result, SUM))
        if record.tape is not None:
            record.tape.watch(result)
    return result


_SUMMED_ADDED_LOSSES = "_keras_dist_summed_added_losses"  # On a layer: positions of its added sums (`count_as_sum`).


def count_as_sum(layer, position):
    """From now on, the `position`-th value `layer` adds with `add_loss` in a call counts as a sum over the examples.

    The first-batch check (`batch_coupling`) calls it for one number whose
    values on the replicas' parts of the first global batch add up to the
    whole batch's (a sum, where keras-dist otherwise takes one number for a
    mean): each replica's part then counts once (`SUM`), as one device sums
    the global batch. Set before the step is traced, identically on every
    worker (the same first batch and weights).
    """
    layer.__dict__.setdefault(_SUMMED_ADDED_LOSSES, set()).add(position)


def counts_as_sum(layer, position):
    """Whether `count_as_sum(layer, position)` was called."""
    return position in layer.__dict__.get(_SUMMED_ADDED_LOSSES, ())


_REPLICA_LOSSES = "_keras_dist_replica_losses"  # On a layer: replica key -> that replica's `add_loss` values.
_LAYERS_WITH_REPLICA_LOSSES = weakref.WeakSet()


def _replica_losses(layer, create=False):
    """This replica's list of `layer`'s `add_loss` values inside a keras-dist step (compat fix `replica_layer_losses`).

    Keras keeps a layer's `add_loss` values in one list (`Layer._losses`)
    that every replica of a one-process strategy shares: each replica's
    `call` runs in its own thread, clears the list at its outermost call and
    appends to it, so a replica that reads `model.losses` after another
    replica's `call` ran in between (one waiting in a collective of the
    forward pass, synchronized BatchNormalization's) reads that replica's
    values (a new-user probe: an activity regularizer before a synchronized
    BatchNormalization, predictions 0.185 off one device; keras.io's VQ-VAE
    logged its loss 1.5e-2 off). Inside a keras-dist step on several
    replicas each replica keeps its own list. `None` elsewhere: Keras' list.
    """
    if step_state.current() is None or ki.in_stateless_scope() or not _compat.is_active("replica_layer_losses"):
        return None
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    per_replica = layer.__dict__.get(_REPLICA_LOSSES)
    if per_replica is None:
        if not create:
            return []
        per_replica = layer.__dict__.setdefault(_REPLICA_LOSSES, {})
    if not create:
        return per_replica.get(step_state.replica_key(), [])
    _LAYERS_WITH_REPLICA_LOSSES.add(layer)
    return per_replica.setdefault(step_state.replica_key(), [])


def _replica_get_own_losses(self):
    own = _replica_losses(self)
    return _ORIGINAL["get_own_losses"](self) if own is None else list(own)


def _replica_clear_losses(self):
    own = _replica_losses(self)
    if own:
        own.clear()
    return _ORIGINAL["clear_losses"](self)


def release_replica_losses():
    """Drops this replica's `add_loss` lists (`_replica_losses`) at the end of its step: they hold the step's tensors."""
    key = step_state.replica_key()
    for layer in list(_LAYERS_WITH_REPLICA_LOSSES):
        layer.__dict__.get(_REPLICA_LOSSES, {}).pop(key, None)


def per_example(value, step):
    """Whether `value` has one entry per example of this replica's batch along its leading dimension.

    Known when traced: the leading dimension is unknown (the batch's, as
    traced for batches of varying size), or it equals the replica's example
    count where that is known too. A scalar, or a vector of another length
    (per feature, per class), is not.
    """
    if value.shape.rank is None or value.shape.rank == 0:
        return False
    leading = value.shape[0]
    if leading is None:
        return True
    examples = None if step.num_examples is None else tf.get_static_value(step.num_examples)
    return examples is not None and int(examples) == leading


def _note_tracker(record):
    """Called where `CompileLoss` is about to update its i-th per-output tracker: note the tracker's state."""
    compile_loss = getattr(record.model, "_compile_loss", None)
    trackers = list(getattr(compile_loss, "metrics", None) or [])
    index = len(record.trackers)
    if index >= len(trackers):
        return
    tracker = trackers[index]
    record.trackers.append(
        TrackerUpdate(
            tracker,
            len(record.terms) - 1,
            tf.convert_to_tensor(tracker.total.value),
            tf.convert_to_tensor(tracker.count.value),
        )
    )


def _counting_loss_call(self, *args, **kwargs):
    """`Loss.__call__`, counting how many run on this thread (a loss called inside another's function)."""
    depth = getattr(_LOSS_DEPTH, "value", 0)
    _LOSS_DEPTH.value = depth + 1
    try:
        return _ORIGINAL["loss_call"](self, *args, **kwargs)
    finally:
        _LOSS_DEPTH.value = depth


def _counting_own_call(original):
    """A `__call__` a `keras.losses.Loss` subclass writes itself, counted as `Loss.__call__` is, its result recorded.

    TensorFlow's neural machine translation tutorial writes its `MaskedLoss`
    so: a `__call__` that calls a `reduction="none"` loss and reduces the
    values itself. Keras never reduces such a loss (its own `__call__` does
    not run), so the inner loss's values were recorded as the only term, a
    sum over the batch, and each replica's loss counted once: twice one
    device's on 2 replicas (a new-user probe: weights 2.39 off). Counted, the
    inner loss is not a term; what the override returns is, as a loss
    function's one number is (a mean over examples, or a ratio of sums).
    """

    @functools.wraps(original)
    def call(self, *args, **kwargs):
        depth = getattr(_LOSS_DEPTH, "value", 0)
        _LOSS_DEPTH.value = depth + 1
        try:
            result = original(self, *args, **kwargs)
        finally:
            _LOSS_DEPTH.value = depth
        record = _RECORDS.get(step_state.replica_key()) if step_state.current() is not None else None
        if record is None or depth > 0 or not tf.is_tensor(result) or not result.dtype.is_floating:
            return result
        scalar = result.shape.rank == 0
        safe = ratio_without_nan(result) if scalar else result
        record.terms.append(_term(safe, result, None, None, "sum_over_batch_size" if scalar else "none", None))
        if record.tape is not None:
            record.tape.watch(safe)
        return safe

    call._keras_dist_counting = True
    return call


def count_own_loss_calls(model):
    """Counts the `__call__` of each compiled loss whose class writes its own (`_counting_own_call`); idempotent."""
    compile_loss = getattr(model, "_compile_loss", None)
    for entry in getattr(compile_loss, "_flat_losses", None) or []:
        cls = type(entry[1])
        own = cls.__call__
        if cls.__module__.split(".")[0] in ("keras", "keras_dist"):
            continue  # Keras' own, and keras-dist's `global_batch` (which records its own terms).
        if isinstance(entry[1], keras_loss.Loss) and own is not _counting_loss_call:
            if not getattr(own, "_keras_dist_counting", False):
                with _INSTALL_LOCK:
                    if not getattr(cls.__call__, "_keras_dist_counting", False):
                        cls.__call__ = _counting_own_call(own)


def _recording_reduce_weighted_values(
    values, sample_weight=None, mask=None, reduction="sum_over_batch_size", dtype=None
):
    record = _RECORDS.get(step_state.replica_key()) if step_state.current() is not None else None
    if record is None or getattr(_LOSS_DEPTH, "value", 0) > 1:
        # Not a term: a `Loss` called inside another loss's function (TensorFlow's transformer tutorial
        # calls `SparseCategoricalCrossentropy(reduction="none")` in its `masked_loss`); what that
        # function returns is reduced, and recorded, by the outer loss (it was counted twice).
        return _ORIGINAL["reduce_weighted_values"](values, sample_weight, mask, reduction, dtype)
    scalar = tf.is_tensor(values) and values.shape.rank == 0
    weighted_scalar = (
        scalar
        and sample_weight is not None
        and mask is None
        and keras_loss.standardize_reduction(reduction) not in (None, "none")
    )
    # Split where the replicas' parts add up: unweighted, or times the global batch's weight factor (below).
    splits = scalar and mask is None and (sample_weight is None or (weighted_scalar and not record.inspecting))
    split = split_ratios(record, values) if splits else None
    safe = split[0] if split is not None else ratio_without_nan(values) if scalar else values
    factor = None
    if weighted_scalar and not record.inspecting:
        # Keras multiplies a loss function's one number by a factor of the weights (their batch mean): the global
        # batch's factor, so that the replicas' numbers weighted as the number alone is sum to one device's.
        factor = global_weight_factor(sample_weight, reduction, step_state.current().options)
        unweighted = _ORIGINAL["reduce_weighted_values"](safe, None, None, reduction, dtype)
        result = unweighted * tf.cast(factor, unweighted.dtype)
    else:
        result = _ORIGINAL["reduce_weighted_values"](safe, sample_weight, mask, reduction, dtype)  # Kept none: 0.
    if (
        _empty_vector(values)
        and _empty_vector(result)
        and keras_loss.standardize_reduction(reduction) not in (None, "none")
    ):
        # Keras returns values of static shape (0,) unreduced (`reduce_values`), taking them for a reduced loss.
        # Keras 3.16 traces each replica's step with its static batch size: a replica without examples would
        # return an empty vector where the others return a scalar, and take another path through the step.
        result = tf.reduce_sum(result)
    term = _term(result, values, sample_weight, mask, reduction, dtype)
    term.parts = split[1] if split is not None else None
    term.global_weights = weighted_scalar
    term.weight_factor = factor
    record.terms.append(term)
    if record.tape is not None and tf.is_tensor(result):
        record.tape.watch(result)
    return result


def global_weight_factor(sample_weight, reduction, options=None):
    """float32 scalar: the factor Keras multiplies a loss function's scalar by, of the global batch's sample weights.

    `keras.src.losses.loss.reduce_weighted_values` multiplies a loss
    function's one number by the weights (broadcast) and reduces: times
    their mean over the batch (`"sum_over_batch_size"`), their sum
    (`"sum"`) or 1 (`"mean_with_sample_weight"`). Each replica's factor is
    of its own weights; one device's is of the global batch's, and the
    product of two means is no weighted sum of the replicas' products (a
    compiled `ops.mean(...)` loss function with `fit(sample_weight=...)` or
    `class_weight`: 3.2e-2 off in the kernel on 3 replicas). One small
    all-reduce of the weights' sum and count (or sum), in the forward pass.

    Args:
        sample_weight: This replica's sample weights, any shape Keras takes
            (`(batch,)`, `(batch, 1)`).
        reduction: The loss's reduction, not `None` or `"none"`.
        options: `tf.distribute.experimental.CommunicationOptions`, or `None`.

    Returns:
        float32 scalar tensor, constant for the tape; 0 where the global
        batch's divisor is 0.

    Distributed behavior:
        Replica context; every replica calls it (the same trace).
    """
    reduction = keras_loss.standardize_reduction(reduction)
    one = tf.ones([], tf.float32)
    weight = tf.cast(ops.convert_to_tensor(sample_weight), tf.float32)
    one, weight = keras_loss.squeeze_or_expand_to_same_rank(one, weight)
    weighted = one * weight
    total = tf.reduce_sum(weighted)
    if reduction == "sum":
        divisor = tf.zeros([], tf.float32)
    elif reduction == "mean_with_sample_weight":
        divisor = tf.reduce_sum(weight)
    else:
        divisor = tf.cast(tf.size(weighted), tf.float32)
    context = tf.distribute.get_replica_context()
    sums = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.stack([total, divisor]), options=options)
    factor = sums[0] if reduction == "sum" else tf.math.divide_no_nan(sums[0], sums[1])
    return tf.stop_gradient(factor)


def split_ratios(record, value):
    """`(rebuilt, parts)` of a loss function's scalar adding ratios of sums or sums over the batch to other terms; or `None`.

    A compiled loss function returning `r1 + 0.5 * r2`, each ratio over its
    own mask (`linear_ratio_terms`), was one term counted by examples (a
    new-user probe: weights 8.3e-2 off, and the first-batch check warned);
    so was one adding a sum over the batch to a mean (`ops.sum(se) / 8 +
    0.1 * ops.mean(...)`, stop 54). Each ratio becomes a `DIVISOR` term of
    its own (`_ratio_index`), each sum over the examples a `SUM` term
    (`_sum_index`), and the value is rebuilt from them (`_rebuilt`: equal,
    and 0 where a part kept nothing), so that the step weights each ratio by
    its own denominator's share, each sum once and the rest by the examples.
    A value whose terms are all sums is left to `_term` (one `SUM` term).

    Args:
        record: The step's `LossRecord`.
        value: The scalar tensor the loss function returned.

    Returns:
        `(scalar tensor of value's dtype, [(coefficient, term, index), ...])`, or `None`.
    """
    if record.tape is None:
        return None
    terms = linear_ratio_terms(value)
    if terms is None:
        step = step_state.current()
        terms = linear_terms(value) if step is not None else None
        summed = [summed_examples(t, step) for _, t in terms or ()]
        if not terms or all(t is None for t in summed) or all(t is not None for t in summed):
            return None
    parts = [(coefficient, term, _split_index(record, term)) for coefficient, term in terms]
    return _rebuilt(record, parts, value.dtype), parts


def _term(result, values, sample_weight, mask, reduction, dtype):
    """The `LossTerm` of one `reduce_weighted_values(values, sample_weight, mask, reduction, dtype)` call."""
    reduction = keras_loss.standardize_reduction(reduction)
    values = ops.convert_to_tensor(values, dtype=dtype)
    if reduction in (None, "none") and not (values.shape.rank == 0 and sample_weight is None):
        return LossTerm(result, SUM)  # Summed by whoever reduces it: its gradient is the sum's.
    if values.shape.rank == 0:
        # A loss function's one number, reduced by it (with `reduction=None` too, which keeps it as it is: it was
        # counted once per replica, 3x one device's on 3 replicas, NaN from a replica without examples).
        ratio = ratio_of(values)
        if ratio is not None:  # `sum(loss * mask) / sum(mask)`: counted by its own divisor, as a Keras mask.
            return LossTerm(result, DIVISOR, ratio.divisor, proportional=False, ratio=ratio)
        step = step_state.current()
        summed = summed_terms(values, step) if step is not None else None
        if summed is not None:  # `ops.sum(...)` over the batch (or divided by a constant): each replica's counts once.
            return LossTerm(result, SUM, own_rows=tf.reduce_all([_this_replicas_rows(t, step) for t in summed]))
        return LossTerm(result, EXAMPLES)  # A loss function that reduced its own values (keras.io: ops.mean).
    if reduction == "sum":
        return LossTerm(result, SUM)
    if sample_weight is not None:
        sample_weight = ops.convert_to_tensor(sample_weight, dtype=dtype)
    if mask is not None:
        mask = ops.convert_to_tensor(mask, dtype=dtype)
    weight = keras_loss.apply_mask(sample_weight, mask, dtype=values.dtype, reduction=reduction)
    weighted = values
    if weight is not None:
        weighted, weight = keras_loss.squeeze_or_expand_to_same_rank(values, ops.cast(weight, values.dtype))
        weighted = weighted * weight
    if reduction == "mean_with_sample_weight" and weight is not None:
        return LossTerm(result, DIVISOR, tf.cast(tf.reduce_sum(weight), tf.float32), proportional=False)
    divisor = tf.cast(tf.size(weighted), tf.float32)
    if mask is not None:  # Keras weights the unmasked entries by total / valid: the divisor is the valid share.
        total = tf.cast(tf.size(mask), tf.float32)
        valid = tf.reduce_sum(tf.cast(tf.cast(mask, "bool"), tf.float32))
        divisor = tf.math.divide_no_nan(divisor * valid, total)
    proportional = mask is None and weighted.shape.rank is not None and weighted.shape[1:].is_fully_defined()
    return LossTerm(result, DIVISOR, divisor, proportional=proportional)


def _empty_vector(value):
    return tf.is_tensor(value) and tuple(value.shape) == (0,)


_PASS_THROUGH = ("Identity", "Cast")
_DIVISIONS = ("RealDiv", "Div", "DivNoNan", "TrueDiv")


@dataclasses.dataclass(frozen=True)
class Ratio:
    """A scalar loss written as a ratio of sums over the batch, as read from its graph (`ratio_of`).

    Attributes:
        numerator: Scalar tensor, what the division divides (`None` for the
            mean of the entries a mask keeps).
        denominator: Scalar tensor, what it divides by (`None` likewise).
        divisor: float32 scalar tensor, this replica's bare sum in the
            denominator (tokens, weights' sum): what the replicas sum.
        weight: float32 scalar tensor, what this replica's value counts by
            before the global denominator divides it: the denominator as
            divided (`sum(m) + 1e-6`), or `divisor` for a ratio of means.
        shifts: `((is_add, constant), ...)`, innermost first: the
            denominator is `divisor` with each added (`sum(m) + 1e-6`) or
            taken as a floor (`maximum(sum(m), 1)`) in turn.
    """

    numerator: object
    denominator: object
    divisor: object
    weight: object
    shifts: tuple = ()

    def share(self, total):
        """float32 scalar: this replica's weight in the global batch's ratio, given `total`, the replicas' summed `divisor`.

        `weight / shifted(total)`: the replicas' values times their shares
        sum to `global numerator / shifted(global divisor)`, one device's
        value, also where a shift is not negligible (`+ 1`, a floor of 1).
        0 where the global denominator is 0.
        """
        return tf.math.divide_no_nan(self.weight, self.global_denominator(total))

    def global_denominator(self, total):
        """The denominator one device divides by, given `total` (a float32 scalar tensor or a float), the summed `divisor`."""
        for is_add, constant in self.shifts:
            if is_add:
                total = total + constant
            else:
                total = tf.maximum(total, constant) if tf.is_tensor(total) else max(total, constant)
        return total


_SHIFTS = ("AddV2", "Add", "Maximum")
_REDUCTIONS = ("Sum", "Mean")


def ratio_of(value):
    """The `Ratio` a scalar loss is written as, or `None`.

    TensorFlow's transformer tutorial and many public scripts divide a masked
    loss by the number of tokens they kept themselves. One device divides the
    global batch's sum by the global batch's tokens; a replica's ratio counts
    in that by its share of the tokens (the denominator), not of the examples.
    Eagerly (`run_eagerly=True`) there is no graph, and the value is taken for
    a mean over examples. Read from the graph when traced:
    - a division (`RealDiv`, `DivNoNan`) of two scalars, each a `Sum`
      reduction of a tensor with a batch dimension (through `Cast`s and
      `Identity`s; the two tensors' leading dimensions agree, unknown when
      traced for batches of varying size): `sum(loss * mask) / sum(mask)`;
      the denominator may add a constant to the sum or floor it by one
      (`sum(mask) + 1e-6`, `maximum(sum(mask), 1)`), in any order;
    - the same division of two `Mean` reductions over as many entries per
      example (`mean(loss * mask) / mean(mask)`, the sums' ratio), whose
      divisor is `mean x entries`;
    - the mean of the entries a mask keeps (`tf.reduce_mean(tf.boolean_mask(loss, mask))`,
      `tf.gather_nd(loss, tf.where(mask))`: a `Mean` of every axis of a
      gather whose indices come from `Where`), whose divisor is their count;
    - a sum times the reciprocal of another (`sum(l * m) * (1.0 / sum(m))`,
      `ops.reciprocal`: `_reciprocal_ratio`);
    - any of these times a scalar that is not a constant (`_weighted_ratio`).

    Args:
        value: A tensor (a scalar), or anything else (`None` then).

    Returns:
        `Ratio`, or `None`.
    """
    if not tf.is_tensor(value) or value.shape.rank != 0:
        return None
    kept = _mean_of_kept(value)
    if kept is not None:
        count = tf.cast(tf.size(kept), tf.float32)
        return Ratio(None, None, count, count)
    op = _through(getattr(value, "op", None))
    if op is not None and op.type == "Mul" and len(op.inputs) == 2:
        return _reciprocal_ratio(op) or _weighted_ratio(op)
    if op is None or op.type not in _DIVISIONS or len(op.inputs) != 2:
        return None
    return _division_ratio(*op.inputs)


def _division_ratio(numerator, denominator):
    """The `Ratio` of `numerator / denominator` (`ratio_of`'s divisions), or `None`."""
    if numerator.shape.rank != 0 or denominator.shape.rank != 0:
        return None
    bare, shifts = _unshifted(denominator)
    top, bottom = _batch_reduction(_unscaled(numerator)), _batch_reduction(bare)
    if top is None or bottom is None or top[0] != bottom[0]:
        return None  # Not both over the batch (a constant denominator): left as it was.
    if top[1].shape[0] != bottom[1].shape[0] and not (top[0] == "Sum" and _kept_entries(top[1])):
        # Not both over the batch (a sum over classes). The kept entries of a mask (`boolean_mask`) have their
        # own count as leading dimension: unknown, where Keras 3.16 traces the mask's batch dimension as static.
        return None
    if top[0] == "Sum":
        divisor = tf.cast(bare, tf.float32)
        return Ratio(numerator, denominator, divisor, tf.cast(denominator, tf.float32), shifts)
    entries = [t.shape[1:].num_elements() for t in (top[1], bottom[1])]
    if entries[0] is None or entries[0] != entries[1]:
        return None  # Means over different numbers of entries: not the ratio of their sums.
    divisor = tf.cast(bare, tf.float32) * tf.cast(tf.size(bottom[1]), tf.float32)
    return Ratio(numerator, denominator, divisor, divisor)  # A shift of a mean: counted as the bare ratio.


def _reciprocal_ratio(op):
    """The `Ratio` of a sum times the reciprocal of another (`sum(l * m) * (1.0 / sum(m))`, `ops.reciprocal`); else `None`.

    The same ratio of sums as the division (a new-user probe: counted by the
    examples, 1.9e-2 off). With a constant other than 1 above the reciprocal,
    it counts by the same share without its two parts (`_weighted_ratio`).
    """
    for numerator, other in (op.inputs, reversed(op.inputs)):
        inverse = _through(other.op)
        if inverse is None or numerator.shape.rank != 0 or other.shape.rank != 0:
            continue
        if inverse.type in ("Reciprocal", "Inv") and len(inverse.inputs) == 1:
            constant, denominator = 1.0, inverse.inputs[0]
        elif inverse.type in _DIVISIONS and len(inverse.inputs) == 2:
            constant, denominator = _scalar_constant(inverse.inputs[0]), inverse.inputs[1]
        else:
            continue
        ratio = _division_ratio(numerator, denominator) if constant else None
        if ratio is not None:
            return ratio if constant == 1.0 else dataclasses.replace(ratio, numerator=None, denominator=None)
    return None


def _weighted_ratio(op):
    """The `Ratio` of a product of a ratio and a scalar that is not a constant, without its two parts; else `None`.

    A weight that changes during training (a ramp read from
    `optimizer.iterations`, a `keras.Variable` a callback sets, a learned
    uncertainty weight) times a masked ratio: the product counts by the
    ratio's share, as the ratio does (a new-user probe: counted by examples,
    8.0e-2 off). Products by a constant are read by `linear_terms` instead,
    which keeps the ratio's two parts (a replica that kept nothing gives 0,
    not NaN).
    """
    if any(t.shape.rank != 0 or _scalar_constant(t) is not None for t in op.inputs):
        return None
    ratios = [ratio_of(t) for t in op.inputs]
    if sum(r is not None for r in ratios) != 1:
        return None
    return dataclasses.replace(next(r for r in ratios if r is not None), numerator=None, denominator=None)


def _unscaled(tensor):
    """`tensor` without the constant factors, divisors and negations over it (`0.5 * ops.sum(loss)`)."""
    op = _through(tensor.op)
    parts = _linear_parts(op) if op is not None else None
    while parts is not None and len(parts) == 1:
        tensor = parts[0][1]
        op = _through(tensor.op)
        parts = _linear_parts(op) if op is not None else None
    return tensor


def _unshifted(tensor):
    """`(bare, shifts)`: `tensor` without the constants added to it or flooring it (`Ratio.shifts`)."""
    shifts = []
    op = _through(tensor.op)
    while op is not None and op.type in _SHIFTS and len(op.inputs) == 2:
        constants = [_scalar_constant(t) for t in op.inputs]
        if constants[1] is not None and constants[0] is None:
            tensor = op.inputs[0]
        elif constants[0] is not None and constants[1] is None:
            tensor = op.inputs[1]
        else:
            break
        shifts.append((op.type != "Maximum", next(c for c in constants if c is not None)))
        op = _through(tensor.op)
    return tensor, tuple(reversed(shifts))


def _scalar_constant(tensor):
    """`tensor`'s value as a Python float when it is a constant with one element, else `None`."""
    if tensor.shape.num_elements() != 1:
        return None
    value = tf.get_static_value(tensor)
    return None if value is None else float(value.reshape(()))


def _batch_reduction(tensor):
    """`(reduction, input)`: the `Sum` or `Mean` `tensor` is of a tensor with a leading dimension (through casts); else `None`."""
    op = _through(tensor.op)
    if op is None or op.type not in _REDUCTIONS:
        return None
    reduced = op.inputs[0]
    if reduced.shape.rank is None or reduced.shape.rank < 1:
        return None
    return op.type, reduced


_GATHERS = ("GatherV2", "GatherNd", "ResourceGather")
_INDEX_PASS_THROUGH = ("Identity", "Cast", "Squeeze", "Reshape", "StridedSlice")


def _mean_of_kept(value):
    """The tensor of kept entries `value` is the mean of (`tf.reduce_mean(tf.boolean_mask(loss, mask))`), or `None`."""
    op = _through(getattr(value, "op", None))
    if op is None or op.type != "Mean" or value.shape.rank != 0 or not op.inputs:
        return None
    kept = op.inputs[0]
    return kept if _kept_entries(kept) else None


def _kept_entries(tensor):
    """Whether `tensor` is the entries a mask keeps: a gather whose indices come from `Where` (`tf.boolean_mask`)."""
    gather = _through(tensor.op)
    if gather is None or gather.type not in _GATHERS or len(gather.inputs) < 2:
        return False
    indices = gather.inputs[1].op
    while indices is not None and indices.type in _INDEX_PASS_THROUGH and indices.inputs:
        indices = indices.inputs[0].op
    return indices is not None and indices.type == "Where"


def ratio_parts(value):
    """`(numerator, denominator)`, the two scalars `value`, a ratio of sums (`ratio_of`), divides; or `None`."""
    ratio = ratio_of(value)
    if ratio is None or ratio.numerator is None:
        return None
    return ratio.numerator, ratio.denominator


def ratio_without_nan(value):
    """`value`, a ratio of sums (`ratio_parts`), recomputed as `divide_no_nan(numerator, denominator)`; else `value`.

    One device divides the global batch's sum by the global batch's tokens. A
    replica whose part kept none (a semi-supervised batch whose labelled
    examples all went to other replicas) divides 0 by 0: NaN, which its zero
    share does not remove (0 x NaN), in the loss and in every gradient, where
    one device trains on. Recomputed from the same two sums, the value is
    unchanged where the denominator is not 0 and 0 where it is, and its
    gradient flows through both sums without a NaN (TensorFlow's `DivNoNan`
    gradient is 0 where the denominator is 0).
    """
    if not tf.is_tensor(value):
        return value
    kept = _mean_of_kept(value)
    if kept is not None:  # The mean of no entries is NaN too.
        return tf.cast(tf.math.divide_no_nan(tf.reduce_sum(kept), tf.cast(tf.size(kept), kept.dtype)), value.dtype)
    parts = ratio_parts(value)
    if parts is None:
        return value
    return tf.cast(tf.math.divide_no_nan(parts[0], parts[1]), value.dtype)


def ratio_output_gradients(value, weight):
    """`([numerator, denominator], output_gradients)` that differentiate `weight x value`, a ratio of sums, without NaN; or `None`.

    `tape.gradient(value, ...)` of a ratio of sums on a replica whose
    denominator is 0 is NaN (`ratio_without_nan`). The chain rule through the
    division, written with `divide_no_nan`: `d(n / d) = dn / d - n dd / d^2`,
    0 where `d` is 0.

    Args:
        value: A scalar tensor, the loss.
        weight: A scalar tensor of `value`'s dtype, the output gradient of `value`.
    """
    if not tf.is_tensor(value):
        return None
    kept = _mean_of_kept(value)
    if kept is not None:  # d mean(kept) / d kept = 1 / its count, each.
        count = tf.cast(tf.size(kept), kept.dtype)
        return [kept], [tf.fill(tf.shape(kept), tf.math.divide_no_nan(tf.cast(weight, kept.dtype), count))]
    parts = ratio_parts(value)
    if parts is None:
        return None
    numerator, denominator = parts
    weight = tf.cast(weight, numerator.dtype)
    per_numerator = tf.math.divide_no_nan(weight, denominator)
    per_denominator = -per_numerator * tf.math.divide_no_nan(numerator, denominator)
    return [numerator, denominator], [per_numerator, per_denominator]


def ratio_share(value, step):
    """float32 scalar: this replica's share of the global batch's denominator of `value`, a ratio of sums; or `None`.

    For a loss a step you write computes as `sum(loss * mask) / sum(mask)`
    (`ratio_of`): weighted by `Ratio.share` (`denominator / global
    denominator`), the replicas' ratios sum to one device's ratio on the
    global batch, in value (a `Mean` tracker of it) and in gradient
    (`tape.gradient`). One small all-reduce of the bare sum, the first time a
    value is asked (every replica runs the same step, so every replica asks);
    kept on the step. `None` where `value` is not such a ratio, or outside a
    user's step.
    """
    if step.options is None or not tf.is_tensor(value):
        return None
    cached = step.ratio_shares.get(id(value))
    if cached is not None and cached[0] is value:
        return cached[1]
    ratio = ratio_of(value)
    if ratio is None:
        return None
    context = tf.distribute.get_replica_context()
    total = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.reshape(ratio.divisor, [1]), options=step.options)[0]
    share = tf.stop_gradient(ratio.share(total))
    step.ratio_shares[id(value)] = (value, share)
    return share


_LINEAR_TERMS_MAX = 64


def linear_ratio_terms(value):
    """`[(coefficient, term), ...]` with `value = sum(coefficient x term)`, when a term is a ratio of sums; else `None`.

    keras.io's image captioning adds one masked ratio per caption
    (`batch_loss += loss`), and multi-task steps weight two
    (`r1 + 0.5 * r2`): each ratio counts by its own denominator's share
    (`ratio_share`), which no single share of the sum gives. Read from the
    graph when traced, through scalar `+`, `-`, negation, `add_n` and
    products or quotients by a constant; every other scalar is one term (a
    constant, or a mean over examples). `None` where no term is a ratio
    (`ratio_of`), where `value` is itself one ratio (read as it is), or
    eagerly.

    Args:
        value: A tensor (a scalar), or anything else (`None` then).

    Returns:
        A list of `(float, scalar tensor)`, or `None`.
    """
    terms = linear_terms(value)
    if terms is None or not any(ratio_of(t) is not None for _, t in terms):
        return None
    if len(terms) == 1 and terms[0][0] == 1.0 and terms[0][1] is value:
        return None  # One ratio, read as it is.
    return terms


def linear_terms(value):
    """`[(coefficient, term), ...]` with `value = sum(coefficient x term)` (`linear_ratio_terms`' reading), or `None`.

    `None` eagerly, for a value that is not a scalar tensor, or past
    `_LINEAR_TERMS_MAX` terms.
    """
    if not tf.is_tensor(value) or value.shape.rank != 0 or not hasattr(value, "op"):
        return None
    terms = []
    return terms if _linear_terms(value, 1.0, terms) else None


def _linear_terms(tensor, coefficient, terms):
    """Appends `tensor`'s terms times `coefficient` to `terms`; False when there are more than `_LINEAR_TERMS_MAX`."""
    if len(terms) >= _LINEAR_TERMS_MAX:
        return False
    op = _through(tensor.op)
    stacked = _stacked_scalars(op)
    if stacked is not None and ratio_of(tensor) is None:  # `ops.sum(self.losses)`, `ops.mean(ops.stack([r1, r2]))`
        factor = coefficient / len(stacked) if op.type == "Mean" else coefficient
        return all(_linear_terms(t, factor, terms) for t in stacked)
    scalars = op is not None and all(t.shape.rank == 0 for t in op.inputs)
    parts = _linear_parts(op) if scalars and ratio_of(tensor) is None and _scalar_constant(tensor) is None else None
    if parts is None:
        terms.append((coefficient, tensor))
        return True
    return all(_linear_terms(t, coefficient * factor, terms) for factor, t in parts)


def _through(op):
    while op is not None and op.type in _PASS_THROUGH and op.inputs:
        op = op.inputs[0].op
    return op


def _stacked_scalars(op):
    """The scalars `op`, a `Sum` or `Mean` of every entry of a vector stacked from scalars, reduces; else `None`.

    `ops.sum(self.losses)` (a list of scalars: `Pack`, then `Sum`) and
    `ops.mean(ops.stack([r1, r2]))`: linear in each scalar, so each is a term
    of its own (a sum over the batch that a layer adds, a masked ratio).
    """
    if op is None or op.type not in _REDUCTIONS or len(op.inputs) != 2 or op.outputs[0].shape.rank != 0:
        return None
    stacked = _through(op.inputs[0].op)
    if stacked is None or stacked.type != "Pack" or not stacked.inputs or stacked.get_attr("axis") != 0:
        return None
    if any(t.shape.rank != 0 for t in stacked.inputs):
        return None
    return list(stacked.inputs)


@contextlib.contextmanager
def recording(model):
    """Records the loss terms this replica computes while the block runs (inside a keras-dist step).

    Yields:
        A `LossRecord`, filled as Keras reduces each loss. Its `tape` watches
        every term's value, so that `loss_weights` can find how much each
        term counts in the total.
    """
    _install()
    count_own_loss_calls(model)
    key = step_state.replica_key()
    record = LossRecord(model)
    if key is None:
        yield record
        return
    previous = _RECORDS.get(key)
    _RECORDS[key] = record
    try:
        with tf.GradientTape(watch_accessed_variables=False, persistent=True) as tape:
            record.tape = tape
            yield record
    finally:
        release_replica_losses()
        if previous is None:
            _RECORDS.pop(key, None)
        else:
            _RECORDS[key] = previous


@contextlib.contextmanager
def counted_once():
    """The terms recorded while the block runs were computed on the global batch: each counts once over the replicas.

    Such a term (a loss wrapped in `keras_dist.global_batch`) has the same
    value on every replica, whatever its reduction, mask or sample weights
    (they were gathered with the batch). It becomes an `EXAMPLES` term:
    each replica counts it by its example share, the shares summing to 1, so
    the global batch's loss counts once in value and in gradient, in the
    one-collective step as in the two-collective one.
    """
    record = _RECORDS.get(step_state.replica_key()) if step_state.current() is not None else None
    start = len(record.terms) if record is not None else 0
    try:
        yield
    finally:
        if record is not None:
            for term in record.terms[start:]:
                term.kind, term.divisor, term.proportional, term.ratio = EXAMPLES, None, False, None


def divisors_to_sum(record):
    """float32 vector: this replica's divisors of the terms not weighted by examples, in term order."""
    parts = [tf.reshape(t.divisor, [1]) for t in record.terms if t.kind == DIVISOR and not t.proportional]
    return tf.concat(parts, 0) if parts else tf.zeros([0], tf.float32)


def term_shares(record, example_share, summed_divisors):
    """Per term, this replica's weight in the global batch's loss (float32 scalars).

    Args:
        record: The `LossRecord`.
        example_share: float32 scalar, this replica's examples / the global batch's.
        summed_divisors: float32 vector, `divisors_to_sum(record)` summed over the replicas.
    """
    shares, i = [], 0
    for term in record.terms:
        if term.weighted_by_examples:
            shares.append(example_share)
        elif term.kind == SUM:
            own = term.own_rows
            shares.append(tf.constant(1.0) if own is None else tf.where(own, tf.constant(1.0), example_share))
        else:
            total = summed_divisors[i]
            shares.append(
                term.ratio.share(total) if term.ratio is not None else tf.math.divide_no_nan(term.divisor, total)
            )
            i += 1
    return shares


def global_surrogate(record, total, example_share, shares):
    """This replica's part of the global batch's loss: summed over the replicas it is that loss, value and gradient.

    `total` is this replica's loss as one device computes it on its examples;
    every part of it that is not a recorded term (regularizers, `add_loss`)
    counts by `example_share` (the regularizers, the same on every replica,
    then count once in all). Each recorded term counts by its own share
    instead: `(share - example_share) x d total / d term x term` is added.
    A `total` of one value per example (a compiled loss with `reduction="none"`,
    which Keras leaves unreduced) counts as its sum, as its gradient does
    (`_unreduced_surrogate`).
    """
    if total.shape.rank != 0:
        return _unreduced_surrogate(record, total, example_share, shares)
    adjust = [(i, t) for i, t in enumerate(record.terms) if not t.weighted_by_examples]
    values = [t.value for _, t in adjust]
    zero = tf.UnconnectedGradients.ZERO
    weights = TAPE_GRADIENT(record.tape, total, values, unconnected_gradients=zero) if adjust else []
    surrogate = tf.cast(example_share, total.dtype) * total
    for (i, term), weight in zip(adjust, weights):
        delta = tf.cast(shares[i] - example_share, total.dtype)
        surrogate += delta * tf.reduce_sum(
            tf.stop_gradient(tf.cast(weight, total.dtype)) * tf.cast(term.value, total.dtype)
        )
    return surrogate


def _unreduced_surrogate(record, total, example_share, shares):
    """`global_surrogate` of a `total` with one value per example: one device differentiates its sum.

    A compiled loss with `reduction="none"` on one output of several: Keras
    adds the other outputs' scalars to its vector (broadcast), so in the sum
    a scalar counts once per example, the global batch's value times its
    examples; each replica's sum has its own value times its own examples.
    So this replica's sum counts once, and each term is adjusted to its own
    share: a scalar by `share / example_share` (1 for a mean over the
    examples), a term with a value per example by `share` (1 for the
    unreduced loss). A new-user probe: the whole sum counted by the example
    share, 4.3e-2 off in the weights on 2 replicas. A replica without
    examples adds 0 (its scalars, means of nothing, are not used).
    """
    values = [t.value for t in record.terms]
    zero = tf.UnconnectedGradients.ZERO
    weights = TAPE_GRADIENT(record.tape, total, values, unconnected_gradients=zero) if values else []
    example_share = tf.cast(example_share, total.dtype)
    surrogate = tf.reduce_sum(total)
    for i, (term, weight) in enumerate(zip(record.terms, weights)):
        share = tf.cast(shares[i], total.dtype)
        factor = tf.math.divide_no_nan(share, example_share) if term.value.shape.rank == 0 else share
        part = tf.reduce_sum(tf.stop_gradient(tf.cast(weight, total.dtype)) * tf.cast(term.value, total.dtype))
        surrogate += tf.where(example_share > 0, (factor - 1.0) * part, tf.zeros_like(part))
    return surrogate


def update_trackers(record, shares, num_replicas):
    """Gives each per-output loss tracker this batch's global value: `total += share x term`, `count += 1 / replicas`.

    Summed over the replicas, each tracker gains the term's global-batch value
    and a count of one, as a one-device `CompileLoss` adds per batch in a
    traced step (its sample weight, the static batch size, is unknown there).
    """
    for update in record.trackers:
        if update.term < 0:
            continue
        term = record.terms[update.term]
        if term.parts is not None:  # Its ratios by their own shares, the rest by the examples (its own share).
            parts = [_part_value(record, part, shares, shares[update.term], tf.float32) for part in term.parts]
            contribution = tf.add_n(parts)
            if term.weight_factor is not None:  # Times the global batch's factor of the sample weights.
                contribution *= tf.cast(term.weight_factor, tf.float32)
        elif term.value.shape.rank != 0:
            # One value per example (`reduction="none"`): Keras' `Mean` tracker adds each, and counts each.
            update.tracker.total.assign(update.total + tf.cast(tf.reduce_sum(term.value), update.tracker.total.dtype))
            update.tracker.count.assign(update.count + tf.cast(tf.size(term.value), update.tracker.count.dtype))
            continue
        else:
            contribution = tf.cast(shares[update.term], tf.float32) * tf.cast(tf.reduce_sum(term.value), tf.float32)
        update.tracker.total.assign(update.total + tf.cast(contribution, update.tracker.total.dtype))
        update.tracker.count.assign(update.count + tf.cast(1.0 / num_replicas, update.tracker.count.dtype))
