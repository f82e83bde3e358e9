"""benchmarks/scale_model.py: docs/performance.md's "A model of scale" shows what the script computes,
and the model reproduces the measurements it was calibrated on."""

import copy
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "scale_model.py")


def _module():
    spec = importlib.util.spec_from_file_location("scale_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


model = _module()


def _section():
    doc = open(os.path.join(ROOT, "docs", "performance.md")).read()
    start = doc.index("## A model of scale\n")
    end = doc.index("\n## ", start + 1)
    assert doc.index("## Tuning, in order") > start, "the section goes before 'Tuning, in order'"
    return doc[start:end]


@pytest.mark.parametrize(
    "name", ["parameters", "calibration", "predictions", "published_check", "horovod", "knobs", "sources"]
)
def test_the_docs_tables_are_what_the_script_computes(name):
    table = model.tables()[name]
    assert _section().count(table) == 1, f"docs/performance.md's {name} table is not the script's:\n{table}"


def test_the_model_reproduces_its_calibration_inputs_exactly():
    params, rows = model.calibrate()
    calibrated = [r for r in rows if r["role"].startswith("calibrates")]
    assert {r["figure"] for r in calibrated} == {
        "MLP 1x1 step",
        "CNN 1x1 step",
        "MLP 2x1 step",
        "MLP 1x2 gradient all-reduce (one process)",
        "all-reduce of 8 floats",
        "64 MiB gradients, keras-dist default packs",
    }
    for r in calibrated:
        assert r["predicted_ms"] == pytest.approx(r["measured_ms"], rel=1e-12, abs=0), r["figure"]
    # And the predicted rows are predictions: none of them is reproduced by construction.
    assert all(abs(r["ratio"] - 1) > 1e-6 for r in rows if r["role"] == "predicted")


def test_the_calibration_follows_the_committed_measurements():
    """Change one measurement and the parameter it fixes moves with it (the model reads, not copies, them)."""
    names = ("suite", "suite_one_collective", "suite_after_collectives", "profile_step", "all_reduce")
    results = {n: json.load(open(os.path.join(ROOT, "benchmarks", "results", n + ".json"))) for n in names}
    base, _ = model.calibrate(copy.deepcopy(results))
    changed = copy.deepcopy(results)
    changed["all_reduce"]["structure_check_8_floats"] *= 2
    params, rows = model.calibrate(changed)
    assert params["alpha_s"] == pytest.approx(2 * base["alpha_s"], rel=0.01)
    assert params["busbw_net_Bps"] != base["busbw_net_Bps"]
    for figure in ("all-reduce of 8 floats", "64 MiB gradients, keras-dist default packs"):
        row = next(r for r in rows if r["figure"] == figure)
        assert row["predicted_ms"] == pytest.approx(row["measured_ms"], rel=1e-12), figure


def test_the_ring_formula_and_the_overlap_cap():
    # 2(N-1)/N x S / B + calls x 2(N-1) x alpha; N = 1 costs nothing.
    assert model.all_reduce_seconds(8e6, 8, 1e9, 1e-6, calls=2) == pytest.approx(2 * 7 / 8 * 8e-3 + 2 * 14e-6)
    assert model.all_reduce_seconds(8e6, 1, 1e9, 1e-6) == 0.0
    # f hides at most the backward pass (two thirds of the compute).
    assert model.step_seconds(0.03, 1, 0.1, f=0.9) == pytest.approx(0.03 + 0.1 - 0.02)
    assert model.efficiency(0.1, 0.0, 0.0) == 1.0
    assert model.efficiency(0.1, 0.1, 0.0) == pytest.approx(0.5)
    assert model.efficiency(0.1, 0.1, 0.5) == pytest.approx(0.1 / 0.15)


def test_the_script_runs_and_writes_json(tmp_path):
    out = tmp_path / "scale.json"
    result = subprocess.run([sys.executable, SCRIPT, "--json", str(out)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "## predictions" in result.stdout
    data = json.loads(out.read_text())
    assert len(data["predictions"]) == 20
    assert set(data["predictions"][0]["efficiency"]) == {"0.0", "0.5", "0.9"}
