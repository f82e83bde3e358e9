"""`steps_per_execution` > 1 under MultiWorkerMirroredStrategy (found by a new-user session)."""

import json

import pytest
from helpers import MW_WORKER, multi_worker_env

from keras_dist.testing import run_launcher

pytestmark = [pytest.mark.compat, pytest.mark.multi_worker]


def _launch(tmp_path, disabled_fixes):
    launch_args = ["--num-workers", "2", MW_WORKER, str(tmp_path), "--steps-per-execution", "4"]
    return run_launcher(launch_args, env=multi_worker_env(disabled_fixes), timeout=110)


@pytest.mark.timeout(120)
def test_without_fix_tensorflow_fails_in_the_multi_step_loop(tmp_path):
    result = _launch(tmp_path, "multi_worker_steps_per_execution")
    assert result.returncode != 0
    assert "You must feed a value for placeholder tensor" in result.stdout, result.stdout[-3000:]


@pytest.mark.timeout(120)
def test_with_fix_it_warns_and_trains_like_one_step_per_execution(tmp_path):
    result = _launch(tmp_path, "")
    assert result.returncode == 0, result.stdout[-3000:]
    assert result.stdout.count("KerasDistWarning: `steps_per_execution` > 1 is not supported") == 2
    outputs = [json.loads((tmp_path / f"worker-{i}.json").read_text()) for i in range(2)]
    assert outputs[0]["weights"] == outputs[1]["weights"]
    assert outputs[0]["history"]["count"] == [37.0, 37.0]
