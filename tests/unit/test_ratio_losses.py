"""`loss_terms.ratio_of`: which scalar losses count by their own denominator (a ratio of two batch sums)."""

import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from keras_dist._runtime import loss_terms

SPEC = [tf.TensorSpec([None, 6]), tf.TensorSpec([None, 6])]
CLASS_WEIGHTS = tf.constant([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])


def _token_ratio(loss, mask):
    return ops.sum(loss * mask) / ops.sum(mask)


def _divide_no_nan(loss, mask):
    return tf.math.divide_no_nan(tf.reduce_sum(loss * mask), tf.cast(tf.reduce_sum(mask), tf.float32))


def _mean(loss, mask):
    return ops.mean(loss * mask)


def _sum_over_a_constant(loss, mask):
    return ops.sum(loss * CLASS_WEIGHTS) / ops.sum(CLASS_WEIGHTS)  # The denominator is not over the batch.


def _sum_over_the_batch_size(loss, mask):
    return ops.sum(loss) / ops.cast(ops.shape(loss)[0], "float32")


def _mean_of_kept(loss, mask):
    return tf.reduce_mean(tf.boolean_mask(loss, mask > 0))


def _mean_of_gathered(loss, mask):
    return tf.reduce_mean(tf.gather_nd(loss, tf.where(mask > 0)))


@pytest.mark.parametrize(
    "written, expected",
    [
        (_token_ratio, True),
        (_mean_of_kept, True),
        (_mean_of_gathered, True),
        (_divide_no_nan, True),
        (_mean, False),
        (_sum_over_a_constant, False),
        (_sum_over_the_batch_size, False),
    ],
)
def test_ratio_divisor_is_the_denominator_of_two_batch_sums(written, expected):
    @tf.function(input_signature=SPEC)
    def divisor(loss, mask):
        found = loss_terms.ratio_of(written(loss, mask))
        return tf.constant(-1.0) if found is None else found.divisor

    mask = np.array([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]], "float32")
    got = float(divisor(tf.ones([2, 6]), tf.constant(mask)))
    assert got == (7.0 if expected else -1.0)


def test_eagerly_there_is_no_graph_to_read():
    assert loss_terms.ratio_of(_token_ratio(tf.ones([2, 6]), tf.ones([2, 6]))) is None


@pytest.mark.parametrize("kept", [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]], ids=["some", "none"])
def test_a_ratio_is_recomputed_and_differentiated_without_nan(kept):
    """Where the denominator is 0 (a replica that kept no tokens) the value and gradients are 0, not NaN; else unchanged."""
    weight = tf.Variable([0.5, -1.0, 2.0])

    @tf.function
    def both(mask):
        with tf.GradientTape(persistent=True) as tape:
            ratio = _token_ratio(tf.square(weight), mask)
        safe = loss_terms.ratio_without_nan(ratio)
        sums, output_gradients = loss_terms.ratio_output_gradients(ratio, tf.constant(2.0))
        through_sums = tape.gradient(sums, weight, output_gradients=output_gradients)
        return ratio, safe, 2.0 * tape.gradient(ratio, weight), through_sums

    ratio, safe, gradient, through_sums = (t.numpy() for t in both(tf.constant(kept)))
    if sum(kept):
        np.testing.assert_allclose(safe, ratio, rtol=1e-7)
        np.testing.assert_allclose(through_sums, gradient, rtol=1e-6)
    else:
        assert np.isnan(ratio) and np.isnan(gradient).all()  # What the replica computed before.
        assert safe == 0.0
        np.testing.assert_array_equal(through_sums, [0.0, 0.0, 0.0])


def test_a_value_that_is_no_ratio_is_left_as_it_is():
    @tf.function
    def check(loss):
        mean = ops.mean(loss)
        return loss_terms.ratio_without_nan(mean) is mean and loss_terms.ratio_output_gradients(mean, 1.0) is None

    assert check(tf.ones([2, 6]))
