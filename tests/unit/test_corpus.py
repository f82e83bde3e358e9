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

import keras_dist
from corpus import harness
from corpus.programs import NAMES

# Measured at 4ad5b55 and 2fa9a85 (keras 3.15.1, TensorFlow 2.21, oneDNN off); `python -m corpus NAME` shows the numbers now.
KNOWN_FAILURES = {
    "c02_transformer_classifier": "Adam on the ops.arange position embedding (same rows on every replica): weights 2.8e-3 "
    "apart after 3 steps, evaluate accuracy 0.667 vs 0.633; with SGD, or no position embedding, 3e-8",
    "c03_causal_lm_greedy": "Adam on the ops.arange position embedding (as c02): weights 2.3e-3 apart, the greedy "
    "decoder's last logits 3.9e-2",
    "c04_vae": "VAE(encoder, decoder): two positional arguments taken for functional (inputs, outputs); fit raises "
    "\"'VAE' object has no attribute '_inputs'\"",
    "c05_dcgan": "GAN with no call(): fit's symbolic build under the strategy raises 'Model GAN does not have a `call()` "
    "method implemented'",
    "c06_siamese_contrastive": "contrastive_loss returns one scalar (ops.mean over the batch): logged loss x2 (0.415 vs "
    "0.208; evaluate 0.496 vs 0.248), weights 2.4e-3 apart; per-example (axis=-1) it matches to 1e-7",
    "c07_seq2seq_masking": "masked (token-averaged) loss averaged per replica: weights 1.1e-2 apart (output bias), "
    "accuracy history 0.133 vs 0.120; 1.7e-3 with SGD instead of RMSprop",
    "c09_multi_io_functional": "evaluate at batch 35 (replicas get 18 and 17): the per-output department_loss log "
    "1.51983 vs 1.5175 on one device (per-output loss trackers weight replicas equally); total loss and weights match",
    "c15_custom_train_step_compute_loss": "the guide's train_step with self.compute_loss: weights match (7e-9), logged "
    "loss halved (1.04 vs 2.09)",
    "c16_custom_train_step_own_tracker": "own loss_fn and Mean tracker: weights match (9e-8), logged loss halved in fit "
    "(0.74 vs 1.48) and in evaluate's own test_step (0.194 vs 0.389)",
    "c17_scalar_loss_function": "scalar-returning loss: gradient x2 (SGD: weights 9.7e-2 apart), logged loss 3.42 vs "
    "1.87 on one device",
    "c21_add_loss_regularizers": "add_loss(ops.sum(activations) * 0.1) counts half on 2 replicas: logged loss 11.07 vs "
    "20.29, weights 1.2e-2 apart; with ops.mean it matches to 1e-10",
}


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
    reference = harness.run_program(program, *harness.one_device_api())
    with harness.auto_strategy(mirrored_1x2_cpu):
        got = harness.run_program(program, *harness.distributed_api(), initial_weights=reference["initial_weights"])
    model = got["model"]
    assert isinstance(model, keras_dist.DistributedModel), type(model)
    assert model.distribute_strategy is mirrored_1x2_cpu
    for a, b in zip(got["initial_weights"], reference["initial_weights"], strict=True):
        np.testing.assert_array_equal(a, b)
    report = harness.compare(reference, got, harness.tolerance(program))
    assert harness.passed(report), f"{name} on 2 replicas vs one device:\n{harness.describe(report, reference['weight_paths'])}"
