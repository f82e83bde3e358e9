"""A filled cache (in memory or in a file) after the file readers must not defeat worker sharding.

TensorFlow's own auto-shard rewrite (`input_ops.auto_shard_dataset`, what
`MultiWorkerMirroredStrategy` applies on each worker) is run in-process for
worker 0 of 2, with the policy keras-dist chooses.
"""

import pytest
import sharding_workload
import tensorflow as tf
from tensorflow.python.distribute import input_ops

from keras_dist import _compat
from keras_dist.data import _sharding, with_auto_shard_policy

pytestmark = pytest.mark.compat


def _cached_pipeline(tmp_path, cache_file=""):
    files = sharding_workload.write_tfrecords(str(tmp_path), 4)
    dataset = tf.data.Dataset.from_tensor_slices(files).interleave(tf.data.TFRecordDataset, cycle_length=1)
    dataset = dataset.map(sharding_workload._parse).cache(cache_file).batch(4)
    for _ in dataset:  # e.g. a pass to compute normalization statistics: fills the cache
        pass
    return dataset


def _examples_on_worker_0_of_2(dataset):
    policy = _sharding.choose_auto_shard_policy(dataset, num_workers=2).auto_shard_policy
    sharded = input_ops.auto_shard_dataset(with_auto_shard_policy(dataset, policy), 2, 0, 2)
    return policy, sum(int(tf.shape(batch[1])[0]) for batch in sharded)


@pytest.mark.parametrize("in_file", [False, True], ids=["memory", "file"])
def test_without_fix_every_worker_gets_every_example(tmp_path, in_file):
    cache_file = str(tmp_path / "cache") if in_file else ""
    with _compat.disabled("file_sharding_cache"):
        policy, count = _examples_on_worker_0_of_2(_cached_pipeline(tmp_path, cache_file))
    assert (policy, count) == ("file", sharding_workload.NUM_EXAMPLES)


@pytest.mark.parametrize("in_file", [False, True], ids=["memory", "file"])
def test_with_fix_worker_gets_its_share(tmp_path, in_file):
    cache_file = str(tmp_path / "cache") if in_file else ""
    policy, count = _examples_on_worker_0_of_2(_cached_pipeline(tmp_path, cache_file))
    assert policy == "data" and count < sharding_workload.NUM_EXAMPLES, count


def test_pipeline_without_cache_keeps_file_sharding(tmp_path):
    files = sharding_workload.write_tfrecords(str(tmp_path), 4)
    dataset = tf.data.TFRecordDataset(files).map(sharding_workload._parse).batch(4)
    assert _sharding.choose_auto_shard_policy(dataset, num_workers=2).auto_shard_policy == "file"
