"""Prints the corpus table: `python -m corpus [NAME ...]` from `tests/` (or `PYTHONPATH=tests`).

Runs each program on one device and on 2 simulated CPU replicas (this process splits
the CPU in 2 before TensorFlow starts, with oneDNN off as in the test session) and
prints one row per program: passes or not, the largest weight / history / evaluate /
predict differences, the seconds of both runs, and the error when a run raised.
"""

import os
import sys
import traceback

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_DIST_QUIET", "1")
os.environ.pop("TF_CONFIG", None)
os.environ["KERAS_DIST_CPU_REPLICAS"] = "2"


import keras_dist  # noqa: E402  (splits the CPU in 2 before TensorFlow starts)
from corpus import harness  # noqa: E402
from corpus.programs import NAMES  # noqa: E402


def _without_the_gather():
    """`keras_dist.ops.all_gather` as the identity, `global_batch_offset` as 0 and `batch_mean` as the replica's mean.

    The programs' change undone.
    """
    import keras
    import tensorflow as tf

    keras_dist.ops.all_gather = lambda values, axis=0: values
    keras_dist.ops.global_batch_offset = lambda values: tf.constant(0, tf.int32)
    keras_dist.ops.batch_mean = lambda values: keras.ops.mean(values, axis=0)


def main(names):
    if os.environ.get("CORPUS_NO_GATHER"):
        _without_the_gather()
    print(
        f"{'program':32} {'result':6} {'weights':>9} {'history':>9} {'evaluate':>9} {'predict':>9} {'1dev s':>7} {'2rep s':>7} {'cpu s':>6}"
    )
    for name in names or NAMES:
        program = harness.load(name)
        row = {"result": "FAIL"}
        try:
            try:
                reference = harness.run_program(program, *harness.one_device_api())
            except Exception as e:
                raise RuntimeError(f"on ONE DEVICE (the program itself is wrong): {type(e).__name__}: {e}") from e
            got = harness.run_program(program, *harness.distributed_api(), initial_weights=reference["initial_weights"])
            assert got["model"].distribute_strategy.num_replicas_in_sync == 2
            report = harness.compare(reference, got, harness.tolerance(program))
            row = {g: f"{v['abs']:.2e}" for g, v in report.items() if g != "mismatched"}
            row["result"] = "pass" if harness.passed(report) else "FAIL"
            row["t1"], row["t2"] = f"{reference['seconds']:.1f}", f"{got['seconds']:.1f}"
            print(
                f"{name:32} {row['result']:6} {row.get('weights', '-'):>9} {row.get('history', '-'):>9} "
                f"{row.get('evaluate', '-'):>9} {row.get('predict', '-'):>9} {row['t1']:>7} {row['t2']:>7} {reference['cpu_seconds'] + got['cpu_seconds']:6.1f}"
            )
            if row["result"] != "pass":
                print("    " + harness.describe(report, reference["weight_paths"]).replace("\n", "\n    "))
        except Exception as e:  # noqa: BLE001
            print(f"{name:32} ERROR  {type(e).__name__}: {' '.join(str(e).split())[:300]}")
            if os.environ.get("CORPUS_TRACEBACK"):
                traceback.print_exc()
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
