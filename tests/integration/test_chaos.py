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
    report = chaos.run(faults=3, seed=0, workers=2, kinds=("sigkill", "sigterm", "sigstop"), out_dir=str(tmp_path))
    chaos.print_report(report)
    summary = {k: v for k, v in report.items() if k != "launcher_stderr"}
    assert report["injected"] == 3, (summary, report["launcher_stderr"][-3000:])
    assert report["launcher_status"] == 0 and report["same_steps"], (summary, report["launcher_stderr"][-3000:])
    assert report["max_weight_difference"] <= chaos.TOLERANCE, summary
