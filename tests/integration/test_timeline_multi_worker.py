"""The step timeline on 2 workers: one Chrome trace per worker, and the chief's report naming the slow worker."""

import json
import os
import re

import pytest

from keras_dist.testing import clean_env, run_launcher

pytestmark = pytest.mark.multi_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "timeline_worker.py")


@pytest.mark.timeout(180)
def test_each_worker_writes_its_trace_and_the_chief_names_the_straggler(tmp_path):
    env = clean_env(TF_CPP_MIN_LOG_LEVEL="3", KERAS_DIST_QUIET="1", KERAS_DIST_TIMELINE=str(tmp_path))
    result = run_launcher(["--num-workers", "2", WORKER], env=env, timeout=150)
    assert result.returncode == 0, result.stdout[-4000:]
    assert sorted(os.listdir(tmp_path)) == ["timeline-worker-0.json", "timeline-worker-1.json"]
    for pid in (0, 1):
        events = json.loads((tmp_path / f"timeline-worker-{pid}.json").read_text())["traceEvents"]
        assert {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"worker:{pid}"}} in events
        names = [e["name"] for e in events if e["ph"] == "X"]
        assert all(e["pid"] == pid for e in events)
        assert sum(n.startswith("train step ") for n in names) == 8
        assert all(names.count(phase) == 8 for phase in ("input", "forward/backward", "all-reduce", "apply"))
        assert "agreement" in names  # AgreeOnStop, between epochs.
    chief = [line for line in result.stdout.splitlines() if line.startswith("[worker:0]")]
    rows = [line.split()[1:] for line in chief if re.match(r"\[worker:0\] worker:\d +\d+ ", line)]
    assert [row[:2] for row in rows] == [["worker:0", "8"], ["worker:1", "8"]], chief
    # Worker 1 sleeps 0.2 s in each forward pass; worker 0 waits for it in the all-reduce.
    assert any("worker:1 is the slowest: its median step (own work" in line for line in chief), chief
    assert not any(
        "keras-dist timeline:" in line for line in result.stdout.splitlines() if line.startswith("[worker:1]")
    )
