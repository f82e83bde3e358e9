"""Traces, XLA compilations and step time of variable-length and fixed-shape training, with and without XLA.

A benchmark, not a test: it prints what it measured in this run and writes
JSON (`--json`), asserting nothing about speed (issue 7, item 7).

Part 1, variable-length sequences: `--examples` token sequences of 4 to
`--max-length` tokens (log-normal lengths, most short), global batch
`--global-batch-size`, a per-token MLP (Embedding with `mask_zero`, Dense 128,
masked average pooling, Dense 1; its work grows with the padded length),
trained by `DistributedModel.fit` on `--cpu-replicas` simulated CPU replicas,
from two pipelines:

  padded_batch   `dataset.padded_batch(global_batch_size)`: each batch padded
                 to its own longest sequence, a new shape for almost every batch;
  bucketed       `keras_dist.data.bucket_by_length(boundaries=...)`: padded to
                 one of a few bucket lengths;

each with `jit_compile=False` and `True` (XLA compiles each replica's forward
and backward pass). For every run (its own process, in the order A B C D A B C
D ... for `--repeats`): the padding fraction of the batched tokens, train
function traces per epoch (`RetracingMonitor`), XLA compilations (TensorFlow's
own log line "Compilation of XLA executable", one per compiled shape per
replica), and seconds per epoch; the first epoch includes tracing and
compilation, later ones are steady state.

Part 2, fixed shapes: the median step time of a small CNN (32x32x3, 3
convolutions) and an MLP 784-512-512-10 on the same replicas, with and without
XLA, interleaved, as ratios XLA / no XLA.

    python benchmarks/dynamic_graphs.py [--cpu-replicas 2] [--repeats 2] [--json out.json]

About 4 minutes on 2 CPU cores with the defaults.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VARIABLE_LENGTH = r"""
import json, sys, time
import keras_dist.testing
args = json.loads(sys.argv[1])
keras_dist.testing.simulate_cpu_devices(args["cpu_replicas"])
import keras, numpy as np, tensorflow as tf
import keras_dist
from keras_dist.callbacks import RetracingMonitor

rng = np.random.RandomState(0)
lengths = np.clip(rng.lognormal(3.0, 0.8, args["examples"]).astype(int), 4, args["max_length"])
tokens = [rng.randint(1, 1000, n).astype("int32") for n in lengths]
labels = (lengths > np.median(lengths)).astype("float32")
dataset = tf.data.Dataset.from_generator(
    lambda: zip(tokens, labels),
    output_signature=(tf.TensorSpec((None,), tf.int32), tf.TensorSpec((), tf.float32)),
).cache()
if args["pipeline"] == "bucketed":
    batches = keras_dist.data.bucket_by_length(
        dataset, boundaries=args["boundaries"], global_batch_size=args["global_batch_size"]
    )
else:
    batches = dataset.padded_batch(args["global_batch_size"])
padded = sum(int(np.prod(x.shape)) for x, _ in batches)
padding = 1 - int(lengths.sum()) / padded

strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args["cpu_replicas"])])
keras.utils.set_random_seed(0)
inputs = keras.Input((None,), dtype="int32")
hidden = keras.layers.Embedding(1000, 64, mask_zero=True)(inputs)
hidden = keras.layers.Dense(128, activation="relu")(hidden)
hidden = keras.layers.GlobalAveragePooling1D()(hidden)
model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(hidden), strategy=strategy)
model.compile(optimizer="adam", loss=keras.losses.BinaryCrossentropy(from_logits=True), jit_compile=args["jit_compile"])


class EpochTimes(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        logs["seconds"] = time.perf_counter() - self.start
        print(f"EPOCH {epoch}", file=sys.stderr, flush=True)  # Splits the XLA log per epoch.


history = model.fit(batches, epochs=args["epochs"], verbose=0, callbacks=[RetracingMonitor(max_traces_per_epoch=10**6), EpochTimes()])
print("RESULT " + json.dumps({
    "padding_fraction": padding,
    "steps_per_epoch": sum(1 for _ in batches),
    "train_traces": history.history["train_traces"],
    "seconds_per_epoch": history.history["seconds"],
}), flush=True)
"""

FIXED_SHAPE = r"""
import json, sys, time
import keras_dist.testing
args = json.loads(sys.argv[1])
keras_dist.testing.simulate_cpu_devices(args["cpu_replicas"])
import keras, numpy as np, tensorflow as tf
import keras_dist

strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args["cpu_replicas"])])
keras.utils.set_random_seed(0)
if args["workload"] == "cnn":
    inputs = keras.Input((32, 32, 3))
    hidden = inputs
    for filters in (32, 64, 64):
        hidden = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(hidden)
        hidden = keras.layers.MaxPooling2D()(hidden)
    outputs = keras.layers.Dense(10)(keras.layers.Flatten()(hidden))
    shape = (32, 32, 3)
else:
    inputs = keras.Input((784,))
    hidden = keras.layers.Dense(512, activation="relu")(inputs)
    hidden = keras.layers.Dense(512, activation="relu")(hidden)
    outputs = keras.layers.Dense(10)(hidden)
    shape = (784,)
model = keras_dist.DistributedModel(inputs, outputs, strategy=strategy)
model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=args["jit_compile"])
batch, steps = args["global_batch_size"], args["steps"]
x = np.random.RandomState(0).rand(batch * steps, *shape).astype("float32")
y = np.random.RandomState(1).randint(0, 10, batch * steps)


class StepTimes(keras.callbacks.Callback):
    times = []

    def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.start)


model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=[StepTimes()], shuffle=False)
print("RESULT " + json.dumps({"median_step_seconds": statistics.median(StepTimes.times[5:])}), flush=True)
"""


def _run(program, args):
    """Runs `program` in a fresh Python with `args`; returns (its RESULT dict, XLA compilations per epoch)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="device_compiler=2", KERAS_DIST_QUIET="1")
    process = subprocess.run(
        [sys.executable, "-c", "import statistics\n" + program, json.dumps(args)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    results = [line[len("RESULT ") :] for line in process.stdout.splitlines() if line.startswith("RESULT ")]
    if process.returncode != 0 or not results:
        raise RuntimeError(f"benchmark run failed ({args}):\n{process.stderr[-3000:]}")
    compilations, per_epoch = 0, []
    for line in process.stderr.splitlines():
        if "Compilation of XLA executable" in line:
            compilations += 1
        elif line.startswith("EPOCH "):
            per_epoch.append(compilations)
            compilations = 0
    return json.loads(results[0]), per_epoch


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-replicas", type=int, default=2)
    parser.add_argument("--examples", type=int, default=2048)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument(
        "--boundaries",
        default="16,32,64,128",
        help="bucket boundaries, tokens (the last bucket ends at --max-length + 1)",
    )
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="steps per fixed-shape run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    started = time.perf_counter()
    boundaries = [int(b) for b in args.boundaries.split(",")] + [args.max_length + 1]

    print(
        f"Part 1: {args.examples} sequences of 4-{args.max_length} tokens, global batch {args.global_batch_size}, "
        f"{args.cpu_replicas} CPU replicas, {args.epochs} epochs, {args.repeats} interleaved runs each"
    )
    variable = {}
    for _ in range(args.repeats):
        for pipeline in ("padded_batch", "bucketed"):
            for jit_compile in (False, True):
                result, compilations = _run(
                    VARIABLE_LENGTH,
                    dict(
                        cpu_replicas=args.cpu_replicas,
                        examples=args.examples,
                        max_length=args.max_length,
                        boundaries=boundaries,
                        global_batch_size=args.global_batch_size,
                        epochs=args.epochs,
                        pipeline=pipeline,
                        jit_compile=jit_compile,
                    ),
                )
                result["xla_compilations"] = compilations
                variable.setdefault(f"{pipeline} jit_compile={jit_compile}", []).append(result)
    print(
        f"{'pipeline':<30} {'padding':>8} {'traces/epoch':>14} {'XLA compilations/epoch':>24} {'s/epoch (1st)':>14} {'s/epoch (later)':>16}"
    )
    summary = {}
    for name, runs in variable.items():
        first = statistics.median(r["seconds_per_epoch"][0] for r in runs)
        later = statistics.median(s for r in runs for s in r["seconds_per_epoch"][1:])
        summary[name] = dict(runs[0], first_epoch_seconds=first, later_epoch_seconds=later)
        print(
            f"{name:<30} {runs[0]['padding_fraction']:>8.0%} {str(runs[0]['train_traces']):>14} "
            f"{str(runs[0]['xla_compilations']):>24} {first:>14.2f} {later:>16.2f}"
        )
    for jit_compile in (False, True):
        ratio = (
            summary[f"bucketed jit_compile={jit_compile}"]["later_epoch_seconds"]
            / summary[f"padded_batch jit_compile={jit_compile}"]["later_epoch_seconds"]
        )
        print(f"bucketed / padded_batch, later epochs, jit_compile={jit_compile}: {ratio:.2f}x")

    print(f"\nPart 2: fixed shapes, global batch 256, {args.cpu_replicas} CPU replicas, median step time")
    fixed = {}
    for _ in range(args.repeats):
        for workload in ("cnn", "mlp"):
            for jit_compile in (False, True):
                result, _ = _run(
                    FIXED_SHAPE,
                    dict(
                        cpu_replicas=args.cpu_replicas,
                        workload=workload,
                        jit_compile=jit_compile,
                        global_batch_size=256,
                        steps=args.steps,
                    ),
                )
                fixed.setdefault((workload, jit_compile), []).append(result["median_step_seconds"])
    fixed_summary = {}
    for workload in ("cnn", "mlp"):
        plain, xla = (statistics.median(fixed[(workload, j)]) for j in (False, True))
        fixed_summary[workload] = {"no_xla_seconds": plain, "xla_seconds": xla, "ratio": xla / plain}
        print(f"{workload}: no XLA {plain * 1e3:.1f} ms, XLA {xla * 1e3:.1f} ms, XLA / no XLA {xla / plain:.2f}x")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arguments": vars(args), "variable_length": summary, "fixed_shape": fixed_summary}, f, indent=1)


if __name__ == "__main__":
    main()
