"""The documentation site builds with `mkdocs build --strict` (broken links, missing pages and bad API references fail)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_docs_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "api" / "index.html").read_text().count("DistributedModel") > 10


def test_figures_are_drawn_from_the_committed_benchmark_results(tmp_path):
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "plot.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "all_reduce_busbw.png").stat().st_size > 10_000
    assert os.path.exists(os.path.join(ROOT, "docs", "images", "all_reduce_busbw.png"))  # The one the docs show.


def test_the_ray_train_script_in_the_multi_worker_guide_is_the_tested_file():
    """docs/multi_worker.md shows examples/ray_train.py whole, as tests/integration/test_ray_train.py runs it."""
    guide = open(os.path.join(ROOT, "docs", "multi_worker.md")).read()
    marker = "<!-- examples/ray_train.py: tests/unit/test_docs.py checks that this block is the file -->\n```python\n"
    assert guide.count(marker) == 1, "the guide's Ray Train section lost the marker before its script"
    shown = guide.split(marker)[1].split("\n```\n")[0] + "\n"
    with open(os.path.join(ROOT, "examples", "ray_train.py")) as f:
        assert shown == f.read(), (
            "docs/multi_worker.md's copy differs from examples/ray_train.py: paste the file in again"
        )
