"""`benchmarks/overlap_trace.py` works on 2 workers, and the windows TensorFlow launches hold the right values.

A benchmark's check (issue 23 items 1 and 7): it asserts what the traced graph carries in each
window (the last layers' gradients first, the side values in the last window: the order that lets
the first window start before the backward pass ends), never a time.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.multi_worker


@pytest.mark.timeout(300)
def test_the_trace_shows_the_last_layers_in_the_first_window_and_the_side_values_in_the_last(tmp_path):
    out = tmp_path / "overlap.json"
    script = os.path.join(ROOT, "benchmarks", "overlap_trace.py")
    command = [sys.executable, script, "--steps", "8", "--logdir", str(tmp_path / "trace"), "--json", str(out)]
    proc = subprocess.run(command + ["--timeout", "240"], capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    packs = [carried for _, carried in report["packs"]]
    # 512 KiB windows over the MLP's 2.68 MB of gradients: 6 collectives, the last layer's first.
    assert len(packs) == 6, packs
    assert any("dense_2" in name for name in packs[0]), packs
    assert not any("dense_1/MatMul/MatMul" in name for name in packs[0]), packs  # the first layer's kernel: last
    assert any("dense_1/MatMul/MatMul" in name for name in packs[-1]), packs
    assert all("grad:" in name for pack in packs[:-1] for name in pack), packs
    assert any("grad:" not in name for name in packs[-1]), packs  # counts, flags, metric state: in the last window
    assert report["steps"] and all(len(step["packs_ms"]) == 6 for step in report["steps"]), report["steps"]
    assert "backward pass ends" in proc.stdout
