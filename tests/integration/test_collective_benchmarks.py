"""`benchmarks/all_reduce.py --only curve` and `--only gather`, `collective_knobs.py` and `epoch_stall.py` work on 2 workers (issue 23 items 0, 2, 7).

A benchmark's check: it asserts that each benchmark runs, prints its table and writes its JSON,
never a speed.
"""

import importlib
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.multi_worker


def _benchmark(name):
    """Imports benchmarks/NAME.py (the benchmarks import each other by module name)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def _all_reduce_benchmark(tmp_path, only):
    """Runs `benchmarks/all_reduce.py --only ONLY` on 1 KB and 64 KB, one round; returns (its stdout, its JSON)."""
    out = tmp_path / f"{only}.json"
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "all_reduce.py"), "--only", only]
    command += ["--sizes", "1024,65536", "--rounds", "1", "--timeout", "240", "--json", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "load average" in proc.stdout, proc.stdout
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_the_bus_bandwidth_curve_measures_tensorflow_keras_dist_and_loopback_tcp(tmp_path):
    stdout, results = _all_reduce_benchmark(tmp_path, "curve")
    assert "loopback TCP" in stdout, stdout
    assert sorted(results["curve"], key=int) == ["1024", "65536"]
    for row in results["curve"].values():
        assert row["tensorflow"]["busbw_MBps"] > 0 and row["keras_dist"]["busbw_MBps"] > 0, row
    assert sorted(results["loopback_tcp_curve_MBps"], key=int) == ["1024", "65536"]


@pytest.mark.timeout(300)
def test_the_gather_benchmark_times_all_reduce_against_all_gather_then_sum(tmp_path):
    stdout, results = _all_reduce_benchmark(tmp_path, "gather")
    assert "gather / reduce" in stdout, stdout
    assert sorted(results["gather"], key=int) == ["1024", "65536"]
    for row in results["gather"].values():
        assert sorted(row) == ["all_gather_then_sum", "all_reduce", "keras_dist"], row
        assert all(r["seconds"] > 0 for r in row.values()), row


@pytest.mark.timeout(200)
def test_the_collective_knobs_benchmark_runs_a_variant_on_two_workers():
    collective_knobs = _benchmark("collective_knobs")
    # Two of its variants (CI's time budget): the default, and one set through gRPC's options.
    for variant in ("default", "grpc: 16 MB frames"):
        seconds, cpu_per_wall = collective_knobs.run_variant(variant, calls=1, timeout=150)
        assert seconds > 0 and cpu_per_wall > 0, (variant, seconds, cpu_per_wall)


@pytest.mark.timeout(200)
def test_the_epoch_stall_benchmark_times_every_epoch_on_two_workers():
    epoch_stall = _benchmark("epoch_stall")
    # Its two loops (CI's time budget): a finite dataset, re-iterated and released each epoch; a repeated one.
    for variant in ("finite-released", "repeated"):
        records = epoch_stall.run_variant(variant, epochs=3, steps=4, timeout=150)
        # Every epoch ran its 4 global batches and stopped there.
        assert [r["steps"] for r in records] == [4, 4, 4], (variant, records)
        figures = epoch_stall.summarize(records)
        assert figures["median_step_ms"] > 0 and len(figures["epoch_ms_per_step"]) == 2, figures
