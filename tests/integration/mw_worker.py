"""Worker script for the multi-worker tests, started by `keras-dist launch`.

Usage: mw_worker.py OUT_DIR [--steps-per-execution K] [--communication JSON] [--accumulation K]
                    [--die-at-batch N --die-task-id I] [--workload sparse]
Writes OUT_DIR/<task_type>-<task_id>.json with what this worker saw.
"""

import json
import os
import signal
import sys

import keras  # noqa: E402

import keras_dist  # keras_dist: joins the cluster before TensorFlow runs anything.

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class DieAtBatch(keras.callbacks.Callback):
    """SIGKILLs this worker when training batch `batch` begins."""

    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_begin(self, index, logs=None):
        if index == self.batch:
            print(f"killing myself at batch {index}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def collectives_per_step(function):
    """Counts the collective ops (`Collective*`, all replicas of this worker) in each traced one-step graph."""
    from keras_dist.callbacks._monitors import _tf_functions_in

    def count(graph):
        own = sum(op.type.startswith("Collective") for op in graph.get_operations())
        return own + sum(count(f.graph) for f in graph._functions.values() if hasattr(f, "graph"))

    return sorted(
        count(concrete.graph)
        for f in _tf_functions_in(function)
        if "one_step_on_data" in getattr(f, "__name__", "")
        for concrete in f._list_all_concrete_functions()
    )


def main(argv):
    import mw_workload

    out_dir = argv[0]
    options = dict(zip(argv[1::2], argv[2::2]))
    info = keras_dist.cluster_info()
    if options.get("--workload") == "sparse":
        steps = int(options["--accumulation"]) if "--accumulation" in options else None
        model = mw_workload.build_sparse(keras_dist.DistributedModel, gradient_accumulation_steps=steps)
        results = mw_workload.run_sparse(model)
        if steps:  # The table's running sum holds rows (at most its 10 ids), not the table, after an odd count.
            import tensorflow as tf

            from keras_dist._runtime import optimizer_patches

            sums = optimizer_patches.state(model.optimizer).sums.sums
            held = [[int(tf.shape(local)[0]) for local in s.values.values] for s in sums if s.values is not None]
            results["sum_rows"] = [rows for rows, s in zip(held, sums) if len(s.shape) == 2 and s.shape[0] > 4]
        with open(os.path.join(out_dir, f"{info.task_type}-{info.task_id}.json"), "w") as f:
            json.dump(results, f)
        return
    model = mw_workload.build(
        keras_dist.DistributedModel,
        steps_per_execution=int(options.get("--steps-per-execution", 1)),
        communication=json.loads(options.get("--communication", "null")),
        gradient_accumulation_steps=int(options["--accumulation"]) if "--accumulation" in options else None,
    )
    if "--die-at-batch" in options:
        x, y = mw_workload.data(400, seed=3)
        callbacks = []
        if info.task_id == int(options["--die-task-id"]):
            callbacks = [DieAtBatch(int(options["--die-at-batch"]))]
        print("training", info.task_name, flush=True)
        model.fit(x, y, batch_size=4, epochs=1000, callbacks=callbacks, verbose=0)
        return
    results = mw_workload.run(model)
    results["num_replicas_in_sync"] = model.distribute_strategy.num_replicas_in_sync
    results["collectives_per_train_step"] = collectives_per_step(model.train_function)
    results["bytes_per_pack"] = model.communication.resolved(model.distribute_strategy).bytes_per_pack
    results["communication"] = model.communication.describe(model.distribute_strategy)
    results["is_chief"] = keras_dist.is_chief()
    with open(os.path.join(out_dir, f"{info.task_type}-{info.task_id}.json"), "w") as f:
        json.dump(results, f)
    print("done", info.task_name, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
