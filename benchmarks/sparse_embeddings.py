"""What an embedding table costs per step: bytes summed between replicas, step time, accumulator memory, peak RSS.

A benchmark, not a test: it prints what it measured in this run (ratios, with
the load average before each measurement) and writes JSON (`--json`); it
asserts nothing about speed. The machine it runs on may be shared and busy:
read the figures as hints, under the load average printed next to them.

The workload is a small recommender: each example looks up `--ids-per-example`
ids in an `Embedding(rows, --dim)` table (a fifth of them from 100 popular ids,
so ids repeat within a batch), averages them and predicts one number with a
`Dense(1)`; plain SGD (no slots, so memory shows the table and the gradients,
not the optimizer), global batch `--global-batch-size` on 2 simulated CPU
replicas (`MirroredStrategy`, TensorFlow's `ReductionToOneDevice`). For each
table size it runs four variants, each in a fresh process:

  rows            keras-dist's default: the table's gradient is all-gathered as rows
  dense           `CommunicationOptions(sparse_gradients="dense")`: densified first
  rows k=K        `SGD(gradient_accumulation_steps=K)`, summed as rows merged by index
  dense k=K       the same, densified (Keras' own accumulation is dense)

and measures:

  bytes/step      what the replicas hand to the cross-device reduction per step
                  (micro-batch), counted at run time by a `ReductionToOneDevice`
                  that adds up the sizes of the values it reduces (a dense
                  gradient: its size; rows: values + int64 indices), averaged over
                  the timed steps. With k, the sums go out on every k-th step.
  ms/step         median wall time of the timed steps (after warm-up steps).
  sums MB         keras-dist's running sums held at the end (mid-cycle, after
                  K-1 micro-batches), over both replicas.
  Keras acc MB    Keras' own accumulators (`gradient_accumulation_steps` makes
                  Keras allocate one per variable, table-sized; keras-dist keeps
                  them zero), over both replicas.
  peak RSS MB     the process's peak resident memory (`ru_maxrss`).

A variant whose run would not fit in the memory available (estimated as 1 GiB
plus the copies of the table it held in a measured run, `TABLE_COPIES`) is
skipped and says so.

    python benchmarks/sparse_embeddings.py [--rows 10000,1000000,10000000] [--dim 64] [--steps 20] \\
        [--accumulation-steps 4] [--json out.json]
    python benchmarks/sparse_embeddings.py --quick     # seconds: small tables, one process
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

REPLICAS = 2
WARMUP_STEPS = 3
VARIANTS = [("rows", None), ("dense", None), ("rows", "k"), ("dense", "k")]


def _measure(config):
    """One variant in this process: returns its figures (a dict)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_dist
    from keras_dist._runtime import optimizer_patches

    class CountingReduction(tf.distribute.ReductionToOneDevice):
        """Adds up, at run time, the bytes of every replica's value handed to a reduction."""

        def __init__(self):
            super().__init__()
            self.bytes = tf.Variable(0.0, dtype=tf.float64, trainable=False)

        def _count(self, reduced, values):
            total = tf.constant(0.0, tf.float64)
            for value in values:
                for local in tf.distribute.get_strategy().experimental_local_results(value):
                    parts = [local.values, local.indices] if isinstance(local, tf.IndexedSlices) else [local]
                    for part in parts:
                        total += tf.cast(tf.size(part), tf.float64) * part.dtype.size
            with tf.control_dependencies(tf.nest.flatten(reduced, expand_composites=True)):
                self.bytes.assign_add(total)
            return reduced

        def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
            # TensorFlow's batch reduction calls this once per value: every value is counted here, once.
            reduced = super().reduce_implementation(reduce_op, per_replica_value, destinations, options)
            return self._count(reduced, [per_replica_value])

    counting = CountingReduction()
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)], cross_device_ops=counting)
    rows, dim, k = config["rows"], config["dim"], config["accumulation_steps"]
    inputs = keras.Input((config["ids_per_example"],), dtype="int32")
    table = keras.layers.Embedding(rows, dim, name="table")
    outputs = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(table(inputs)))
    model = keras_dist.DistributedModel(
        inputs,
        outputs,
        strategy=strategy,
        communication=keras_dist.CommunicationOptions(sparse_gradients=config["sparse_gradients"]),
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=k), loss="mse")
    # Ends mid-cycle (K-1 micro-batches into one) so that the running sums are at their largest.
    timed = config["steps"] + (k - 1 - config["steps"] - WARMUP_STEPS) % k if k else config["steps"]
    total_steps = WARMUP_STEPS + timed
    rs = np.random.RandomState(0)
    batch = config["global_batch_size"]
    ids = rs.randint(0, rows, (total_steps * batch, config["ids_per_example"]))
    popular = rs.rand(*ids.shape) < 0.2
    ids[popular] = rs.randint(0, min(100, rows), popular.sum())
    y = rs.rand(len(ids), 1).astype("float32")

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds, self.start, self.bytes_start = [], None, None

        def on_train_batch_begin(self, batch, logs=None):
            if batch == WARMUP_STEPS:
                self.bytes_start = float(counting.bytes.numpy())
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            if batch >= WARMUP_STEPS:
                float(logs["loss"]) if logs and "loss" in logs else None  # Waits for the step.
                self.seconds.append(time.perf_counter() - self.start)

    timer = Timer()
    model.fit(ids.astype("int32"), y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    bytes_per_step = (float(counting.bytes.numpy()) - timer.bytes_start) / len(timer.seconds)
    state = optimizer_patches.state(model.optimizer)
    sums_bytes = state.sums.num_bytes() if state is not None and state.sums is not None else 0
    keras_accumulators = getattr(model.optimizer, "_accumulated_gradients", None) or []
    keras_bytes = REPLICAS * sum(int(np.prod(v.shape)) * 4 for v in keras_accumulators)
    return {
        **config,
        "timed_steps": len(timer.seconds),
        "median_step_seconds": float(np.median(timer.seconds)),
        "bytes_per_step": bytes_per_step,
        "sums_bytes": sums_bytes,
        "keras_accumulator_bytes": keras_bytes,
        "table_bytes": rows * dim * 4,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _available_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def _in_fresh_process(config):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_DIST_QUIET": "1", "TF_ENABLE_ONEDNN_OPTS": "0"}
        env.pop("TF_CONFIG", None)
        command = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(config), out]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            return {**config, "note": f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"}
        with open(out) as f:
            return json.load(f)


def _worker(config_json, out):
    import keras_dist.testing

    keras_dist.testing.simulate_cpu_devices(REPLICAS)
    with open(out, "w") as f:
        json.dump(_measure(json.loads(config_json)), f)


def _configs(args, rows):
    for sparse_gradients, k in VARIANTS:
        yield {
            "rows": rows,
            "dim": args.dim,
            "sparse_gradients": sparse_gradients,
            "accumulation_steps": args.accumulation_steps if k else None,
            "steps": args.steps,
            "global_batch_size": args.global_batch_size,
            "ids_per_example": args.ids_per_example,
        }


# Peak RSS in copies of the table, per variant, measured with a 10M x 64 table on 2 replicas
# (2.56 GB each): 4.1 (rows), 5.1 (dense), 5.1 (rows, k=4), 7.0 (dense, k=4); with a margin.
TABLE_COPIES = {("rows", False): 4.5, ("dense", False): 5.5, ("rows", True): 5.5, ("dense", True): 7.5}


def _run(args):
    results = []
    for rows in args.rows:
        for config in _configs(args, rows):
            config["load_average"] = os.getloadavg()[0]
            available = _available_bytes()
            copies = TABLE_COPIES[config["sparse_gradients"], bool(config["accumulation_steps"])]
            estimate = 2**30 + copies * rows * args.dim * 4
            if available and not args.quick and estimate > 0.9 * available:
                note = f"skipped: needs ~{estimate / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available"
                results.append({**config, "note": note})
                continue
            results.append(_measure(config) if args.quick else _in_fresh_process(config))
    return results


def _print(results, args):
    mib = 2**20
    print(
        f"Embedding(rows, {args.dim}) recommender, {REPLICAS} simulated CPU replicas (MirroredStrategy), "
        f"global batch {args.global_batch_size} x {args.ids_per_example} ids, SGD, k={args.accumulation_steps}, "
        f"{args.steps} timed steps{' (quick: one process, peak RSS cumulative)' if args.quick else ''}"
    )
    print(f"load average at start: {results[0]['load_average'] if results else os.getloadavg()[0]:.2f}\n")
    header = (
        f"{'rows':>10} {'variant':<10}{'bytes/step':>14}{'ms/step':>9}{'sums MB':>9}"
        f"{'Keras acc MB':>13}{'peak RSS MB':>12}{'load':>6}  note"
    )
    print(header)
    for r in results:
        variant = r["sparse_gradients"] + (f" k={r['accumulation_steps']}" if r["accumulation_steps"] else "")
        if "note" in r:
            print(f"{r['rows']:>10,} {variant:<10}{'':>63}{r['load_average']:>6.2f}  {r['note']}")
            continue
        print(
            f"{r['rows']:>10,} {variant:<10}{r['bytes_per_step']:>14,.0f}{r['median_step_seconds'] * 1e3:>9.1f}"
            f"{r['sums_bytes'] / mib:>9.2f}{r['keras_accumulator_bytes'] / mib:>13.1f}"
            f"{r['peak_rss_bytes'] / mib:>12.0f}{r['load_average']:>6.2f}"
        )
    done = {(r["rows"], r["sparse_gradients"], r["accumulation_steps"]): r for r in results if "note" not in r}
    print("\nratios, densified / rows (same table, same k):")
    for (rows, kind, k), dense in sorted(done.items(), key=lambda item: (item[0][0], str(item[0][2]))):
        sparse = done.get((rows, "rows", k))
        if kind != "dense" or sparse is None:
            continue
        print(
            f"  {rows:>10,} k={k or 1}: bytes/step {dense['bytes_per_step'] / sparse['bytes_per_step']:.1f}x, "
            f"ms/step {dense['median_step_seconds'] / sparse['median_step_seconds']:.2f}x, "
            f"peak RSS {dense['peak_rss_bytes'] / sparse['peak_rss_bytes']:.2f}x"
        )
    smallest = min(args.rows)
    print(f"\nstep rate against the {smallest:,}-row table (rows variants; 1.00x: the table costs nothing per step):")
    for (rows, kind, k), r in sorted(done.items(), key=lambda item: (str(item[0][2]), item[0][0])):
        base = done.get((smallest, kind, k))
        if kind == "rows" and base is not None:
            ratio = base["median_step_seconds"] / r["median_step_seconds"]
            print(f"  {rows:>10,} k={k or 1}: {ratio:.2f}x")
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="10000,1000000,10000000", help="table sizes, comma-separated")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help=f"timed steps (after {WARMUP_STEPS} warm-up steps)")
    parser.add_argument("--accumulation-steps", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--ids-per-example", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="tables of 1,000 and 20,000 rows, 3 steps, one process")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.steps = "1000,20000", 3
        import keras_dist.testing

        keras_dist.testing.simulate_cpu_devices(REPLICAS)
    args.rows = [int(r) for r in args.rows.split(",")]
    results = _run(args)
    _print(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"replicas": REPLICAS, "load_average_end": os.getloadavg()[0], "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
