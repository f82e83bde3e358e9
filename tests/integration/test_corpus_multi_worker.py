"""A fast subset of the corpus (tests/corpus) on 2 worker processes, against one device.

`keras-dist launch --num-workers 2 corpus_worker.py` runs every program of `PROGRAMS` whose test
is selected (all of them, or the `stacks` subset's few: tests/conftest.py) in the same pair of
workers (`MultiWorkerMirroredStrategy`, one CPU replica each, on loopback),
each program from the starting weights of its one-device reference, which runs here in the
test process (plain `keras.Model`, no strategy), or which the in-process tier of the same stack
wrote to `$CORPUS_REFERENCES` (`.ci/run` sets it; `harness.one_device_reference`). Both workers must match the reference:
weights, per-epoch history, `evaluate`, `predict`, to `rtol=atol=1e-4` (`corpus.harness.TOL`),
as in tests/unit/test_corpus.py. oneDNN is off in the workers too (inherited from
tests/conftest.py). `KNOWN_FAILURES` as in the unit corpus test: strict xfails.
"""

import os

import numpy as np
import pytest
from corpus import harness

from keras_dist.testing import clean_env, run_launcher

pytestmark = pytest.mark.multi_worker

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "corpus_worker.py")
ENV = clean_env(TF_CPP_MIN_LOG_LEVEL="3", KERAS_DIST_QUIET="1")
# Fast, and one of each way in: distribute(Sequential) with validation_split, a functional
# model with an adapted Normalization, a subclass with the guide's custom train_step, sample weights;
# losses that see the whole batch through keras_dist.ops.all_gather (issue 25): SimCLR, a CLIP-style
# dual encoder (last batch 2/1), in-batch softmax retrieval,
# batch-hard triplets on uneven parts with global_batch_offset; a PyDataset of array slices; keras.io's
# callbacks guide with float() of the learning rate; a perplexity computed from a tracker's result; a step of
# one's own clipping each micro-batch's gradient under Keras' gradient accumulation; loss functions returning
# one number with per-output sample weights (the weights' global batch mean, one all-reduce in the forward pass).
PROGRAMS = [
    "c01_mnist_convnet",
    "c12_normalization_adapt",
    "c15_custom_train_step_compute_loss",
    "c20_sample_weight",
    "c22_simclr_contrastive",
    "c23_dual_encoder_clip",
    "c24_two_tower_retrieval",
    "c25_batch_hard_triplets",
    "c26_pydataset_regression",
    "c27_segmentation_mean_iou",
    "c28_ocr_ctc_add_loss",
    "c29_tf_keras_guide_vector_loss",
    "c30_sam_sharpness_aware",
    "c31_clip_by_global_norm_masked",
    "c32_wgan_gp",
    "c33_mixup_in_train_step",
    "c34_token_ratio_masked_loss",
    "c35_semi_supervised_ratio_loss",
    "c36_image_captioning",
    "c38_custom_callbacks_guide",
    "c39_perplexity_from_tracker",
    "c40_step_adding_layer_losses",
    "c41_accumulated_clipped_train_step",
    "c42_focal_loss_class_weight",
    "c43_losses_summed_over_the_batch",
    "c44_text_vectorization_in_the_model",
]
KNOWN_FAILURES = {}


def _selected(request):
    """The programs whose tests this session runs (`-m stacks` selects some of them: tests/conftest.py)."""
    names = {
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "module", None) is request.module and hasattr(item, "callspec")
    }
    return [name for name in PROGRAMS if name in names]


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """One-device references here, then one `keras-dist launch` for the selected programs; returns (references, out_dir, log)."""
    out_dir = tmp_path_factory.mktemp("corpus_multi_worker")
    names = _selected(request)
    references = {}
    for name in names:
        references[name] = harness.one_device_reference(name, reuse=True)  # CI: the in-process tier's
        np.savez(out_dir / f"{name}-initial.npz", *references[name]["initial_weights"])
    # About 15 s a program on 2 idle cores, plus the start; CI runs 3 such streams on its 2 cores, where the
    # last run stopped at 300 s after 14 of 19 programs.
    result = run_launcher(
        ["--num-workers", "2", WORKER, str(out_dir), *names], env=ENV, timeout=150 + 30 * len(names), grace_period=20
    )
    output = result.stdout + result.stderr  # stderr ends with the timeout's note, if any
    return references, out_dir, f"exit status {result.returncode}\n{output[-6000:]}"


def _params():
    for name in PROGRAMS:
        marks = [pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[name])] if name in KNOWN_FAILURES else []
        yield pytest.param(name, id=name, marks=marks)


@pytest.mark.timeout(1200)  # The first test sets `launched` up: the references, then the launch.
@pytest.mark.parametrize("name", list(_params()))
def test_program_on_two_workers_matches_one_device(launched, name):
    references, out_dir, log = launched
    for task_id in range(2):
        error = out_dir / f"{name}-worker-{task_id}.error"
        assert not error.exists(), f"worker {task_id}:\n{error.read_text()[-3000:]}"
        path = out_dir / f"{name}-worker-{task_id}.npz"
        assert path.exists(), f"worker {task_id} wrote no results for {name}:\n{log}"
        report = harness.compare(references[name], harness.load_results(path), harness.tolerance(harness.load(name)))
        assert harness.passed(report), (
            f"{name} on worker {task_id} vs one device:\n{harness.describe(report, references[name]['weight_paths'])}"
        )
