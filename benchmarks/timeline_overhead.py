"""What the step timeline costs: keras-dist with it off and on, against keras-dist before it existed.

A benchmark, not a test: it prints what it measured in this run and writes
JSON (`--json`), asserting nothing about speed.

Variants, each in fresh processes (`benchmarks/_suite_worker.py`, the suite's
measurement: `fit` of 1 step, then `--epochs` epochs of `--steps` steps timed
by epoch hooks, the first timed epoch left out), interleaved per repeat
(baseline off on baseline off on ...), so that a slow spell of a busy machine
hits all alike:

  baseline  keras_dist as of `--baseline-ref` (default: the parent of the
            commit that added the timeline), extracted with `git archive`
            and put first on PYTHONPATH
  off       this checkout, no timeline (the default)
  on        this checkout with `KERAS_DIST_TIMELINE=<temporary directory>`
            (a `Timeline` in every `fit`: timestamps inside the step, the
            host reading them after each step, the file and the report)

Printed first: the ops in the train step each variant traces (MLP on 2 CPU
replicas, nested functions included; off must equal baseline, with no
`Timestamp` op). Then per topology: median ms/step of each variant, the
spread of its repeats' medians, and the ratios off / baseline (the promise:
1.00x within the spread) and on / off (the timeline's own cost).

    python benchmarks/timeline_overhead.py [--workload mlp] [--topologies 1x1,1x2,2x1] [--steps 20] \\
        [--epochs 3] [--repeats 3] [--baseline-ref REF] [--json out.json]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import suite

HERE = os.path.dirname(os.path.abspath(__file__))
REPOSITORY = os.path.dirname(HERE)
VARIANTS = ("baseline", "off", "on")
# Counts the ops of the traced train function (nested functions included) after one step on 2 CPU replicas.
OP_COUNT = r"""
import collections, json, os, sys
import keras, numpy as np
import keras_dist
from keras_dist._runtime import keras_internals
inputs = keras.Input((784,))
hidden = keras.layers.Dense(512, activation="relu")(keras.layers.Dense(512, activation="relu")(inputs))
model = keras_dist.DistributedModel(inputs, keras.layers.Dense(10)(hidden))
model.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x, y = np.zeros((64, 784), "float32"), np.zeros((64,), "int32")
model.fit(x, y, batch_size=64, epochs=1, verbose=0)
ops = collections.Counter()
for function in keras_internals.tf_functions_behind(model.train_function):
    for concrete in function._list_all_concrete_functions():
        graph = concrete.graph.as_graph_def()
        ops.update(node.op for node in graph.node)
        ops.update(node.op for f in graph.library.function for node in f.node_def)
print(json.dumps({"file": keras_dist.__file__, "ops": sum(ops.values()), "timestamps": ops["Timestamp"]}))
"""


def default_baseline_ref():
    """Returns the parent of the commit that added keras_dist/callbacks/_timeline.py (the code before the timeline)."""
    added = subprocess.run(
        ["git", "log", "--diff-filter=A", "--format=%H", "--", "keras_dist/callbacks/_timeline.py"],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if not added:
        raise SystemExit("--baseline-ref: the timeline is not committed yet; pass a ref (e.g. main) explicitly")
    return added[-1] + "~1"


def extract(ref, directory):
    """Writes `ref`'s keras_dist package under `directory` (git archive); returns `directory`."""
    os.makedirs(directory, exist_ok=True)
    archive = subprocess.run(["git", "archive", ref, "keras_dist"], cwd=REPOSITORY, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", directory], input=archive.stdout, check=True)
    return directory


def environment(variant, tmp, baseline_dir, topology="1x2"):
    """Returns the environment of a process of `variant`: its keras_dist first on PYTHONPATH, the timeline on or off."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_DIST_QUIET": "1", "SUITE_STARTED_AT": repr(time.time())}
    for name in ("TF_CONFIG", "KERAS_DIST_CPU_REPLICAS", "KERAS_BACKEND", "XLA_FLAGS", "KERAS_DIST_TIMELINE"):
        env.pop(name, None)
    code = baseline_dir if variant == "baseline" else REPOSITORY
    env["PYTHONPATH"] = os.pathsep.join([code, *filter(None, [os.environ.get("PYTHONPATH")])])
    if variant == "on":
        env["KERAS_DIST_TIMELINE"] = os.path.join(tmp, f"timeline-{topology}")
    return env


def count_ops(variant, tmp, baseline_dir):
    """Returns {"file", "ops", "timestamps"} of the train function `variant` traces on 2 CPU replicas."""
    env = {**environment(variant, tmp, baseline_dir), "KERAS_DIST_CPU_REPLICAS": "2"}
    proc = subprocess.run(
        [sys.executable, "-c", OP_COUNT], env=env, capture_output=True, text=True, timeout=300, cwd=tmp
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stdout + proc.stderr)[-300:]}
    return json.loads(lines[-1])


def measure(variant, topology, args, tmp, baseline_dir):
    """Runs one measurement; returns the worker's JSON dict, or {"error": ...}."""
    out = os.path.join(tmp, f"{topology}-{variant}.json")
    env = environment(variant, tmp, baseline_dir, topology)
    command = suite.command_for("keras_dist", topology, args.workload, args, out)
    result, proc = suite.run_measurement(command, env, out, args.timeout, cwd=tmp)
    if "error" not in result and variant == "on":
        result["report"] = [line for line in proc.stdout.splitlines() if "worker" in line]
    return result


def run(args):
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        baseline_dir = extract(args.baseline_ref, os.path.join(tmp, "baseline"))
        for variant in VARIANTS:
            rows[("ops", variant)] = count_ops(variant, tmp, baseline_dir)
            print(f"  ops of the traced train step (1x2), {variant:<9}: {rows[('ops', variant)]}", flush=True)
        for repeat in range(args.repeats):
            for topology in args.topologies:
                for variant in VARIANTS:
                    row = rows.setdefault((topology, variant), {"runs": [], "error": None})
                    if row["error"]:
                        continue
                    result = measure(variant, topology, args, tmp, baseline_dir)
                    if "error" in result:
                        row["error"] = result["error"]
                        continue
                    row["runs"].append(result)
                    print(
                        f"  {topology:<5}{variant:<10} repeat {repeat + 1}: "
                        f"{statistics.median(result['step_seconds']) * 1e3:8.2f} ms/step",
                        flush=True,
                    )
    return rows


def table(rows, args):
    results = []
    for topology in args.topologies:
        entry = {"topology": topology}
        for variant in VARIANTS:
            row = rows.get((topology, variant), {"runs": [], "error": "not run"})
            if row["runs"]:
                entry[variant] = suite.summarize(row["runs"], args.global_batch_size)
                entry[variant]["step_seconds"] = [run["step_seconds"] for run in row["runs"]]
                if variant == "on":
                    entry["report"] = row["runs"][-1].get("report")
            else:
                entry[variant] = {"error": row["error"]}
        for name, top, bottom in (("off_over_baseline", "off", "baseline"), ("on_over_off", "on", "off")):
            if "median_step_seconds" in entry[top] and "median_step_seconds" in entry[bottom]:
                entry[name] = entry[top]["median_step_seconds"] / entry[bottom]["median_step_seconds"]
        results.append(entry)
    ops = {variant: rows.get(("ops", variant), {}) for variant in VARIANTS}
    print(
        "\nops in the traced train step (1x2, nested functions included): "
        + ", ".join(f"{v} {ops[v].get('ops', 'failed')} ({ops[v].get('timestamps', '-')} Timestamp)" for v in VARIANTS)
    )
    print(
        f"\n{args.workload}: global batch {args.global_batch_size}, {args.steps} steps x {args.epochs} timed epochs x "
        f"{args.repeats} repeats; baseline = keras_dist at {args.baseline_ref}"
    )
    print(
        f"{'topology':<10}{'baseline ms':>12}{'off ms':>9}{'on ms':>9}{'spread':>8}{'off / baseline':>16}{'on / off':>10}"
    )
    for entry in results:
        cells = []
        for variant in VARIANTS:
            value = entry[variant].get("median_step_seconds")
            cells.append(f"{value * 1e3:.2f}" if value else "failed")
        spread = max((entry[v].get("spread", 0.0) for v in VARIANTS), default=0.0)
        ratio = lambda key, entry=entry: f"{entry[key]:.3f}x" if key in entry else "-"  # noqa: E731
        print(
            f"{entry['topology']:<10}{cells[0]:>12}{cells[1]:>9}{cells[2]:>9}{spread * 100:>7.1f}%"
            f"{ratio('off_over_baseline'):>16}{ratio('on_over_off'):>10}"
        )
        for variant in VARIANTS:
            if "error" in entry[variant]:
                print(f"  {variant}: {entry[variant]['error']}")
    return results + [{"ops_of_the_traced_train_step_1x2": ops}]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=suite.WORKLOADS, default="mlp")
    parser.add_argument("--topologies", type=lambda text: [t for t in text.split(",") if t], default=["1x1", "1x2"])
    parser.add_argument("--steps", type=int, default=20, help="steps per timed epoch")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per process (after 1 warm-up epoch)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds over the variants")
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--threads-per-worker", type=int, default=None, help="passed to keras-dist launch")
    parser.add_argument("--baseline-ref", default=None, help="git ref of the baseline (default: before the timeline)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per measurement")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    suite._check_topologies(args.topologies)
    args.baseline_ref = args.baseline_ref or default_baseline_ref()
    started = time.perf_counter()
    load_before = os.getloadavg()
    print(f"{os.cpu_count()} CPUs, load average {load_before[0]:.2f} at start", flush=True)
    results = table(run(args), args)
    elapsed = time.perf_counter() - started
    print(f"\ntook {elapsed:.0f} s; load average {load_before[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        with open(args.json, "w") as f:
            json.dump({"config": config, "elapsed_seconds": elapsed, "results": results}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
