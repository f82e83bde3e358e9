"""The short chaos run in CI: a seeded schedule of 3 faults against 2 workers (`benchmarks/chaos.py`).

Each start of the workers gets one fault; `keras-dist launch --max-restarts` restarts them, and
`BackupAndRestore` resumes. The run must end with the uninterrupted run's steps and weights. The
long run (10 faults, every kind) is `python benchmarks/chaos.py`; docs/reliability.md holds one.
"""

import importlib.util
import os

import pytest

pytestmark = pytest.mark.multi_worker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _chaos():
    spec = importlib.util.spec_from_file_location("chaos", os.path.join(ROOT, "benchmarks", "chaos.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_schedule_is_seeded_and_uses_every_kind():
    chaos = _chaos()
    plan = chaos.make_plan(10, seed=3, workers=3)
    assert plan == chaos.make_plan(10, seed=3, workers=3)
    assert sorted({f["kind"] for f in plan["faults"]}) == sorted(chaos.KINDS)
    assert [f["attempt"] for f in plan["faults"]] == list(range(10))
    assert {f["slot"] for f in plan["faults"]} <= {0, 1, 2}


@pytest.mark.timeout(600)
def test_three_faults_end_with_the_uninterrupted_weights(tmp_path):
    chaos = _chaos()
    # A crash, a backup cut in half (the resume falls back to the previous one) and a save out of space;
    # SIGTERM and SIGSTOP have their own tests (test_resume_multi_worker.py, test_stall_watchdog.py).
    kinds = ("sigkill", "corrupt_backup", "disk_full")
    report = chaos.run(faults=3, seed=0, workers=2, kinds=kinds, out_dir=str(tmp_path))
    chaos.print_report(report)
    summary = {k: v for k, v in report.items() if k != "launcher_stderr"}
    assert report["injected"] == 3, (summary, report["launcher_stderr"][-3000:])
    assert report["launcher_status"] == 0 and report["same_steps"], (summary, report["launcher_stderr"][-3000:])
    assert report["max_weight_difference"] <= chaos.TOLERANCE, summary


@pytest.mark.timeout(600)
def test_an_elastic_launch_drops_a_worker_that_keeps_dying_and_ends_with_the_uninterrupted_weights(tmp_path):
    # Worker slot 1 SIGKILLs itself 4 steps into every start. `--max-restarts 1 --min-workers 1`: after its
    # second death it is dropped, and worker 0 alone resumes from the last backup (2 workers -> 1, the same
    # global batch) and must end where the uninterrupted 2-worker run ends.
    chaos = _chaos()
    plan = chaos.make_plan(0, seed=0, workers=2)
    plan["faults"] = [{"attempt": "every", "kind": "sigkill", "slot": 1, "after_steps": 4}]
    report = chaos.run(workers=2, out_dir=str(tmp_path), plan=plan, max_restarts=1, min_workers=1)
    chaos.print_report(report)
    summary = {k: v for k, v in report.items() if k != "launcher_stderr"}
    stderr = report["launcher_stderr"]
    assert "worker slot 1 failed 2 times (its 1 restart is used up): continuing with 1 worker instead of 2" in stderr
    assert report["launcher_status"] == 0 and report["finished_workers"] == 1, (summary, stderr[-3000:])
    assert report["same_steps"] and report["max_weight_difference"] <= chaos.TOLERANCE, summary
