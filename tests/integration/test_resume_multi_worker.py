"""Resume after failure on 2 workers: a killed worker (launcher --max-restarts) and SIGTERM, vs an uninterrupted run."""

import json
import os

import numpy as np
import pytest

from keras_dist.testing import clean_env, run_launcher

pytestmark = pytest.mark.multi_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resume_worker.py")
# New interpreters, not forked from the session's zygote server (tests/conftest.py): the preempted worker
# signals its parent, which must be the launcher.
ENV = clean_env(TF_CPP_MIN_LOG_LEVEL="3", KERAS_DIST_QUIET="1", KERAS_DIST_ZYGOTE=None)


def _launch(out_dir, scenario, *options):
    return run_launcher(["--num-workers", "2", *options, WORKER, str(out_dir), scenario], env=ENV, timeout=150)


def _results(out_dir):
    return [json.load(open(out_dir / f"worker-{i}.json")) for i in range(2)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("uninterrupted")
    result = _launch(out_dir, "none")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    return _results(out_dir)[0]


def _assert_same_as(results, reference):
    for worker in results:
        assert worker["iterations"] == reference["iterations"] == 36
        for a, b in zip(worker["weights"], reference["weights"]):
            np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.timeout(300)
def test_killed_worker_is_restarted_and_resumes_at_the_last_backup(tmp_path, uninterrupted):
    result = _launch(tmp_path, "kill", "--max-restarts", "1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "worker 1 was killed by SIGKILL" in result.stderr
    assert "restarting all workers (restart 1 of 1)" in result.stderr
    _assert_same_as(_results(tmp_path), uninterrupted)


@pytest.mark.timeout(300)
def test_sigterm_saves_once_exits_75_and_the_same_command_resumes(tmp_path, uninterrupted):
    first = _launch(tmp_path, "sigterm")
    assert first.returncode == 75, first.stdout[-3000:] + first.stderr[-2000:]
    assert first.stdout.count("SIGTERM: every worker saved a backup") == 2
    metadata = json.loads((tmp_path / "backup" / "training_metadata.json").read_text())
    assert metadata["epoch"] == 1 and metadata["keras_dist_steps_done_in_epoch"] == 5  # Saved at step 17 = 12 + 5.
    assert not (tmp_path / "worker-0.json").exists()
    second = _launch(tmp_path, "sigterm")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-2000:]
    _assert_same_as(_results(tmp_path), uninterrupted)
