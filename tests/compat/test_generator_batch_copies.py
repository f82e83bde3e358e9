"""A generator yielding views of one refilled buffer must still give every example once."""

import pytest
import sharding_workload
import tensorflow as tf

import keras_dist
from keras_dist import _compat

pytestmark = pytest.mark.compat


def _counts(strategy, tmp_path):
    return sharding_workload.seen_counts(
        keras_dist.DistributedModel, "generator_views", str(tmp_path), strategy=strategy
    )


def test_without_fix_examples_are_lost_and_repeated(mirrored_1x2_cpu, tmp_path):
    with _compat.disabled("generator_batch_copies"):
        try:
            counts = _counts(mirrored_1x2_cpu, tmp_path)
        except tf.errors.InvalidArgumentError as e:  # an overwritten buffer can even hold garbage ids
            assert "does not index into shape" in str(e)
            return
    total = counts.sum(axis=0)
    assert (total == 0).any(), total


def test_with_fix_every_example_once(mirrored_1x2_cpu, tmp_path):
    sharding_workload.assert_each_example_once(_counts(mirrored_1x2_cpu, tmp_path), "generator_views")
