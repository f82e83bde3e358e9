"""`benchmarks/sparse_embeddings.py --quick` works: it runs, prints its table and writes its JSON (issue 23 item 3).

It asserts that the benchmark works, never a speed or a size: the figures of a quick run on a shared
CI machine mean nothing.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(400)
def test_the_quick_mode_measures_every_variant(tmp_path):
    out = tmp_path / "quick.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "sparse_embeddings.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=360,
        cwd=ROOT,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_DIST_QUIET": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for expected in ("bytes/step", "ms/step", "sums MB", "peak RSS MB", "load average", "densified / rows"):
        assert expected in proc.stdout, proc.stdout
    results = json.loads(out.read_text())["results"]
    variants = sorted((r["rows"], r["sparse_gradients"], r["accumulation_steps"] or 1) for r in results)
    assert variants == sorted((rows, kind, k) for rows in (1000, 20000) for kind in ("rows", "dense") for k in (1, 4))
    for r in results:
        assert "note" not in r, r
        assert r["bytes_per_step"] > 0 and r["median_step_seconds"] > 0 and r["peak_rss_bytes"] > 0, r
