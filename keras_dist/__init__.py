"""keras-dist: distributed training for Keras 3 without rewriting it.

Swap `keras.Model` for `keras_dist.DistributedModel`, keep `compile` and `fit`.
Importing keras_dist applies `KERAS_DIST_CPU_REPLICAS` (simulated CPU replicas)
and `KERAS_DIST_INTRA_OP_THREADS` / `KERAS_DIST_INTER_OP_THREADS` (CPU thread
pools, shared out among local workers by `keras-dist launch`) if they are set
and, when `TF_CONFIG` or SLURM describes a cluster of several workers, joins it
(TensorFlow needs the multi-worker strategy before its first operation); it
changes nothing else. Inside the `keras-dist` command itself, importing the
package loads nothing (the launcher runs without TensorFlow).

TensorFlow is not a dependency of the package (pip would install the `tensorflow`
distribution over a `tensorflow-cpu`, `tensorflow-tpu` or `tf-nightly`): without
one, the import raises `ModuleNotFoundError` saying how to install it.
"""

import os

from keras_dist._process import is_keras_dist_command as _is_keras_dist_command
from keras_dist.version import __version__
from keras_dist.version import missing_tensorflow_message as _missing_tensorflow_message


def _require_tensorflow():
    """Imports TensorFlow; raises `ModuleNotFoundError` with `_missing_tensorflow_message()` where it is missing."""
    try:
        import tensorflow  # noqa: F401  (Keras imports it next; a missing one fails here, with the fix)
    except ModuleNotFoundError as e:
        if e.name != "tensorflow":
            raise  # TensorFlow is there, something it imports is not: TensorFlow's own message says what.
        raise ModuleNotFoundError(_missing_tensorflow_message(), name="tensorflow") from None


def _require_tensorflow_backend(backend):
    if backend != "tensorflow":
        raise ImportError(
            "keras-dist trains on Keras' TensorFlow backend (tf.distribute). Received: "
            f"KERAS_BACKEND={backend!r}. Fix: set KERAS_BACKEND=tensorflow "
            "before importing keras, or unset it."
        )


if not _is_keras_dist_command():
    from keras_dist._tf_config import validate_environment as _validate_tf_config

    _validate_tf_config()  # A malformed TF_CONFIG fails now, before TensorFlow's import (seconds).
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    _require_tensorflow()

    import keras as _keras

    _require_tensorflow_backend(_keras.backend.backend())

    from keras_dist._runtime.devices import apply_requested_cpu_replicas as _apply_requested_cpu_replicas
    from keras_dist._runtime.threads import apply_requested_threads as _apply_requested_threads

    _apply_requested_threads()

    _apply_requested_cpu_replicas()

    from keras_dist.strategy._resolve import join_cluster_at_import as _join_cluster_at_import

    _join_cluster_at_import()

    from keras_dist import ops  # noqa: F401  (keras_dist.ops, the submodule, as keras.ops)
    from keras_dist._global_batch import global_batch
    from keras_dist._model import DistributedModel
    from keras_dist._runtime.devices import simulate_cpu_replicas
    from keras_dist._verify import VerifyReport, verify
    from keras_dist._wrap import distribute
    from keras_dist.collectives import CommunicationOptions, distributed_optimizer
    from keras_dist.strategy import (
        ClusterInfo,
        Plan,
        cluster_info,
        describe,
        is_chief,
        num_workers,
        resolve_strategy,
        task_id,
        task_type,
    )

__all__ = [
    "ClusterInfo",
    "CommunicationOptions",
    "DistributedModel",
    "Plan",
    "__version__",
    "cluster_info",
    "describe",
    "distribute",
    "distributed_optimizer",
    "global_batch",
    "is_chief",
    "num_workers",
    "resolve_strategy",
    "simulate_cpu_replicas",
    "task_id",
    "task_type",
    "verify",
    "VerifyReport",
]


_LAZY = {
    "CommunicationOptions": "keras_dist.collectives",
    "DistributedModel": "keras_dist._model",
    "distribute": "keras_dist._wrap",
    "distributed_optimizer": "keras_dist.collectives",
    "global_batch": "keras_dist._global_batch",
    "simulate_cpu_replicas": "keras_dist._runtime.devices",
    "VerifyReport": "keras_dist._verify",
    "verify": "keras_dist._verify",
}


def __getattr__(name: str) -> object:
    """Loads the public names on first use inside the `keras-dist` command itself."""
    if name in __all__:
        import importlib

        value = getattr(importlib.import_module(_LAZY.get(name, "keras_dist.strategy")), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'keras_dist' has no attribute {name!r}")
