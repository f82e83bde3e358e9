"""Worker script for the multi-worker test of `keras_dist.ops` (issue 25), started by `run_workers`.

Usage: gather_worker.py OUT_DIR
Under `MultiWorkerMirroredStrategy` (one CPU replica per worker), gathers uneven parts (2 and 1
examples) and parts with an empty one (1 and 0) with `keras_dist.ops.all_gather`, and writes
OUT_DIR/worker-<task_id>.json: per case the gathered values (features and integer labels), this
replica's `global_batch_offset`, `num_replicas` and the gradient of a weighted sum of the
gathered values with respect to this replica's own part; then the batches of a distributed
dataset (4 examples at batch 3: parts 2/1, then 1/0), its features and labels gathered as they
come from the iterator.
"""

import json
import os
import sys

import keras_dist  # keras_dist: joins the cluster before TensorFlow runs anything.

CASES = {
    "uneven": [[0.0, 1.0], [2.0]],  # replica r's examples' values (ids), global order 0, 1, 2
    "empty_part": [[3.0], []],
}


def gather_case(strategy, parts):
    import tensorflow as tf
    from keras import ops

    own = parts[keras_dist.task_id()]  # one replica per worker: worker i holds replica i's part

    def step():
        features = tf.reshape(tf.constant(own, tf.float32), [len(own), 1])
        labels = tf.cast(features[:, 0], tf.int32)
        with tf.GradientTape() as tape:
            tape.watch(features)
            gathered, gathered_labels = keras_dist.ops.all_gather((features, labels))
            positions = ops.arange(1.0, 1.0 + ops.cast(ops.shape(gathered)[0], "float32"))
            loss = ops.sum(gathered[:, 0] * positions)  # position i's gradient: i + 1 (per replica's loss)
        gradient = tape.gradient(loss, features)
        return gathered, gathered_labels, keras_dist.ops.global_batch_offset(features), gradient

    outputs = tf.function(lambda: strategy.run(step))()
    gathered, gathered_labels, offset, gradient = (strategy.experimental_local_results(o)[0] for o in outputs)
    return {
        "gathered": gathered.numpy()[:, 0].tolist(),
        "gathered_labels": gathered_labels.numpy().tolist(),
        "offset": int(offset),
        "gradient": gradient.numpy()[:, 0].tolist(),
    }


def gather_dataset(strategy):
    """Each step's gathered ids and labels and this replica's offset, for a dataset of 4 examples at batch 3."""
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices(([[0.0], [1.0], [2.0], [3.0]], [10, 11, 12, 13])).batch(3)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    iterator = iter(strategy.experimental_distribute_dataset(dataset.with_options(options)))

    def step(x, y):  # the labels straight from the iterator: an input without a device under this strategy
        return keras_dist.ops.all_gather(x), keras_dist.ops.all_gather(y), keras_dist.ops.global_batch_offset(x)

    run = tf.function(lambda iterator: strategy.run(step, next(iterator)))
    steps = []
    for _ in range(2):
        x, y, offset = (strategy.experimental_local_results(o)[0] for o in run(iterator))
        steps.append(
            {"gathered": x.numpy()[:, 0].tolist(), "gathered_labels": y.numpy().tolist(), "offset": int(offset)}
        )
    return steps


def main(out_dir):
    strategy = keras_dist.resolve_strategy()
    results = {
        "strategy": type(strategy).__name__,
        "num_replicas_in_sync": strategy.num_replicas_in_sync,
        "num_replicas": None,
    }
    with strategy.scope():
        results["num_replicas"] = keras_dist.ops.num_replicas()
    for name, parts in CASES.items():
        results[name] = gather_case(strategy, parts)
    results["dataset"] = gather_dataset(strategy)
    with open(os.path.join(out_dir, f"worker-{keras_dist.task_id()}.json"), "w") as f:
        json.dump(results, f)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
