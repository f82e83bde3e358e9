"""`keras_dist.global_batch` on two workers (issue 25 item 2): a compiled in-batch loss matches one device.

Two worker processes (`MultiWorkerMirroredStrategy`, one CPU replica each, on loopback) train the
two-tower retrieval model of `global_batch_loss_worker.py` (in-batch softmax loss and in-batch top-1
metric wrapped in `keras_dist.global_batch`) from the reference's starting weights on 10 examples at
batch 3 (parts 2/1, the last batch 1/0: worker 1 without examples); the weights, fit's logs and
`evaluate` equal plain Keras on one device in this process.
"""

import json
import os
import sys

import keras
import numpy as np
import pytest

from keras_dist.testing import clean_env, run_workers

pytestmark = pytest.mark.multi_worker

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "global_batch_loss_worker.py")


@pytest.mark.timeout(240)
def test_a_compiled_in_batch_softmax_on_two_workers_matches_one_device(tmp_path):
    sys.path.insert(0, HERE)
    import global_batch_loss_worker as worker

    rs = np.random.RandomState(0)
    data = {
        "queries": rs.rand(10, 4).astype("float32"),
        "candidates": rs.rand(10, 3).astype("float32"),
        "targets": np.zeros((10, 1), "float32"),
    }
    np.savez(tmp_path / "data.npz", **data)
    reference = worker.build(keras.Model)
    np.savez(tmp_path / "initial.npz", **{f"w{i}": w for i, w in enumerate(reference.get_weights())})
    expected = worker.train(reference, data)
    result = run_workers(
        WORKER,
        [str(tmp_path)],
        num_workers=2,
        timeout=180,
        env=clean_env(TF_CPP_MIN_LOG_LEVEL="3", KERAS_DIST_QUIET="1"),
    )
    assert result.ok, result.describe()
    for task_id in range(2):
        got = json.loads((tmp_path / f"worker-{task_id}.json").read_text())
        assert got["num_replicas_in_sync"] == 2
        for i, (a, b) in enumerate(zip(got["weights"], reference.get_weights())):
            np.testing.assert_allclose(np.array(a), b, atol=1e-6, rtol=0, err_msg=f"worker {task_id} weight {i}")
        for key, values in expected["history"].items():
            np.testing.assert_allclose(got["history"][key], values, atol=1e-6, rtol=1e-5, err_msg=key)
        for key, value in expected["evaluate"].items():
            assert got["evaluate"][key] == pytest.approx(value, abs=1e-6, rel=1e-5), key
