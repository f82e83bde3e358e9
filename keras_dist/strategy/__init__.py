"""Layer 2: which `tf.distribute.Strategy` to train with, and this process's role.

Owns: reading and validating the cluster (`TF_CONFIG`, SLURM) and this
process's role; turning `strategy="auto"` or a name into one strategy object per process,
refusing strategies keras-dist cannot train with, and the plan printed on the
chief. Must not: build models, read data, or start collectives.
"""

from keras_dist.strategy._cluster import ClusterInfo, num_workers, parse_tf_config, task_id, task_type
from keras_dist.strategy._cluster import cluster_from_environment as cluster_info
from keras_dist.strategy._plan import Plan, describe, is_chief
from keras_dist.strategy._resolve import STRATEGY_NAMES, choose_strategy_name, resolve_strategy

__all__ = [
    "STRATEGY_NAMES",
    "ClusterInfo",
    "Plan",
    "choose_strategy_name",
    "cluster_info",
    "describe",
    "is_chief",
    "num_workers",
    "parse_tf_config",
    "resolve_strategy",
    "task_id",
    "task_type",
]
