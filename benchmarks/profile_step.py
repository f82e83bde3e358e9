"""Where the MLP's step time goes on 1 replica, 2 simulated replicas and 2 workers.

A benchmark, not a test: it prints what it measured in this run and writes
JSON (`--json`), asserting nothing about speed.

Timing with parts switched on one at a time, all in one process per topology
(1x1 and 1x2 directly, 2x1 under `keras-dist launch`), same strategy object,
same model (784-512-512-10, SGD, global batch `--global-batch-size`), variants
interleaved over `--repeats` rounds, median ms/step of `--steps` steps after
warm-up (each `fit` call runs 2 epochs of `--steps` and only the second is
timed, so the distributed iterator that every `fit` call creates is not counted):

  input            `next()` on the distributed dataset, in a `tf.function`
  forward_backward input + forward + gradients (no all-reduce, no update)
  all_reduce       the above + the gradients summed over replicas
                   (`ReplicaContext.all_reduce`), no update
  loop             input + forward + gradients + Keras' `optimizer.apply`
                   (which all-reduces the gradients itself): a custom loop
  loop_sync        loop + fetching the loss to the host every step (what `fit`
                   does for its logs)
  keras_fit        raw Keras 3 `fit` (not on several workers: it fails there)
  keras_fit_cb     keras_fit + one no-op `on_train_batch_end` callback
  keras_dist_fit   `keras_dist.DistributedModel.fit`
  keras_dist_fit-<fix>  the same with one compat fix disabled
                   (`keras_dist._compat.disabled`), to price each fix's per-step work

Tracing: seconds of the first `fit` call (trace + first step) for keras_fit and
keras_dist_fit. Differences of these rows are the per-step costs written up in
docs/performance.md.

    python benchmarks/profile_step.py [--topologies 1x1,1x2,2x1] [--steps 20] [--repeats 3] [--json out.json]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

WORKER = r'''
import json, os, statistics, sys, time
import keras_dist
import keras, numpy as np, tensorflow as tf
from keras_dist import _compat

steps, repeats, batch, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
FIXES = ["example_weighted_loss", "cross_replica_metrics", "sum_gradients_before_apply"]
strategy = keras_dist.resolve_strategy("auto")
multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
rng = np.random.RandomState(0)
x, y = rng.rand(batch * 8, 784).astype("float32"), rng.randint(0, 10, batch * 8).astype("int32")
ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch, drop_remainder=True).prefetch(2)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)


def layers():
    inputs = keras.Input((784,))
    h = keras.layers.Dense(512, activation="relu")(keras.layers.Dense(512, activation="relu")(inputs))
    return inputs, keras.layers.Dense(10)(h)


def raw_model():
    with strategy.scope():
        model = keras.Model(*layers())
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.optimizer.build(model.trainable_variables)
    return model


def loop_variant(part, sync=False):
    model = raw_model()
    iterator = iter(strategy.experimental_distribute_dataset(ds))

    def replica_step(x, y):
        if part == "input":
            return tf.reduce_sum(y)
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(y, model(x, training=True)), global_batch_size=batch)
        grads = tape.gradient(loss, model.trainable_variables)
        if part == "all_reduce":
            grads = tf.distribute.get_replica_context().all_reduce("SUM", grads)
        if part == "loop":
            model.optimizer.apply(grads, model.trainable_variables)
            return loss
        return loss + tf.add_n([tf.reduce_sum(g[:1]) for g in grads]) * 0.0  # Keeps the gradients alive.

    @tf.function
    def step():
        x, y = next(iterator)
        return strategy.reduce("SUM", strategy.run(replica_step, args=(x, y)), axis=None)

    def run(n):
        float(step())
        start = time.perf_counter()
        for _ in range(n):
            value = step()
            if sync:
                float(value)
        float(value)
        return (time.perf_counter() - start) / n
    run.functions = [step]
    return run


class NoOp(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        pass


class EpochTimer(keras.callbacks.Callback):
    """Epoch hooks only: times the second epoch (the first pays for the new iterator of each fit call)."""

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds = time.perf_counter() - self.start


def fit_variant(kind, fix=None, callback=False):
    def make():
        if kind == "keras":
            return raw_model()
        model = keras_dist.DistributedModel(*layers())
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    with _compat.disabled(*([fix] if fix else [])):
        model = make()
        callbacks = [NoOp()] if callback else []
        start = time.perf_counter()
        model.fit(ds, steps_per_epoch=1, epochs=1, verbose=0, callbacks=callbacks)
        first_call = time.perf_counter() - start

    def run(n):
        timer = EpochTimer()
        with _compat.disabled(*([fix] if fix else [])):
            model.fit(ds, steps_per_epoch=n, epochs=2, verbose=0, callbacks=callbacks + [timer])
        return timer.seconds / n
    run.first_call_seconds = first_call
    run.functions = [c.cell_contents for c in model.train_function.__closure__ or []
                     if hasattr(c.cell_contents, "experimental_get_tracing_count")]
    return run


def graph_ops(functions):
    """Counts the ops of every traced graph of `functions` (nested function bodies included)."""
    counts = {}

    def walk(graph):
        for op in graph.get_operations():
            counts[op.type] = counts.get(op.type, 0) + 1
        for function in graph._functions.values():
            if hasattr(function, "graph"):
                walk(function.graph)

    for function in functions:
        for concrete in function._list_all_concrete_functions():
            walk(concrete.graph)
    return counts


variants = {
    "input": loop_variant("input", sync=False),
    "forward_backward": loop_variant("forward_backward"),
    "all_reduce": loop_variant("all_reduce"),
    "loop": loop_variant("loop"),
    "loop_sync": loop_variant("loop", sync=True),
}
if not multi_worker:
    variants["keras_fit"] = fit_variant("keras")
    variants["keras_fit_cb"] = fit_variant("keras", callback=True)
variants["keras_dist_fit"] = fit_variant("keras_dist")
if strategy.num_replicas_in_sync > 1:
    for fix in FIXES:
        variants["keras_dist_fit-" + fix] = fit_variant("keras_dist", fix=fix)

timings = {name: [] for name in variants}
for name, run in variants.items():
    run(3)  # Warm-up.
for _ in range(repeats):
    for name, run in variants.items():
        timings[name].append(run(steps))
results = {
    "num_replicas_in_sync": strategy.num_replicas_in_sync,
    "ms_per_step": {name: statistics.median(t) * 1e3 for name, t in timings.items()},
    "all_runs_ms": {name: [s * 1e3 for s in t] for name, t in timings.items()},
    "first_call_seconds": {name: run.first_call_seconds for name, run in variants.items() if hasattr(run, "first_call_seconds")},
}
graphs = {name: graph_ops(run.functions) for name, run in variants.items()
          if name in ("loop", "keras_fit") or name.startswith("keras_dist_fit")}
results["graph_ops"] = {name: {"total": sum(c.values()), "by_type": c} for name, c in graphs.items()}
if keras_dist.is_chief():
    json.dump(results, open(out, "w"))
'''

BREAKDOWN = (
    ("input pipeline", "input", None),
    ("forward + backward", "forward_backward", "input"),
    ("gradient all-reduce", "all_reduce", "forward_backward"),
    ("optimizer apply (incl. Keras' own all-reduce)", "loop", "forward_backward"),
    ("host sync of the loss", "loop_sync", "loop"),
    ("Keras fit machinery (callbacks, metrics, logs)", "keras_fit", "loop_sync"),
    ("one no-op batch callback", "keras_fit_cb", "keras_fit"),
    ("keras-dist fit over raw Keras fit", "keras_dist_fit", "keras_fit"),
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", default="1x1,1x2,2x1", help="any of 1x1, 1x2, 2x1, 2x2")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant and repeat")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (median reported)")
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_DIST_QUIET": "1"}
    for name in ("TF_CONFIG", "KERAS_DIST_CPU_REPLICAS"):
        env.pop(name, None)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER)
        for topology in args.topologies.split(","):
            workers, replicas = (int(n) for n in topology.split("x"))
            out = os.path.join(tmp, f"{topology}.json")
            worker_args = [script, str(args.steps), str(args.repeats), str(args.global_batch_size), out]
            if workers == 1:
                command = [sys.executable, *worker_args]
                run_env = {**env, "KERAS_DIST_CPU_REPLICAS": str(replicas)}
            else:
                command = [
                    sys.executable,
                    "-m",
                    "keras_dist.cli",
                    "launch",
                    "--num-workers",
                    str(workers),
                    "--cpu-replicas",
                    str(replicas),
                    *worker_args,
                ]
                run_env = env
            proc = subprocess.run(command, env=run_env, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{topology}: exit status {proc.returncode}")
            with open(out) as f:
                results[topology] = json.load(f)
    print_tables(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=2)


def print_tables(results):
    topologies = list(results)
    names = list(dict.fromkeys(name for r in results.values() for name in r["ms_per_step"]))
    print(
        f"\nms per step (median of the repeats), MLP 784-512-512-10\n{'variant':<50}"
        + "".join(f"{t:>10}" for t in topologies)
    )
    for name in names:
        cells = [results[t]["ms_per_step"].get(name) for t in topologies]
        print(f"{name:<50}" + "".join(f"{c:>10.2f}" if c is not None else f"{'-':>10}" for c in cells))
    print(
        f"\nwhere the time goes (differences of the rows above, ms per step)\n{'part':<50}"
        + "".join(f"{t:>10}" for t in topologies)
    )
    for label, name, base in BREAKDOWN:
        cells = []
        for t in topologies:
            ms = results[t]["ms_per_step"]
            cells.append(
                ms[name] - (ms[base] if base else 0.0) if name in ms and (base is None or base in ms) else None
            )
        print(f"{label:<50}" + "".join(f"{c:>10.2f}" if c is not None else f"{'-':>10}" for c in cells))
    fixes = sorted({n for r in results.values() for n in r["ms_per_step"] if n.startswith("keras_dist_fit-")})
    for name in fixes:
        cells = []
        for t in topologies:
            ms = results[t]["ms_per_step"]
            cells.append(ms["keras_dist_fit"] - ms[name] if name in ms else None)
        label = "fix " + name.split("-", 1)[1] + " costs"
        print(f"{label:<50}" + "".join(f"{c:>10.2f}" if c is not None else f"{'-':>10}" for c in cells))
    print(
        "\nops in the traced step (all replicas of this worker; collectives = Collective* ops, AddN sums on one host)"
    )
    for t in topologies:
        graphs = results[t].get("graph_ops", {})
        print(
            f"  {t}: "
            + ", ".join(
                f"{name} {g['total']} ops ({_collectives(g['by_type'])} collectives, {g['by_type'].get('AddN', 0)} AddN)"
                for name, g in graphs.items()
            )
        )
    print("\nfirst fit call (trace + first step), seconds")
    for t in topologies:
        print(
            f"  {t}: "
            + ", ".join(
                f"{k} {v:.2f}"
                for k, v in results[t]["first_call_seconds"].items()
                if "-" not in k and k != "keras_fit_cb"
            )
        )


def _collectives(by_type):
    return sum(n for op, n in by_type.items() if op.startswith("Collective"))


if __name__ == "__main__":
    main()
