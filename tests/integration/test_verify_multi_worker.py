"""`keras_dist.verify` on two workers: the reference computed on each from the global batches, one verdict."""

import json
import os

import keras
import numpy as np
import pytest

from keras_dist.testing import clean_env, run_workers

pytestmark = pytest.mark.multi_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verify_worker.py")


def _single_device_fit():
    """The `fit` after `verify` in verify_worker.py, in plain Keras on one device."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3)(h))
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    rs = np.random.RandomState(0)
    x, y = rs.rand(48, 6).astype("float32"), rs.randint(0, 3, 48).astype("int32")
    return model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history


@pytest.mark.timeout(200)
def test_verify_on_two_workers_is_one_collective_with_one_verdict(tmp_path):
    result = run_workers(
        WORKER,
        [str(tmp_path)],
        num_workers=2,
        cpu_replicas=2,
        timeout=180,
        env=clean_env(TF_CPP_MIN_LOG_LEVEL="3", KERAS_DIST_QUIET="1"),
    )
    assert result.ok, result.describe()
    outputs = [json.loads((tmp_path / f"worker-{i}.json").read_text()) for i in range(2)]
    expected_fit = _single_device_fit()
    for task_id, got in enumerate(outputs):
        plain = got["plain"]
        assert plain["passed"] and plain["likely_cause"] is None, plain
        assert plain["num_workers"] == 2 and plain["num_replicas"] == 4
        assert f"task:{task_id}" in plain["reference_device"]  # Each worker's own device.
        assert got["left_as_it_was"] and not got["optimizer_built"]
        for name, values in expected_fit.items():
            np.testing.assert_allclose(got["fit_after"][name], values, rtol=1e-5, atol=1e-5, err_msg=name)
        assert got["plain_after_fit"]["passed"]
        assert got["batch_norm"]["likely_cause"] == "unsynchronized_batch_normalization"
        assert not got["batch_norm"]["passed"]
        assert "same global batches on every worker" in got["different_data"]
    # Both workers computed the same reference and saw the same steps.
    assert outputs[0]["plain"]["reference_logs"] == outputs[1]["plain"]["reference_logs"]
    assert outputs[0]["plain"]["logs"] == outputs[1]["plain"]["logs"]
