"""Plain Keras `fit` under MultiWorkerMirroredStrategy with 2 workers crashed twice over.

First, before step 1, the pre-fit symbolic build reduced a per-replica batch
(keras-team/keras#20585): prevented by `symbolic_build_from_spec`; then scalar
step outputs were reduced with `axis=0`: prevented by `multi_worker_output_reduction`. With both fixes, the same worker script
matches single-device training (tests/integration/test_multi_worker.py).
"""

import pytest
from helpers import MW_WORKER, multi_worker_env

from keras_dist.testing import run_launcher

pytestmark = [pytest.mark.compat, pytest.mark.multi_worker]


def _launch(tmp_path, disabled_fixes):
    return run_launcher(
        ["--num-workers", "2", MW_WORKER, str(tmp_path)], env=multi_worker_env(disabled_fixes), timeout=110
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "fix, symptom",
    [
        ("symbolic_build_from_spec", "PerReplica'>) to a Tensor"),  # case 01
        ("multi_worker_output_reduction", "Invalid reduction dimension 0 for input with 0 dimensions"),  # case 02
    ],
)
def test_without_fix_keras_fit_fails(tmp_path, fix, symptom):
    result = _launch(tmp_path, fix)
    assert result.returncode != 0
    assert symptom in result.stdout, result.stdout[-3000:]


@pytest.mark.timeout(120)
def test_with_fix_both_workers_train(tmp_path):
    result = _launch(tmp_path, "")
    assert result.returncode == 0, result.stdout[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["worker-0.json", "worker-1.json"]
