"""The benchmark suite's quick mode works (issue 23 item 7): it runs, prints its table and writes its JSON.

It asserts that the benchmark works, never a speed: the figures of a quick run on a shared CI machine
mean nothing.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(400)
def test_the_suite_quick_mode_measures_every_system_and_epoch(tmp_path):
    out = tmp_path / "quick.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "suite.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=360,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ms/step of each epoch, per repeat" in proc.stdout and "load average" in proc.stdout, proc.stdout
    results = json.loads(out.read_text())
    rows = {(r["topology"], r["system"]): r for r in results["results"]}
    assert sorted(rows) == [("1x1", "keras"), ("1x1", "keras_dist"), ("1x2", "keras"), ("1x2", "keras_dist")]
    for key, row in rows.items():
        assert row["note"] is None, (key, row["note"])
        assert row["median_step_seconds"] > 0 and row["epoch_spread"] >= 0, (key, row)
        assert [len(epochs) for epochs in row["step_seconds"]] == [2], (key, row)  # 1 repeat x 2 timed epochs
        assert row["num_replicas_in_sync"] == int(key[0][-1]), (key, row)
        assert all(load is not None for load in row["load_averages"]), (key, row)
        assert row["peak_rss_bytes"] > 0, (key, row)
    assert rows[("1x2", "keras")]["keras_dist_over_system"] > 0
    assert rows[("1x1", "keras")]["keras_dist_rss_over_raw_keras"] > 0, rows[("1x1", "keras")]
    assert "peak RSS MB" in proc.stdout and "kd RSS / raw" in proc.stdout, proc.stdout
    assert results["machine"]["load_average_start"]


@pytest.mark.timeout(400)
def test_the_suite_measures_the_recommender_workload(tmp_path):
    """The recommender (an Embedding table, here of 1,000 rows) runs under keras-dist and raw Keras, with peak RSS."""
    out = tmp_path / "recommender.json"
    command = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "suite.py"),
        *("--workloads", "recommender", "--topologies", "1x1", "--systems", "keras_dist,keras"),
        *("--steps", "2", "--epochs", "1", "--repeats", "1", "--global-batch-size", "32"),
        *("--embedding-rows", "1000", "--json", str(out)),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=360, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    assert sorted(rows) == ["keras", "keras_dist"], rows
    for system, row in rows.items():
        assert row["note"] is None, (system, row["note"])
        assert row["median_step_seconds"] > 0 and [len(epochs) for epochs in row["step_seconds"]] == [1], (system, row)
        assert row["peak_rss_bytes"] > 0, (system, row)
        assert row["peak_rss_bytes_per_worker"] == [[row["peak_rss_bytes"]]], (system, row)  # 1 repeat x 1 worker


@pytest.mark.timeout(400)
def test_the_gpu_check_runs_its_smoke_version_on_cpu(tmp_path):
    """`benchmarks/gpu_check.py --smoke` (float32 only here: XLA's compilation takes minutes on 2 cores)."""
    out = tmp_path / "gpu_check.json"
    script = os.path.join(ROOT, "benchmarks", "gpu_check.py")
    command = [sys.executable, script, "--smoke", "--configs", "fp32", "--json", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=360, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for model in ("resnet50", "transformer"):
        systems = report["throughput"][model]
        for system in ("keras", "keras_dist"):
            assert "error" not in systems[system], (model, system, systems[system])
            assert systems[system]["configs"]["fp32"]["examples_per_second"] > 0
        assert systems["keras_dist_over_keras_throughput"]["fp32"] > 0
    bandwidth = report["bandwidth"]["results"]
    assert bandwidth["ReductionToOneDevice"]["bus_gb_per_s"] and "error" not in bandwidth["ReductionToOneDevice"]
    assert "kd / keras" in proc.stdout and "bus bandwidth" in proc.stdout
