"""`keras_dist.ops` on two workers (issue 25): the global batch in order, uneven and empty parts.

Two worker processes (`MultiWorkerMirroredStrategy`, one CPU replica each, on loopback) gather
parts of 2 and 1 examples, then of 1 and 0 (worker 1 without examples), with
`keras_dist.ops.all_gather`: every worker gets the global batch in global order (worker 0's
examples first), its integer labels too, its own `global_batch_offset`, and the gradient of
the gathered values reaches its own part only (TensorFlow's reduce-scatter: outside a
keras-dist step, the sum of the 2 workers' equal losses). The same from a distributed dataset
(4 examples at batch 3: parts 2/1, then 1/0), its integer labels gathered straight from the
iterator (inputs without a device under this strategy, where TensorFlow's all-gather needs one:
"destinations can not be empty" before the fix in `_runtime/gather.py`). Whole programs trained with the
gather on 2 workers (SimCLR, CLIP-style, triplets) are compared with one device in
test_corpus_multi_worker.py.
"""

import json
import os

import pytest

from keras_dist.testing import clean_env, run_workers

pytestmark = pytest.mark.multi_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gather_worker.py")


@pytest.mark.timeout(200)
def test_all_gather_on_two_workers_gives_the_global_batch_in_order(tmp_path):
    result = run_workers(
        WORKER,
        [str(tmp_path)],
        num_workers=2,
        timeout=150,
        env=clean_env(TF_CPP_MIN_LOG_LEVEL="3", KERAS_DIST_QUIET="1"),
    )
    assert result.ok, result.describe()
    outputs = [json.loads((tmp_path / f"worker-{i}.json").read_text()) for i in range(2)]
    for task_id, got in enumerate(outputs):
        assert got["strategy"] == "MultiWorkerMirroredStrategy" and got["num_replicas_in_sync"] == 2, got
        assert got["num_replicas"] == 2
        uneven, empty = got["uneven"], got["empty_part"]
        assert uneven["gathered"] == [0.0, 1.0, 2.0] and uneven["gathered_labels"] == [0, 1, 2], (task_id, uneven)
        assert empty["gathered"] == [3.0] and empty["gathered_labels"] == [3], (task_id, empty)
        assert uneven["offset"] == [0, 2][task_id] and empty["offset"] == [0, 1][task_id]
        # d(loss)/d(position i) = i + 1 on each worker, summed over the 2 workers, for this worker's own examples.
        assert uneven["gradient"] == [[2.0, 4.0], [6.0]][task_id], (task_id, uneven)
        assert empty["gradient"] == [[2.0], []][task_id], (task_id, empty)
        assert got["dataset"] == [
            {"gathered": [0.0, 1.0, 2.0], "gathered_labels": [10, 11, 12], "offset": [0, 2][task_id]},
            {"gathered": [3.0], "gathered_labels": [13], "offset": [0, 1][task_id]},
        ], (task_id, got["dataset"])
