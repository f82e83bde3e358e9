"""Per-step logs must hold metrics over the whole global batch, not a mean of replica means."""

import keras
import numpy as np
import pytest
from helpers import dense_pair, regression_data

from keras_dist import _compat

pytestmark = pytest.mark.compat


class LastBatchLogs(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        self.logs = dict(logs)


def _last_batch_logs(strategy):
    x, y = regression_data(7)
    results = []
    for model in dense_pair(strategy, metrics=["mae"]):
        recorder = LastBatchLogs()
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
        results.append(recorder.logs)
    return results


def test_without_fix_step_logs_differ(mirrored_1x2_cpu):
    with _compat.disabled("cross_replica_metrics"):
        reference, distributed = _last_batch_logs(mirrored_1x2_cpu)
    assert abs(reference["mae"] - distributed["mae"]) > 1e-2


def test_with_fix_step_logs_match(mirrored_1x2_cpu):
    reference, distributed = _last_batch_logs(mirrored_1x2_cpu)
    for key in ("loss", "mae"):
        assert distributed[key] == pytest.approx(reference[key], rel=1e-5), key
    assert np.isfinite(distributed["mae"])
