"""`benchmarks/all_reduce.py --only curve` and `benchmarks/collective_knobs.py` work on 2 workers (issue 23 items 2, 7).

A benchmark's check: it asserts that each benchmark runs, prints its table and writes its JSON,
never a speed.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.multi_worker


@pytest.mark.timeout(300)
def test_the_bus_bandwidth_curve_measures_tensorflow_keras_dist_and_loopback_tcp(tmp_path):
    out = tmp_path / "curve.json"
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "all_reduce.py"), "--only", "curve"]
    command += ["--sizes", "1024,65536", "--rounds", "1", "--timeout", "240", "--json", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "loopback TCP" in proc.stdout and "load average" in proc.stdout, proc.stdout
    results = json.loads(out.read_text())
    assert sorted(results["curve"], key=int) == ["1024", "65536"]
    for row in results["curve"].values():
        assert row["tensorflow"]["busbw_MBps"] > 0 and row["keras_dist"]["busbw_MBps"] > 0, row
    assert sorted(results["loopback_tcp_curve_MBps"], key=int) == ["1024", "65536"]


@pytest.mark.timeout(200)
def test_the_collective_knobs_benchmark_runs_a_variant_on_two_workers():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import collective_knobs
    finally:
        sys.path.pop(0)
    for variant in ("default", "unordered (V1 ops)"):
        seconds, cpu_per_wall = collective_knobs.run_variant(variant, calls=1, timeout=150)
        assert seconds > 0 and cpu_per_wall > 0, (variant, seconds, cpu_per_wall)
