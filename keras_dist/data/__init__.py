"""Layer 2: turning any Keras input into per-replica batches.

Owns: the auto-shard policy that splits an input across workers (FILE, DATA,
OFF), the global and per-replica batch sizes shown in the input plan,
per-worker input functions (`DatasetCreator`), and `verify_sharding`, the
check that every example reaches exactly one replica per epoch.
Must not: build models, change the examples themselves, or take a batch from
the user's iterator to look at it.
"""

from keras_dist.data._buckets import bucket_by_length
from keras_dist.data._creator import DatasetCreator
from keras_dist.data._distribute import InputPlan
from keras_dist.data._sharding import AUTO_SHARD_POLICIES, with_auto_shard_policy
from keras_dist.data._verify import ShardingReport, verify_sharding

__all__ = [
    "AUTO_SHARD_POLICIES",
    "DatasetCreator",
    "InputPlan",
    "ShardingReport",
    "bucket_by_length",
    "verify_sharding",
    "with_auto_shard_policy",
]
