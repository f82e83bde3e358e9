"""keras-dist: distributed training for Keras 3 without rewriting it.

Swap `keras.Model` for `keras_dist.DistributedModel`, keep `compile` and `fit`.
Importing keras_dist applies `KERAS_DIST_CPU_REPLICAS` (simulated CPU replicas)
if it is set and, when `TF_CONFIG` or SLURM describes a cluster of several
workers, joins it (TensorFlow needs the multi-worker strategy before its first
operation); it changes nothing else.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras as _keras  # noqa: E402


def _require_tensorflow_backend(backend):
    if backend != "tensorflow":
        raise ImportError(
            "keras-dist trains on Keras' TensorFlow backend (tf.distribute). Received: "
            f"KERAS_BACKEND={backend!r}. Fix: set KERAS_BACKEND=tensorflow "
            "before importing keras, or unset it."
        )


_require_tensorflow_backend(_keras.backend.backend())

from keras_dist._runtime.devices import apply_requested_cpu_replicas as _apply_requested_cpu_replicas  # noqa: E402

_apply_requested_cpu_replicas()

from keras_dist.strategy._resolve import join_cluster_at_import as _join_cluster_at_import  # noqa: E402

_join_cluster_at_import()

from keras_dist._model import DistributedModel  # noqa: E402
from keras_dist._wrap import distribute  # noqa: E402
from keras_dist._runtime.devices import simulate_cpu_replicas  # noqa: E402
from keras_dist.strategy import Plan, describe, is_chief, resolve_strategy  # noqa: E402
from keras_dist.strategy import ClusterInfo, cluster_info, num_workers, task_id, task_type  # noqa: E402
from keras_dist.version import __version__  # noqa: E402

__all__ = [
    "ClusterInfo",
    "DistributedModel",
    "Plan",
    "__version__",
    "cluster_info",
    "describe",
    "distribute",
    "is_chief",
    "num_workers",
    "resolve_strategy",
    "simulate_cpu_replicas",
    "task_id",
    "task_type",
]
