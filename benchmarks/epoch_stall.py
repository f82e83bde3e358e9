"""The slow epochs on 2 CPU workers: TensorFlow's, with or without Keras and keras-dist (issue 23 item 0).

A benchmark, not a test: it prints what this run measured and writes JSON (`--json`), asserting
nothing about speed. Each variant runs a plain TensorFlow training loop (an MLP 784-512-512-10
built from `tf.Variable`s, SGD, gradients summed with `ReplicaContext.all_reduce`) on 2 fresh
worker processes under `MultiWorkerMirroredStrategy` on loopback, one intra-op and one inter-op
thread per worker (the launcher's share of 2 cores), global batch 256:

  finite            what Keras' `fit` does: a finite dataset, a new distributed iterator each
                    epoch, run to its end (OutOfRange)
  finite-no-check   the same, with TensorFlow's per-step end-of-data all-reduce off (what
                    keras-dist does for inputs of known length)
  finite-released   `finite`, each epoch's iterator dropped on keras-dist's deleting threads
                    (`keras_dist._runtime.iterator_release`), not on the thread that runs the steps
  repeated          `dataset.repeat()`, one iterator for the whole run, `--steps` per epoch

and the same MLP with Keras and keras-dist (`DistributedModel`, SGD, its own thread settings):

  keras-dist-arrays     `fit(x, y, batch_size=256)`: Keras makes a new iterator each epoch, and
                        keras-dist destroys the old ones on its deleting threads (compat fix
                        `blocking_iterator_deletion`)
  keras-dist-arrays-blocking   the same with that fix off: Keras' thread destroys them
  keras-dist-repeated   `fit(dataset.repeat(), steps_per_epoch=...)`: Keras keeps one iterator

For every epoch it records the time to create the iterator, the first step, the median of the
other steps and the time to drop the iterator, and prints each epoch's overhead (its wall time
less its steps at the median step time; for Keras, from a callback's epoch and batch ends) and how many epochs stalled (overhead above 0.8 s). A
stall of about 1.25 s (or a multiple), at an iterator's first step or deletion, is what made
the issue's epochs bimodal; the first epoch (tracing) is left out. It is spent destroying the
old iterator: the same deletion on another thread (`finite-released`) holds up no step.

    python benchmarks/epoch_stall.py [--epochs 20] [--steps 60] [--rounds 2] [--json out.json]

About 10 minutes on 2 CPU cores with the defaults.
"""

import argparse
import json
import os
import statistics

import collective_knobs

WORKER = r"""
import gc, json, os, statistics, sys, time
variant, epochs, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if variant == "keras-dist-arrays-blocking":
    os.environ["KERAS_DIST_DISABLE_FIXES"] = "blocking_iterator_deletion"
if variant.startswith("keras-dist"):
    import keras_dist  # Joins the cluster before TensorFlow runs anything.
if variant == "finite-released":  # The module alone (stdlib only): importing keras_dist would join the cluster.
    import importlib.util

    package = os.path.dirname(importlib.util.find_spec("keras_dist").origin)
    spec = importlib.util.spec_from_file_location("iterator_release", os.path.join(package, "_runtime", "iterator_release.py"))
    iterator_release = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(iterator_release)
import numpy as np
import tensorflow as tf

if variant.startswith("keras-dist"):
    import keras

    rs = np.random.RandomState(0)
    x = rs.rand(256 * steps, 784).astype("float32")
    y = rs.randint(0, 10, 256 * steps).astype("int32")
    inputs = keras.Input((784,))
    h = keras.layers.Dense(512, activation="relu")(inputs)
    h = keras.layers.Dense(512, activation="relu")(h)
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(10)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.records = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = self.last = time.perf_counter()
            self.times = []

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            self.times.append(now - self.last)
            self.last = now

        def on_epoch_end(self, epoch, logs=None):
            self.records.append({"create_s": 0.0, "delete_s": 0.0, "first_step_s": self.times[0],
                                 "other_steps_ms": 1000 * statistics.median(self.times[1:]),
                                 "steps": len(self.times), "epoch_s": time.perf_counter() - self.start})

    timer = Timer()
    if variant.startswith("keras-dist-arrays"):
        model.fit(x, y, batch_size=256, epochs=epochs, shuffle=False, verbose=0, callbacks=[timer])
    else:
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(256).repeat()
        model.fit(ds, steps_per_epoch=steps, epochs=epochs, verbose=0, callbacks=[timer])
    print(json.dumps(timer.records))
    sys.exit(0)

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
strategy = tf.distribute.MultiWorkerMirroredStrategy()
if variant == "finite-no-check":
    strategy.extended.enable_partial_batch_handling = False
    strategy.extended.experimental_enable_get_next_as_optional = False
rs = np.random.RandomState(0)
x = rs.rand(256 * steps, 784).astype("float32")
y = rs.randint(0, 10, 256 * steps).astype("int32")
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(256)
if variant == "repeated":
    dataset = dataset.repeat()
distributed = strategy.experimental_distribute_dataset(dataset)
with strategy.scope():
    sizes = [784, 512, 512, 10]
    weights = [tf.Variable(rs.normal(0, 0.05, (a, b)).astype("float32")) for a, b in zip(sizes, sizes[1:])]


def replica_step(batch):
    features, labels = batch
    with tf.GradientTape() as tape:
        h = features
        for i, w in enumerate(weights):
            h = tf.matmul(h, w)
            h = tf.nn.relu(h) if i < len(weights) - 1 else h
        loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, h)) / 256.0
    grads = tape.gradient(loss, weights)
    grads = tf.distribute.get_replica_context().all_reduce("sum", grads)
    for w, g in zip(weights, grads):
        w.assign_sub(0.01 * g)
    return loss


@tf.function
def step(iterator):
    return strategy.run(replica_step, args=(next(iterator),))


records = []
iterator = iter(distributed) if variant == "repeated" else None
for epoch in range(epochs):
    record = {}
    start = time.perf_counter()
    if variant != "repeated":
        iterator = iter(distributed)
    record["create_s"] = time.perf_counter() - start
    times = []
    while variant != "repeated" or len(times) < steps:
        t = time.perf_counter()
        try:
            strategy.experimental_local_results(step(iterator))[0].numpy()
        except (StopIteration, tf.errors.OutOfRangeError):
            break
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    if variant == "finite-released":
        iterator_release.hold(iterator)
        iterator = None
    elif variant != "repeated":
        iterator = None
        gc.collect()
    record["delete_s"] = time.perf_counter() - t
    record["first_step_s"] = times[0]
    record["other_steps_ms"] = 1000 * statistics.median(times[1:])
    record["steps"] = len(times)
    record["epoch_s"] = time.perf_counter() - start
    records.append(record)
print(json.dumps(records))
"""

VARIANTS = [
    "finite",
    "finite-no-check",
    "finite-released",
    "repeated",
    "keras-dist-arrays",
    "keras-dist-arrays-blocking",
    "keras-dist-repeated",
]


def run_variant(variant, epochs, steps, timeout=600):
    """Runs one variant on 2 fresh local workers; returns worker 0's per-epoch records (list of dicts).

    Raises:
        RuntimeError: a worker failed (its stderr's tail in the message).
        subprocess.TimeoutExpired: past `timeout` seconds (both workers are killed first).
    """
    outputs = collective_knobs.run_two_workers(WORKER, [variant, str(epochs), str(steps)], timeout)
    return json.loads(outputs[0].strip().splitlines()[-1])


def summarize(records, skip=1):
    """Returns the figures of one run's per-epoch `records`, the first `skip` epochs left out (tracing).

    An epoch's overhead is its wall time less its steps at the median step time of that epoch's
    other steps: the iterator's creation and deletion and the first step's excess, in seconds.
    """
    kept = records[skip:]
    overhead = [r["epoch_s"] - r["steps"] * r["other_steps_ms"] / 1000 for r in kept]
    return {
        "median_epoch_s": statistics.median(r["epoch_s"] for r in kept),
        "median_step_ms": statistics.median(r["other_steps_ms"] for r in kept),
        "epoch_ms_per_step": [1000 * r["epoch_s"] / r["steps"] for r in kept],
        "overhead_s": overhead,
        "median_overhead_s": statistics.median(overhead),
        "stalled_epochs": sum(o > STALL_S for o in overhead),
        "max_create_s": max(r["create_s"] for r in kept),
        "max_first_step_s": max(r["first_step_s"] for r in kept),
        "max_delete_s": max(r["delete_s"] for r in kept),
    }


# An epoch whose overhead is above this many seconds had a stall (not just the iterator's upkeep).
STALL_S = 0.8


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=60, help="global batches of 256 per epoch")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (fresh workers per variant)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(
            f"--variants takes a comma-separated subset of {', '.join(VARIANTS)}. Received: {', '.join(unknown)}."
        )
    results = {"load_average_start": os.getloadavg(), "runs": []}
    print(f"2 workers x 1 CPU replica, MLP 784-512-512-10, global batch 256, {args.steps} steps x {args.epochs} epochs")
    print(
        f"{'variant':<20}{'round':>6}{'step ms':>9}{'epoch s':>9}{'max create/first/delete s':>28}"
        f"{'stalled':>9}  overhead s of each epoch"
    )
    for round_ in range(args.rounds):
        for variant in variants:
            records = run_variant(variant, args.epochs, args.steps)
            figures = summarize(records)
            results["runs"].append({"variant": variant, "round": round_, "records": records, **figures})
            overhead = " ".join(f"{s:.2f}" for s in figures["overhead_s"])
            print(
                f"{variant:<20}{round_:>6}{figures['median_step_ms']:>9.1f}{figures['median_epoch_s']:>9.2f}"
                f"{figures['max_create_s']:>18.2f}/{figures['max_first_step_s']:.2f}/{figures['max_delete_s']:.2f}"
                f"{figures['stalled_epochs']:>9}  {overhead}",
                flush=True,
            )
    results["load_average_end"] = os.getloadavg()
    print(
        f"load average (1, 5, 15 min): {results['load_average_start']} at the start, "
        f"{results['load_average_end']} at the end"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
