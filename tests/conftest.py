"""Session set-up: 4 simulated CPU devices and oneDNN off, before TensorFlow starts.

Topology fixtures follow `<workers>x<replicas per worker>_<device>`; a test that
needs another device count runs in a subprocess.
"""

import os

# oneDNN's CPU kernels round differently at different batch sizes (about 1e-3 after a few
# steps): off, one device and N replicas agree to float rounding. It must be set before
# TensorFlow is imported (here: keras_dist.testing below); worker processes inherit it.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_DIST_QUIET", "1")
os.environ.pop("TF_CONFIG", None)
os.environ.pop(  # The session's own split below is the only one.
    "KERAS_DIST_CPU_REPLICAS", None
)

import keras_dist.testing  # noqa: E402

NUM_CPU_DEVICES = 4
keras_dist.testing.simulate_cpu_devices(NUM_CPU_DEVICES)

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402


def mirrored(num_replicas):
    return tf.distribute.MirroredStrategy(
        [f"/cpu:{i}" for i in range(num_replicas)],
        cross_device_ops=tf.distribute.ReductionToOneDevice(),
    )


@pytest.fixture(scope="session")
def mirrored_1x2_cpu():
    return mirrored(2)


@pytest.fixture(scope="session")
def mirrored_1x3_cpu():
    return mirrored(3)


@pytest.fixture(scope="session")
def mirrored_1x2_cpu_collective():
    """MirroredStrategy with TensorFlow's default all-reduce (collective ops, as users and several workers get).

    One per session: two collective strategies in one process reuse collective instance keys
    and fail with 'Shape mismatch in the collective instance'.
    """
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


@pytest.fixture(params=[2], ids=["mirrored_1x2_cpu"], scope="session")
def multi_replica_strategy(request):
    """Several replicas: 2 (CI's time budget). 3 replicas, uneven by construction, are checked where they
    add a case 2 do not: `test_numerics.py` (both counts), the uneven-split and empty-replica tests, and the
    tests that ask for `mirrored_1x3_cpu` by name (55 test functions). Until stop 50 each test here ran on both counts:
    the 3-replica copies cost about 380 CPU seconds of a CI run."""
    return mirrored(request.param)


@pytest.fixture(params=[2, 3], ids=["mirrored_1x2_cpu", "mirrored_1x3_cpu"], scope="session")
def both_replica_counts(request):
    """2 and 3 replicas (3: each batch splits unevenly), for the main numerics checks."""
    return mirrored(request.param)


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(1234)


# The `stacks` subset: what `.ci/run` runs on every other supported stack (ci/stacks/: Colab's and
# the oldest; the newest runs everything). Every compat fix's tests (tests/compat, both tiers), the
# main job in-process, a custom train_step (keras.io's pattern) against one device, two workers of
# one replica against one device, and a dead or never-started worker named by the others. Sized for
# CI's 2 cores, where the newest stack's own suite takes most of the run (.ci/run says how long).
# Node-id prefixes, relative to the repository.
STACKS_SUBSET = (
    "tests/compat/",
    "tests/unit/test_supported_range.py",
    "tests/unit/test_install.py",
    "tests/unit/test_cli_env.py",
    "tests/integration/test_processes.py::test_main_example_smoke_run",
    # A custom train_step (the newest stack runs the whole corpus, in-process and on two workers).
    "tests/unit/test_corpus.py::test_program_matches_one_device[c15_custom_train_step_compute_loss]",
    "tests/integration/test_multi_worker.py::test_two_workers_match_single_device[multi_worker_2x1_cpu]",
    "tests/integration/test_multi_worker.py::test_worker_killed_mid_epoch_fails_the_others_naming_it",
    # TF 2.18 has no register barrier: keras-dist's startup watchdog names the missing worker there.
    "tests/integration/test_multi_worker.py::test_worker_never_started_fails_the_others_naming_it",
    # Keras 3.10 keeps a metric's result as given: a variable handed out of keras-dist's summed-state scope read 0.
    "tests/unit/test_loss_weighting.py::test_metric_with_a_running_maximum_on_the_global_batch",
    # Keras 3.16 traces each replica's step with its static batch size: a replica without examples
    # returned its loss unreduced and took another path through the step ('Values to regroup').
    "tests/unit/test_loss_weighting.py::test_compiled_losses_on_uneven_batches",
    # keras-dist wraps TensorFlow's `RaggedTensor.to_tensor`, which TextVectorization calls.
    "tests/unit/test_dynamic_graphs.py::test_a_batch_padded_in_call_is_padded_to_the_global_batchs_longest[mirrored_1x2_cpu]",
    # `verify` puts a model back through Keras' private state (backing variables, trackers, global seed).
    "tests/unit/test_verify.py::test_leaves_the_model_as_it_was_and_a_later_fit_gives_the_same_numbers",
)


# Left out of the subset: the same checks again on 3 replicas, and the slowest duplicates (CI's time budget).
STACKS_SUBSET_EXCEPT = (
    "tests/compat/test_jit_compile_mirrored.py::test_with_fix_layer_state_updates_match_the_uncompiled_step[False]",
    "tests/compat/test_jit_compile_mirrored.py::test_with_fix_each_replica_is_compiled_and_trains_like_one_device[mirrored_1x3_cpu]",
    # The even batch again (the uneven 37 examples stay), and the unmasked lookups (the masked ones stay).
    "tests/compat/test_gradient_accumulation_under_strategy.py::test_with_fix_weights_and_iterations_match_single_device[mirrored_1x2_cpu-32-",
    "tests/compat/test_sparse_embedding_read.py::test_with_fix_weights_match_keras_own_lookup[mirrored_1x2_cpu-no_mask",
    "tests/compat/test_sparse_embedding_read.py::test_with_fix_weights_match_keras_own_lookup[one_device-no_mask",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(STACKS_SUBSET) and not item.nodeid.startswith(STACKS_SUBSET_EXCEPT):
            item.add_marker(pytest.mark.stacks)


def pytest_addoption(parser):
    parser.addoption(
        "--no-zygote",
        action="store_true",
        help="start every worker as a new interpreter, not forked from the session's zygote server",
    )


# Multi-worker tests start two or three workers each, and each new interpreter spends about 8 CPU seconds
# importing TensorFlow and Keras: over a third of CI's CPU. A session that may run them sets KERAS_DIST_ZYGOTE
# to a directory of its own (here, before the test modules build their environments at collection); then
# `run_workers` and `keras-dist launch` fork their workers from zygote servers (keras_dist._zygote), one per
# environment, each of which imports them once. `--no-zygote` starts every worker as a new interpreter.
_ZYGOTE_DIRECTORY = []


def _may_run_multi_worker_tests(config):
    markexpr = config.getoption("markexpr") or ""
    return "not multi_worker" not in markexpr and not config.getoption("collectonly")


def pytest_configure(config):
    # Not in pyproject.toml: naming the category there imports keras_dist (and TensorFlow) before
    # this file sets TF_ENABLE_ONEDNN_OPTS above, and oneDNN was then on wherever the shell left it unset.
    config.addinivalue_line("filterwarnings", "error::keras_dist.errors.KerasDistWarning")
    if config.getoption("--no-zygote") or not _may_run_multi_worker_tests(config):
        return
    import tempfile

    from keras_dist import _env, _zygote

    _ZYGOTE_DIRECTORY.append(tempfile.mkdtemp(prefix="keras-dist-zygote-"))
    _zygote.set_owner(_ZYGOTE_DIRECTORY[0])  # The servers exit with this session, also when it is killed.
    os.environ[_env.ZYGOTE_ENV] = _ZYGOTE_DIRECTORY[0]


def pytest_unconfigure(config):
    if _ZYGOTE_DIRECTORY:
        from keras_dist import _zygote

        _zygote.stop_servers(_ZYGOTE_DIRECTORY.pop())
