"""`loss_terms.ratio_divisor`: which scalar losses count by their own denominator (a ratio of two batch sums)."""

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


@pytest.mark.parametrize(
    "written, expected",
    [
        (_token_ratio, True),
        (_divide_no_nan, True),
        (_mean, False),
        (_sum_over_a_constant, False),
        (_sum_over_the_batch_size, False),
    ],
)
def test_ratio_divisor_is_the_denominator_of_two_batch_sums(written, expected):
    @tf.function(input_signature=SPEC)
    def divisor(loss, mask):
        found = loss_terms.ratio_divisor(written(loss, mask))
        return tf.constant(-1.0) if found is None else found

    mask = np.array([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]], "float32")
    got = float(divisor(tf.ones([2, 6]), tf.constant(mask)))
    assert got == (7.0 if expected else -1.0)


def test_eagerly_there_is_no_graph_to_read():
    assert loss_terms.ratio_divisor(_token_ratio(tf.ones([2, 6]), tf.ones([2, 6]))) is None
