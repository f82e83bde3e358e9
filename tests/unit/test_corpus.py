"""The corpus of real programs (tests/corpus): one device against 2 replicas, program by program.

Each program in `tests/corpus/programs/` is written as keras.io examples and guides write it
and runs with a one-line change (`keras.Model` -> `keras_dist.DistributedModel`, the base class
swapped, or `keras_dist.distribute(model)`). It runs twice in this process, from the same
seed, data, batch order and starting weights (the reference's, given with `set_weights`):

- the reference: plain Keras (`keras.Model`, no wrapping) on one device, no strategy;
- keras-dist: the same program with its one-line change, on 2 simulated CPU replicas
  (`mirrored_1x2_cpu`; `strategy="auto"`, which the programs leave, resolves to it, outside
  any scope, as `KERAS_DIST_CPU_REPLICAS=2` would make it on a user's machine).

Compared: every weight (trainable and not, e.g. BatchNormalization's moving statistics), the
per-epoch history (loss, metrics, validation entries, `learning_rate`; same number of epochs),
`evaluate`, `predict`, and whatever else a program returns (generated tokens, the outputs of
sub-models). Tolerance: `np.testing.assert_allclose(got, reference, rtol=1e-4, atol=1e-4)` on
every number (`corpus.harness.TOL`). `tests/conftest.py` sets `TF_ENABLE_ONEDNN_OPTS=0` for the
session (before TensorFlow is imported): oneDNN's kernels are not bit-reproducible across
batch sizes, which would blur the comparison by about 1e-3.

Programs that differ today are strict xfails in `KNOWN_FAILURES` (one line each: what differs
and by how much, measured at the commit named in tests/corpus/README.md); an XPASS means the
fault was fixed: delete the entry. `python -m corpus [NAME ...]` from `tests/` prints the
whole table (every difference, every time).
"""

import numpy as np
import pytest
from corpus import harness
from corpus.programs import NAMES

import keras_dist

# Measured at 4ad5b55 and 2fa9a85 (keras 3.15.1, TensorFlow 2.21, oneDNN off); `python -m corpus NAME` shows the numbers now.
KNOWN_FAILURES: dict[str, str] = {}


def _params():
    for name in NAMES:
        marks = [pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[name])] if name in KNOWN_FAILURES else []
        yield pytest.param(name, id=name, marks=marks)


def test_corpus_has_at_least_20_programs():
    assert len(NAMES) >= 20, NAMES


@pytest.mark.parametrize("name", list(_params()))
def test_program_matches_one_device(name, mirrored_1x2_cpu):
    program = harness.load(name)
    assert program.CHANGE in ("functional", "subclass", "distribute"), program.CHANGE
    reference = harness.one_device_reference(name)  # written for the multi-worker tier, if CI asks
    with harness.auto_strategy(mirrored_1x2_cpu):
        got = harness.run_program(program, *harness.distributed_api(), initial_weights=reference["initial_weights"])
    model = got["model"]
    assert isinstance(model, keras_dist.DistributedModel), type(model)
    assert model.distribute_strategy is mirrored_1x2_cpu
    for a, b in zip(got["initial_weights"], reference["initial_weights"], strict=True):
        np.testing.assert_array_equal(a, b)
    report = harness.compare(reference, got, harness.tolerance(program))
    assert harness.passed(report), (
        f"{name} on 2 replicas vs one device:\n{harness.describe(report, reference['weight_paths'])}"
    )


def test_a_kept_reference_reads_back_as_computed_and_only_for_the_same_stack(tmp_path, monkeypatch):
    """`one_device_reference` keeps references for CI's multi-worker tier; a kept one is the computed one."""
    monkeypatch.setenv(harness.REFERENCES_ENV, str(tmp_path))
    name = "c17_scalar_loss_function"
    computed = harness.one_device_reference(name)
    (kept,) = tmp_path.glob(f"{name}-*.npz")
    read = harness.one_device_reference(name, reuse=True)
    assert "model" not in read  # read back, not run again
    report = harness.compare(computed, read, tol=0.0)
    assert harness.passed(report) and report["weights"]["abs"] == 0.0, harness.describe(report)
    assert read["weight_paths"] == computed["weight_paths"]
    for a, b in zip(read["initial_weights"], computed["initial_weights"], strict=True):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "1")  # another stack's numbers: not this reference
    assert harness._reference_path(name) != str(kept)
