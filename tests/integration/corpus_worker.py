"""Worker script for the corpus on several workers, started by `keras-dist launch`.

Usage: corpus_worker.py OUT_DIR NAME [NAME ...]
For each corpus program NAME (tests/corpus/programs), builds it with keras-dist's one-line
change (`strategy="auto"`: the cluster from TF_CONFIG), starts it from the weights in
OUT_DIR/NAME-initial.npz (the one-device reference's, written by the test), trains it and
writes OUT_DIR/NAME-worker-<task_id>.npz (`corpus.harness.save_results`); a program that
raises writes OUT_DIR/NAME-worker-<task_id>.error instead, and the next one runs.
"""

import os
import sys
import traceback

import numpy as np  # noqa: E402

import keras_dist  # joins the cluster before TensorFlow runs anything

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for `corpus`


def main(out_dir, names):
    from corpus import harness

    task_id = keras_dist.task_id()
    for name in names:
        prefix = os.path.join(out_dir, f"{name}-worker-{task_id}")
        try:
            with np.load(os.path.join(out_dir, f"{name}-initial.npz")) as npz:
                initial = [npz[f"arr_{i}"] for i in range(len(npz.files))]
            results = harness.run_program(harness.load(name), *harness.distributed_api(), initial_weights=initial)
            strategy = results["model"].distribute_strategy
            if strategy.num_replicas_in_sync != 2:
                raise AssertionError(f"expected 2 replicas in sync, got {strategy.num_replicas_in_sync}")
            harness.save_results(prefix + ".npz", results)
            print("done", name, f"{results['seconds']:.1f}s", flush=True)
        except Exception:  # noqa: BLE001  (recorded for the test, which reports it)
            with open(prefix + ".error", "w") as f:
                f.write(traceback.format_exc())
            print("failed", name, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
