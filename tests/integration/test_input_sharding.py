"""Every input kind on real workers (2x1, 2x2): each example once per epoch, the 1-file case, TFDS.

One `keras-dist launch` per topology runs tests/integration/sharding_worker.py,
which trains one epoch on each input kind of tests/sharding_workload.py and
records, per replica, which example ids it trained on (summed over workers).
"""

import json
import os

import numpy as np
import pytest
import sharding_workload
import tfds_local

from keras_dist.testing import clean_env, run_launcher

pytestmark = pytest.mark.multi_worker

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = clean_env(TF_CPP_MIN_LOG_LEVEL="3")


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tfds"))
    tfds_local.build_digits_tfds(directory, num_shards=4)
    return directory


@pytest.fixture(scope="module", params=[1, 2], ids=["multi_worker_2x1_cpu", "multi_worker_2x2_cpu"])
def run(request, tmp_path_factory, tfds_dir):
    out = tmp_path_factory.mktemp(f"sharding-2x{request.param}")
    launch_args = ["--num-workers", "2", "--cpu-replicas", str(request.param)]
    result = run_launcher(
        [*launch_args, os.path.join(HERE, "sharding_worker.py"), str(out), tfds_dir], env=ENV, timeout=280
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    outputs = [json.loads((out / f"worker-{i}.json").read_text()) for i in range(2)]
    return request.param, outputs, result.stdout + result.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", sharding_workload.INPUT_KINDS)
def test_each_example_once_per_epoch(run, kind):
    replicas_per_worker, outputs, _ = run
    for worker in outputs:
        assert kind not in worker["errors"], worker["errors"].get(kind)
    counts = np.asarray(outputs[0]["counts"][kind])
    assert counts.shape == (2 * replicas_per_worker, sharding_workload.NUM_EXAMPLES)
    np.testing.assert_array_equal(counts, outputs[1]["counts"][kind])  # the same view on both workers
    sharding_workload.assert_each_example_once(counts, kind)


@pytest.mark.timeout(300)
def test_one_file_for_two_workers_warns_once_and_falls_back_to_data(run):
    _, _, log = run
    message = "Sharding the input by DATA: FILE sharding needs at least one file per worker; 1 file(s) for 2 workers"
    lines = [line for line in log.splitlines() if message in line]
    assert len(lines) == 1 and lines[0].startswith("[worker:0]"), log[-3000:]  # once, on the chief
    assert "worker sharding:     DATA (FILE sharding needs at least one file per worker" in log
    assert "worker sharding:     FILE (4 files for 2 workers)" in log


@pytest.mark.timeout(300)
def test_tfds_is_sharded_by_file_or_by_its_input_context(run):
    _, outputs, _ = run
    reports = outputs[0]["reports"]
    # TFDS autocaches small datasets unless their files are shuffled.
    for name, policy in [("tfds_load_no_autocache", "file"), ("tfds_load", "data"), ("tfds_shuffle_files", "file")]:
        load = reports[name]
        assert (load["policy"], load["num_files"]) == (policy, 4), load["text"]
        assert load["num_examples"] == tfds_local.NUM_TRAIN and load["duplicated"] == load["missing"] == 0, load["text"]
    creator = reports["tfds_dataset_creator"]
    assert creator["num_examples"] == tfds_local.NUM_TRAIN and creator["duplicated"] == 0, creator["text"]
    assert creator["per_worker"] == [750, 750], creator["text"]  # 2 of the 4 files each


@pytest.mark.timeout(300)
def test_verify_sharding_reports_duplicates_without_sharding(run):
    _, outputs, _ = run
    report = outputs[0]["reports"]["numpy_policy_off"]
    assert report["policy"] == "off" and report["duplicated"] == sharding_workload.NUM_EXAMPLES, report["text"]
    assert "NOT every example once" in report["text"]


@pytest.mark.timeout(300)
def test_predict_on_file_input_returns_rows_in_input_order(run):
    _, outputs, _ = run
    for worker in outputs:
        result = worker["predict_tfrecord"]
        assert len(result["expected"]) == sharding_workload.NUM_EXAMPLES
        np.testing.assert_allclose(result["predicted"], result["expected"])


@pytest.mark.timeout(300)
def test_take_after_reading_files_is_sharded_by_data(run):
    _, outputs, _ = run
    report = outputs[0]["reports"]["tfrecord_take_10"]
    assert report["policy"] == "data" and "after reading its files" in report["text"], report["text"]
    assert report["num_examples"] == 10 and report["duplicated"] == report["missing"] == 0, report["text"]
