"""A `train_step`/`test_step` the user wrote for one device, run as exact for the global batch.

`DistributedModel` runs such a step inside `user_step` (one per replica): the
replica's `step_state.ReplicaStep` (`EXAMPLES`, `user_step=True`) tells the
optimizer's `apply` to weight its gradients by the replica's example share, and
`DistributedModel.compute_loss` returns `user_step_loss`.
"""

import contextlib

import tensorflow as tf
from keras import tree

from keras_dist._runtime import keras_internals as ki
from keras_dist._runtime import loss_terms, step_state, steps


@contextlib.contextmanager
def user_step(model, data, *, options, marks=None):
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
        marks: `None`, or the timeline's `step_marks.StepMarksBuffer`: the
            step takes its `batch` timestamp here, the optimizer's `apply`
            the others (the first `apply` of the step's).

    Yields:
        The `step_state.ReplicaStep` registered for this replica.
    """
    x, _, _ = ki.unpack_x_y_sample_weight(data)
    num_examples = steps.batch_size_of(x) if tree.flatten(x) else tf.constant(0)
    count = tf.reshape(tf.cast(num_examples, tf.float32), [1])
    step = step_state.ReplicaStep(
        step_state.EXAMPLES,
        num_examples=num_examples,
        global_examples=steps.sum_over_replicas(count, options)[0],
        user_step=True,
        marks=marks.recorder() if marks is not None else None,
    )
    if step.marks is not None:
        step.marks.stamp("batch", data)
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
