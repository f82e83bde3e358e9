"""A SLURM job step on nodes without GPUs resolves to a cluster (TF's resolver needs GPUs)."""

import pytest

from keras_dist import _compat
from keras_dist.strategy import _cluster

pytestmark = pytest.mark.compat

SLURM_STEP = {
    "SLURM_PROCID": "1",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
}


@pytest.fixture
def slurm_step(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("KERAS_DIST_SLURM_PORT_BASE", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi, as on a CPU node
    for name, value in SLURM_STEP.items():
        monkeypatch.setenv(name, value)


def test_without_fix_tensorflows_resolver_fails_on_cpu_nodes(slurm_step):
    with _compat.disabled("slurm_cpu_nodes"):
        with pytest.raises((FileNotFoundError, RuntimeError), match="nvidia-smi"):
            _cluster.cluster_from_environment()


def test_with_fix_the_step_is_a_two_worker_cluster(slurm_step):
    info = _cluster.cluster_from_environment()
    assert (info.cluster, info.task_name, info.source) == (
        {"worker": ("node1:8888", "node2:8888")},
        "worker:1",
        "SLURM",
    )
