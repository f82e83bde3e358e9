"""Layer 2: the cluster this process belongs to, read from `TF_CONFIG` (`keras_dist._tf_config`) or SLURM and validated.

Everything here is checked before any server starts, so a malformed cluster
description fails on every worker at once with a message that says how to fix
it, instead of a hang on one worker and a crash on another.

`TF_CONFIG` is the JSON TensorFlow reads (https://www.tensorflow.org/guide/distributed_training#TF_CONFIG),
as Kubeflow's TFJob and Ray Train's TensorflowTrainer write it:
`{"cluster": {"chief": ["host:port"], "worker": ["host:port", ...]}, "task": {"type": "worker", "index": 0}}`.
"""

import dataclasses
import json
import os
from collections.abc import Mapping

import tensorflow as tf

from keras_dist import _compat
from keras_dist._env import SLURM_PORT_BASE_ENV
from keras_dist._runtime import devices
from keras_dist._tf_config import LOCAL, TRAINING_TASK_TYPES, ClusterInfo, parse_tf_config

__all__ = ["LOCAL", "TRAINING_TASK_TYPES", "ClusterInfo", "cluster_from_environment", "parse_tf_config"]


def cluster_from_environment(environ: Mapping[str, str] | None = None) -> ClusterInfo:
    """Returns this process's `ClusterInfo` from `TF_CONFIG`, else SLURM, else `LOCAL`.

    `TF_CONFIG` wins when set. A SLURM job step with more than one task
    (`SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`, `SLURM_STEP_NODELIST`,
    `SLURM_STEP_TASKS_PER_NODE`) is read with TensorFlow's
    `tf.distribute.cluster_resolver.SlurmClusterResolver`; ports start at
    `KERAS_DIST_SLURM_PORT_BASE` (default 8888) on every node.

    Args:
        environ: Mapping of environment variables. Defaults to `os.environ`
            (SLURM is only read from `os.environ`).

    Returns:
        `ClusterInfo`.

    Raises:
        ValueError: `TF_CONFIG` is set but invalid (see `parse_tf_config`).
    """
    environ = os.environ if environ is None else environ
    raw = environ.get("TF_CONFIG", "").strip()
    if raw:
        return parse_tf_config(raw)
    if environ is os.environ and _slurm_num_tasks(environ) > 1:
        return _cluster_from_slurm(environ)
    return LOCAL


def _slurm_num_tasks(environ):
    if "SLURM_PROCID" not in environ:
        return 0
    value = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or "1"
    return int(value) if value.isdigit() else 0


def _cluster_from_slurm(environ):
    num_gpus = len(devices.gpu_names())
    port_base = int(environ.get(SLURM_PORT_BASE_ENV, "8888"))
    if num_gpus or not _compat.is_active("slurm_cpu_nodes"):
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
            port_base=port_base, gpus_per_node=num_gpus or None
        )
    else:
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
            port_base=port_base, gpus_per_node=1024, gpus_per_task=1, auto_set_gpu=False
        )
    spec = resolver.cluster_spec().as_dict()
    task_type, task_id = resolver.get_task_info()
    text = json.dumps({"cluster": spec, "task": {"type": task_type, "index": task_id}})
    return dataclasses.replace(parse_tf_config(text), source="SLURM")


def task_type() -> str:
    """Returns this process's task type: `"chief"` or `"worker"` (`"worker"` without a cluster).

    Raises:
        ValueError: `TF_CONFIG` is set but invalid (see `parse_tf_config`).
    """
    return cluster_from_environment().task_type


def task_id() -> int:
    """Returns this process's index among the tasks of its type (0 without a cluster).

    Raises:
        ValueError: `TF_CONFIG` is set but invalid (see `parse_tf_config`).
    """
    return cluster_from_environment().task_id


def num_workers() -> int:
    """Returns the number of processes that train (`chief` and `worker` tasks; 1 without a cluster).

    Raises:
        ValueError: `TF_CONFIG` is set but invalid (see `parse_tf_config`).
    """
    return cluster_from_environment().num_workers
