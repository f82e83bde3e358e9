"""`ReplicaContext.all_gather` of a tensor without a device fails under MultiWorkerMirroredStrategy.

Labels straight from the distributed iterator have no device on a worker, and
TensorFlow's collective all-gather takes its destinations from the value's device:
`keras_dist.ops.all_gather` of a batch's labels (in-batch negatives, batch-hard
triplets) crashed with "destinations can not be empty". The worker script is
`tests/integration/gather_worker.py` (its dataset case gathers the iterator's labels).
"""

import json
import os

import pytest
from helpers import multi_worker_env

from keras_dist import _compat
from keras_dist.testing import run_launcher

pytestmark = [pytest.mark.compat, pytest.mark.multi_worker]

WORKER = os.path.join(os.path.dirname(__file__), os.pardir, "integration", "gather_worker.py")


def _launch(tmp_path, disabled_fixes):
    return run_launcher(
        ["--num-workers", "2", WORKER, str(tmp_path)], env=multi_worker_env(disabled_fixes), timeout=110
    )


@pytest.mark.timeout(120)
def test_without_fix_gathering_the_iterators_labels_fails(tmp_path):
    if not _compat.FIXES["device_less_gather_input"].applies_to_installed():
        pytest.skip("The installed TensorFlow is outside the fix's verified range: the bug is reproduced only there.")
    result = _launch(tmp_path, "device_less_gather_input")
    assert result.returncode != 0
    assert "destinations can not be empty" in result.stdout, result.stdout[-3000:]


@pytest.mark.timeout(120)
def test_with_fix_both_workers_gather_the_labels(tmp_path):
    result = _launch(tmp_path, "")
    assert result.returncode == 0, result.stdout[-3000:]
    for task_id in range(2):
        steps = json.loads((tmp_path / f"worker-{task_id}.json").read_text())["dataset"]
        assert [step["gathered_labels"] for step in steps] == [[10, 11, 12], [13]], (task_id, steps)
