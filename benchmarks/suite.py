"""Step time and peak memory of keras-dist against raw Keras 3 `tf.distribute` and peers, per workload and topology.

A benchmark, not a test: it prints what it measured in this run and writes
JSON (`--json`), asserting nothing about speed.

Every (system, topology) measurement runs in fresh processes
(`benchmarks/_suite_worker.py`: simulated replicas must be configured before
TensorFlow starts), interleaved: for each repeat, every topology, every system
(A B C A B C ...), so a slow spell of a busy machine hits all systems alike.

  workloads   mlp       784-512-512-10 MLP on random data (communication-heavy)
              cnn       3 conv layers on 32x32x3 random images
              digits    the main example's CNN on scikit-learn's 8x8 digits
              sequence  variable-length tokens (8-64) bucketed to 4 lengths, masked GRU
              recommender  an Embedding(`--embedding-rows`, default 1,000,000, x 64)
                        table, 8 int32 ids per example (a fifth from 100 popular ids,
                        the rest uniform), averaged (GlobalAveragePooling1D), Dense(10)
              All: SGD(0.01), sparse cross-entropy, global batch `--global-batch-size`.
  topologies  <workers>x<replicas per worker>: 1x1 (one device), 1x2 (one process,
              2 simulated CPU replicas, MirroredStrategy), 2x1 and 2x2 (2 local
              workers via `keras-dist launch`, MultiWorkerMirroredStrategy);
              `gpu` (MirroredStrategy over all GPUs, only when GPUs are present).
  systems     keras_dist  keras_dist.DistributedModel, `fit`
              keras       raw Keras 3 `keras.Model`, `fit`, same strategy
              keras_loop  raw Keras 3, a custom `strategy.run` loop (where `fit`
                          fails: Keras 3.15 under MultiWorkerMirroredStrategy)
              tf_keras    tf.keras 2 (`pip install tf-keras`), `fit` (optional)
              jax         Keras 3 on JAX, `keras.distribution.DataParallel` over
                          XLA's simulated host devices, one process (optional)
              keras_dist_tf_threads  keras_dist launched with
                          `--threads-per-worker 0` (TensorFlow's thread pools),
                          to measure the launcher's thread sharing (not default)
              horovod     Horovod's Keras API (Gloo), `hvd.DistributedOptimizer`,
                          `fit`, in the Python given by `--horovod-python` (a
                          virtual environment with Horovod and its TensorFlow;
                          it could not be installed next to TF 2.21), started
                          by the `horovodrun` beside it, one process per worker,
                          with the launcher's thread share (optional)

Measured per process: `fit` runs 1 step (startup = process start to the end
of that step, launcher included for workers), then `--epochs` epochs of
`--steps` steps timed by epoch hooks (no per-batch callback, which would add a
host sync); the first timed epoch is warm-up. Reported: median step time over
all timed epochs of all repeats, examples/s (global batch / step time), the
ratio to the same system's 1x1 step time (its distribution overhead: 1.00x means
none; on one 2-core host more replicas share the same cores, so this is not
a speed-up), and keras-dist's step time over each system's on the same topology.
Peak RSS: every process reports its own peak resident memory (`ru_maxrss`, in
bytes); a measurement's figure is the largest over its workers, the reported
one the median of that over repeats, and `kd RSS / raw` keras-dist's over raw
Keras' on the same workload and topology (shown on the raw Keras row: system
`keras` where it has a figure, else `keras_loop`, since Keras 3's `fit` fails
under MultiWorkerMirroredStrategy).
Every system gets the same thread pools (`--threads-per-worker`, applied by the
launcher to keras-dist and by the worker script to the others).

    python benchmarks/suite.py [--workloads mlp,cnn] [--topologies 1x1,1x2,2x1,2x2]
        [--systems keras_dist,keras,keras_loop,tf_keras,jax] [--steps 8] [--epochs 2]
        [--repeats 2] [--embedding-rows 1000000] [--json out.json]
    python benchmarks/suite.py --quick     # checks that the suite works (about a minute; CI runs it)
"""

import argparse
import glob
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from keras_dist.cli import _threads  # The launcher's thread share, given to the Horovod peer too.

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_suite_worker.py")
SYSTEMS = ("keras_dist", "keras", "keras_loop", "tf_keras", "jax", "keras_dist_tf_threads", "horovod")
WORKLOADS = ("mlp", "cnn", "digits", "sequence", "recommender")
# Raw Keras 3 on the same strategy, in order of preference, for `keras_dist_rss_over_raw_keras`.
RAW_KERAS_SYSTEMS = ("keras", "keras_loop")
KERAS3_FIT_MULTI_WORKER = (
    "Keras 3.15 fit fails under MultiWorkerMirroredStrategy (ValueError: a PerReplica batch in "
    "_maybe_symbolic_build); see keras_loop"
)


FULL_DEFAULTS = {
    "workloads": ("mlp", "cnn"),
    "systems": ("keras_dist", "keras", "keras_loop", "tf_keras", "jax"),
    "steps": 8,
    "epochs": 2,
    "repeats": 2,
    "global_batch_size": 256,
}
# `--quick` (what CI runs, tests/unit/test_benchmarks.py): that every part works, not how fast.
QUICK_DEFAULTS = {
    **FULL_DEFAULTS,
    "workloads": ("mlp",),
    "topologies": ("1x1", "1x2"),
    "systems": ("keras_dist", "keras"),
}
QUICK_DEFAULTS.update(steps=2, epochs=2, repeats=1, global_batch_size=32)


def parse_topology(text):
    """Returns (workers, replicas per worker, gpu) for `1x2` or `gpu`."""
    if text == "gpu":
        return 1, 1, True
    workers, _, replicas = text.partition("x")
    return int(workers), int(replicas), False


def horovodrun_beside(python):
    """The `horovodrun` of the virtual environment whose Python is `python` (`--horovod-python`).

    Raises:
        FileNotFoundError: there is no `horovodrun` beside `python`.
    """
    horovodrun = os.path.join(os.path.dirname(python), "horovodrun")
    if not os.path.exists(horovodrun):
        raise FileNotFoundError(
            f"--horovod-python {python}: expected horovodrun beside it, at {horovodrun}; "
            "pass the Python of the virtual environment Horovod is installed in"
        )
    return horovodrun


def unsupported(system, topology, horovod_python=None):
    """Returns why `system` cannot run on `topology` (without trying), or None."""
    workers, replicas, gpu = parse_topology(topology)
    if system == "horovod" and not horovod_python:
        return "not measured: pass --horovod-python (the Python of a virtual environment with Horovod)"
    if system == "horovod" and (replicas > 1 or gpu):
        return "n/a: Horovod runs one process per device (its 1x2 is 2x1 on one host)"
    if system == "tf_keras" and importlib.util.find_spec("tf_keras") is None:
        return "not installed (pip install tf-keras)"
    if system == "jax" and importlib.util.find_spec("jax") is None:
        return "not installed (pip install jax)"
    if system == "jax" and (workers > 1 or gpu):
        return "not measured: multi-process JAX (jax.distributed) is not set up by this suite"
    if system == "keras_dist_tf_threads" and workers == 1:
        return "same as keras_dist on one worker"
    if system in ("keras", "keras_loop", "tf_keras") and workers > 1 and replicas > 1:
        return "n/a: TensorFlow's MultiWorkerMirroredStrategy uses one CPU device per worker"
    return None


def command_for(system, topology, workload, args, out):
    """Returns the command line that measures `system` on `topology` and writes JSON to `out`."""
    workers, replicas, gpu = parse_topology(topology)
    worker_system = "keras_dist" if system == "keras_dist_tf_threads" else system
    script = [
        WORKER,
        "--system",
        worker_system,
        "--workload",
        workload,
        "--steps",
        str(args.steps),
        "--epochs",
        str(args.epochs + 1),
        "--global-batch-size",
        str(args.global_batch_size),
        "--out",
        out,
    ]
    if gpu:
        script.append("--gpu")
    if workload == "recommender" and getattr(args, "embedding_rows", None) is not None:
        script += ["--embedding-rows", str(args.embedding_rows)]
    if system == "horovod":
        if workers == 1:
            return [args.horovod_python, *script]
        horovodrun = horovodrun_beside(args.horovod_python)
        return [horovodrun, "--gloo", "-np", str(workers), "-H", f"localhost:{workers}", args.horovod_python, *script]
    if workers == 1:
        return [sys.executable, *script, "--replicas", str(replicas)]
    threads = 0 if system == "keras_dist_tf_threads" else args.threads_per_worker
    launch = [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", str(workers)]
    if replicas > 1:
        launch += ["--cpu-replicas", str(replicas)]
    if threads is not None:
        launch += ["--threads-per-worker", str(threads)]
    return launch + script


def measure(system, topology, workload, args, tmp):
    """Runs one measurement; returns its JSON dict, or {"error": last error line}."""
    out = os.path.join(tmp, f"{workload}-{topology}-{system}.json")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_DIST_QUIET": "1", "SUITE_STARTED_AT": repr(time.time())}
    for name in ("TF_CONFIG", "KERAS_DIST_CPU_REPLICAS", "KERAS_BACKEND", "XLA_FLAGS"):
        env.pop(name, None)
    workers = parse_topology(topology)[0]
    if system == "horovod" and workers > 1:  # The thread share keras-dist's launcher gives its workers.
        threads = _threads.threads_per_worker(workers, _threads.host_cpu_count(), args.threads_per_worker)
        if threads:
            env[_threads.INTRA_OP_THREADS_ENV] = env[_threads.INTER_OP_THREADS_ENV] = str(threads)
    load_average = os.getloadavg()[0]
    result = run_measurement(command_for(system, topology, workload, args, out), env, out, args.timeout)[0]
    result["load_average_before"] = load_average
    return result


def run_measurement(command, env, out, timeout, cwd=None):
    """Runs `command`, which writes its JSON result to `out`; returns `(result dict or {"error": ...}, process)`.

    The process is `None` when it timed out after `timeout` seconds. `out` is removed once read, and so
    are the other workers' `<out>.worker<index>` files (`{"peak_rss_bytes": ...}`): the result's
    `peak_rss_bytes_per_worker` lists every worker's peak RSS in bytes (worker 0 first) and its
    `peak_rss_bytes` is the largest of them.
    """
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired:
        _worker_peaks(out)  # Removes what the workers left.
        return {"error": f"timed out after {timeout} s"}, None
    worker_peaks = _worker_peaks(out)
    if proc.returncode != 0 or not os.path.exists(out):
        lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "Error" in line]
        return {"error": (lines[-1] if lines else f"exit status {proc.returncode}")[-300:]}, proc
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    if "peak_rss_bytes" in result:
        result["peak_rss_bytes_per_worker"] = [result["peak_rss_bytes"], *worker_peaks]
        result["peak_rss_bytes"] = max(result["peak_rss_bytes_per_worker"])
    return result, proc


def _worker_peaks(out):
    """Reads and removes the `<out>.worker<index>` files; returns their peak RSS in bytes, by worker index."""
    peaks = {}
    for path in glob.glob(glob.escape(out) + ".worker*"):
        index = path[len(out) + len(".worker") :]
        if not index.isdigit():
            raise ValueError(f"expected worker files named {out}.worker<index>; received {path}")
        with open(path) as f:
            peaks[int(index)] = json.load(f)["peak_rss_bytes"]
        os.remove(path)
    return [peaks[index] for index in sorted(peaks)]


def summarize(runs, global_batch_size):
    """Pools the timed epochs of all repeats: median step time, the spreads (repeats, epochs), startup.

    `spread` is the range of the repeats' median step times over the median;
    `epoch_spread` the range of every timed epoch's step time (all repeats)
    over the median, which shows an unsteady step (some epochs twice as slow)
    that a median hides. `load_averages`: the 1-minute load average before
    each repeat's processes started. `peak_rss_bytes`: the median over repeats
    of the largest worker's peak RSS, in bytes (absent when a run has none).
    """
    steps = [s for run in runs for s in run["step_seconds"]]
    medians = [statistics.median(run["step_seconds"]) for run in runs]
    median = statistics.median(steps)
    peaks = [run.get("peak_rss_bytes") for run in runs]
    rss = {"peak_rss_bytes": statistics.median(peaks)} if all(p is not None for p in peaks) else {}
    return {
        "median_step_seconds": median,
        "examples_per_second": global_batch_size / median,
        "spread": (max(medians) - min(medians)) / median if len(medians) > 1 else 0.0,
        "epoch_spread": (max(steps) - min(steps)) / median if len(steps) > 1 else 0.0,
        "load_averages": [run.get("load_average_before") for run in runs],
        "startup_seconds": statistics.median(run["startup_seconds"] for run in runs),
        "num_replicas_in_sync": runs[0]["num_replicas_in_sync"],
        "repeat_medians": medians,
        **rss,
    }


def run_suite(args):
    """Measures every (workload, topology, system), interleaved; returns the result rows."""
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workloads:
            for repeat in range(args.repeats):
                for topology in args.topologies:
                    for system in args.systems:
                        row = rows.setdefault((workload, topology, system), {"runs": [], "note": None})
                        row["note"] = row["note"] or unsupported(system, topology, args.horovod_python)
                        if row["note"] is not None:
                            continue
                        result = measure(system, topology, workload, args, tmp)
                        if "error" in result:
                            row["note"] = _explain(system, topology, result["error"])  # Not retried.
                            continue
                        row["runs"].append(result)
                        print(
                            f"  {workload:<12}{topology:<5}{system:<22} repeat {repeat + 1}: "
                            f"{statistics.median(result['step_seconds']) * 1e3:8.2f} ms/step, "
                            f"startup {result['startup_seconds']:.1f} s",
                            flush=True,
                        )
    return _rows_with_ratios(rows, args)


def _explain(system, topology, error):
    if system == "keras" and parse_topology(topology)[0] > 1 and "PerReplica" in error:
        return KERAS3_FIT_MULTI_WORKER
    return f"failed: {error}"


def _rows_with_ratios(rows, args):
    results = []
    for (workload, topology, system), row in rows.items():
        entry = {"workload": workload, "topology": topology, "system": system, "note": row["note"]}
        if row["runs"]:
            entry.update(summarize(row["runs"], args.global_batch_size))
            entry["step_seconds"] = [run["step_seconds"] for run in row["runs"]]
            entry["peak_rss_bytes_per_worker"] = [run.get("peak_rss_bytes_per_worker") for run in row["runs"]]
        results.append(entry)
    index = {(r["workload"], r["topology"], r["system"]): r for r in results}
    for r in results:
        if "median_step_seconds" not in r:
            continue
        own_single = index.get(
            (r["workload"], "1x1", "keras_dist" if r["system"] == "keras_dist_tf_threads" else r["system"])
        )
        if own_single and "median_step_seconds" in own_single:
            r["vs_own_1x1"] = r["median_step_seconds"] / own_single["median_step_seconds"]
        ours = index.get((r["workload"], r["topology"], "keras_dist"))
        if ours and "median_step_seconds" in ours and r["system"] != "keras_dist":
            r["keras_dist_over_system"] = ours["median_step_seconds"] / r["median_step_seconds"]
            if "startup_seconds" in ours:
                r["keras_dist_startup_over_system"] = ours["startup_seconds"] / r["startup_seconds"]
        raw = _raw_keras(index, r["workload"], r["topology"])
        if r is raw and ours and ours.get("peak_rss_bytes") and raw.get("peak_rss_bytes"):
            r["keras_dist_rss_over_raw_keras"] = ours["peak_rss_bytes"] / raw["peak_rss_bytes"]
    return results


def _raw_keras(index, workload, topology):
    """Returns the raw Keras 3 row on `topology` that has a peak RSS (`keras`, else `keras_loop`), or None."""
    for system in RAW_KERAS_SYSTEMS:
        row = index.get((workload, topology, system))
        if row and row.get("peak_rss_bytes"):
            return row
    return None


def print_table(results, args):
    """Prints one table per workload."""
    for workload in args.workloads:
        print(
            f"\n{workload}: global batch {args.global_batch_size}, {args.steps} steps x {args.epochs} timed epochs "
            f"x {args.repeats} repeats (median step time; spread = range of the repeats' medians / median; "
            "epochs = range of every epoch's step time / median; load = 1-min load average before each repeat; "
            "peak RSS = the largest worker's, median over repeats; kd RSS / raw = keras-dist's peak RSS over "
            "raw Keras' (keras, else keras_loop), on that row)"
            + (f"; table of {args.embedding_rows:,} rows" if workload == "recommender" else "")
        )
        print(
            f"{'topology':<9}{'system':<23}{'ms/step':>9}{'examples/s':>12}{'spread':>8}{'epochs':>8}"
            f"{'vs own 1x1':>12}{'kd / this':>11}{'startup s':>11}{'kd startup / this':>19}"
            f"{'peak RSS MB':>13}{'kd RSS / raw':>14}"
        )
        for r in results:
            if r["workload"] != workload:
                continue
            if "median_step_seconds" not in r:
                print(f"{r['topology']:<9}{r['system']:<23}  {r['note']}")
                continue
            ratio = lambda key, r=r: f"{r[key]:.2f}x" if key in r else "-"  # noqa: E731
            print(
                f"{r['topology']:<9}{r['system']:<23}{r['median_step_seconds'] * 1e3:>9.2f}"
                f"{r['examples_per_second']:>12,.0f}{r['spread'] * 100:>7.0f}%{r['epoch_spread'] * 100:>7.0f}%"
                f"{ratio('vs_own_1x1'):>12}{ratio('keras_dist_over_system'):>11}{r['startup_seconds']:>11.1f}"
                f"{ratio('keras_dist_startup_over_system'):>19}"
                f"{r['peak_rss_bytes'] / 2**20 if 'peak_rss_bytes' in r else float('nan'):>13,.0f}"
                f"{ratio('keras_dist_rss_over_raw_keras'):>14}"
            )
            epochs = " | ".join(" ".join(f"{s * 1e3:.1f}" for s in repeat) for repeat in r["step_seconds"])
            loads = " ".join(f"{load:.2f}" for load in r["load_averages"] if load is not None)
            print(f"{'':<9}  ms/step of each epoch, per repeat: {epochs}; load {loads}")


def _gpus_present():
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return bool(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return False


def _csv(choices):
    def parse(text):
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if choices and v not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"expected some of {', '.join(choices)}; received {', '.join(bad)}")
        return values

    return parse


def _check_topologies(topologies):
    for text in topologies:
        try:
            workers, replicas, _ = parse_topology(text)
            assert workers >= 1 and replicas >= 1
        except (ValueError, AssertionError) as error:
            raise SystemExit(
                f"--topologies: expected <workers>x<replicas> such as 1x2, or gpu; received {text!r}"
            ) from error


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", type=_csv(WORKLOADS), default=None, help="default mlp,cnn")
    parser.add_argument(
        "--topologies", type=_csv(None), default=None, help="default 1x1,1x2,2x1,2x2 (and gpu when GPUs are present)"
    )
    parser.add_argument(
        "--systems", type=_csv(SYSTEMS), default=None, help="default keras_dist,keras,keras_loop,tf_keras,jax"
    )
    parser.add_argument("--steps", type=int, default=None, help="steps per timed epoch (default 8)")
    parser.add_argument(
        "--epochs", type=int, default=None, help="timed epochs per process, after 1 warm-up epoch (default 2)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds over all systems (default 2)")
    parser.add_argument("--global-batch-size", type=int, default=None, help="default 256")
    parser.add_argument(
        "--embedding-rows", type=int, default=1_000_000, help="rows of the recommender workload's table"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="check that the suite works, in about a minute: defaults become mlp, 1x1,1x2, keras_dist,keras, "
        "2 steps x 2 epochs x 1 repeat, global batch 32 (options given still apply); its figures mean nothing",
    )
    parser.add_argument(
        "--threads-per-worker",
        type=int,
        default=None,
        help="passed to keras-dist launch for every system (default: the launcher's default)",
    )
    parser.add_argument(
        "--horovod-python",
        default=None,
        help="for system horovod: the Python of a virtual environment with Horovod (TensorFlow, Gloo), horovodrun beside it",
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds per measurement")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    defaults = QUICK_DEFAULTS if args.quick else FULL_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, list(value) if isinstance(value, tuple) else value)
    if args.topologies is None:
        args.topologies = ["1x1", "1x2", "2x1", "2x2"] + (["gpu"] if _gpus_present() else [])
    _check_topologies(args.topologies)
    if args.embedding_rows < 1:
        raise SystemExit(f"--embedding-rows: expected a positive number of rows; received {args.embedding_rows}")
    started = time.perf_counter()
    load_before = os.getloadavg()
    print(f"{os.cpu_count()} CPUs, load average {load_before[0]:.2f} at start", flush=True)
    results = run_suite(args)
    elapsed = time.perf_counter() - started
    print_table(results, args)
    load_after = os.getloadavg()
    print(f"\nsuite took {elapsed:.0f} s; load average {load_before[0]:.2f} at start, {load_after[0]:.2f} at end")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        machine = {"cpu_count": os.cpu_count(), "load_average_start": load_before, "load_average_end": load_after}
        with open(args.json, "w") as f:
            json.dump(
                {"config": config, "machine": machine, "elapsed_seconds": elapsed, "results": results}, f, indent=2
            )


if __name__ == "__main__":
    main()
