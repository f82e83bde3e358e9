"""A backup written on W workers x R replicas resumes on W' x R' at the same step, against one device.

Each test crashes a run (every worker exits after step 11; the last backup is step 9, one
step into epoch 1) on one topology, resumes it on another from the same `backup_dir`, and
compares every weight and optimizer variable with an uninterrupted run on one device.
"""

import json
import os

import numpy as np
import pytest

from keras_dist.testing import clean_env, run_workers

pytestmark = pytest.mark.multi_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "topology_worker.py")
ENV = clean_env(TF_CPP_MIN_LOG_LEVEL="3", KERAS_DIST_QUIET="1")
ATOL = 1e-5


def _run(out_dir, scenario, num_workers, cpu_replicas):
    return run_workers(
        WORKER,
        [str(out_dir), scenario],
        num_workers=num_workers,
        cpu_replicas=cpu_replicas,
        env=ENV,
        timeout=150,
        stop_on_failure=scenario != "die",  # Every worker exits by itself after the same step.
    )


def _results(out_dir, num_workers):
    return [json.load(open(out_dir / f"worker-{i}.json")) for i in range(num_workers)]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("one_device")
    result = _run(out_dir, "none", 1, 1)
    assert result.ok, result.describe()
    return _results(out_dir, 1)[0]


def _max_difference(worker, reference):
    pairs = zip(worker["weights"] + worker["optimizer"], reference["weights"] + reference["optimizer"])
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs)


@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    "before, after",
    [((2, 1), (1, 1)), ((1, 1), (2, 1)), ((2, 1), (1, 2))],
    ids=["2x1_to_1x1", "1x1_to_2x1", "2x1_to_1x2"],
)
def test_a_backup_resumes_on_another_topology_as_one_device(tmp_path, one_device, before, after):
    crashed = _run(tmp_path, "die", *before)
    assert all(code == 3 for code in crashed.returncodes.values()), crashed.describe()
    metadata = json.loads((tmp_path / "backup" / "training_metadata.json").read_text())
    assert metadata["epoch"] == 1 and metadata["keras_dist_steps_done_in_epoch"] == 1  # Step 9 = 8 + 1.

    resumed = _run(tmp_path, "resume", *after)
    assert resumed.ok, resumed.describe()
    for worker in _results(tmp_path, after[0]):
        assert worker["num_replicas_in_sync"] == after[0] * after[1]
        assert worker["iterations"] == one_device["iterations"] == 16
        difference = _max_difference(worker, one_device)
        print(f"{before} -> {after}: max |difference| {difference:.3g}")
        assert difference <= ATOL
