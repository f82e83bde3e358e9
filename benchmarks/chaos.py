"""A chaos run: a seeded schedule of faults against `keras-dist launch --max-restarts`, with figures.

A reliability run, not a speed benchmark: it prints what happened and writes
JSON (`--json`). It trains `benchmarks/chaos_worker.py` (a small model with
synchronized BatchNormalization and Adam, `BackupAndRestore(save_freq=3,
double_checkpoint=True)`) twice with
`keras-dist launch --num-workers W`:

  reference  uninterrupted
  chaos      with one fault per start of the workers, drawn from `--seed`:
             SIGKILL, SIGTERM (a preemption notice), SIGSTOP (a frozen
             worker, caught by the stall watchdog, `--stall-timeout 15`), a
             backup file cut in half, a save that runs out of space
             (RLIMIT_FSIZE); `--max-restarts` = faults + 1

and prints per fault: the start (attempt) it hit, its kind, the worker slot,
the step it hit, the step the next start resumed from, the steps replayed,
and the seconds from the fault to the next start's first step; then the
totals (faults injected, whether the run finished with the reference's
steps and weights, the largest weight difference, steps replayed, time lost
= chaos wall time - reference wall time). docs/reliability.md holds a run.

    python benchmarks/chaos.py [--faults 10] [--seed 0] [--workers 2] [--kinds sigkill,sigterm,...] \\
        [--out DIR] [--json out.json]
"""

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "chaos_worker.py")
KINDS = ("sigkill", "sigterm", "sigstop", "corrupt_backup", "disk_full")
EXAMPLES, BATCH_SIZE, SAVE_FREQ = 192, 16, 3  # 12 steps per epoch.
TOLERANCE = 1e-5
STALL_TIMEOUT = 15  # Seconds: `keras-dist launch --stall-timeout`.


def make_plan(faults, seed, workers, kinds=KINDS, epochs=None):
    """Returns the plan `chaos_worker.py` reads: data, epochs and a seeded fault per start.

    Args:
        faults: Integer >= 0, faults to schedule (one per start: attempts 0..faults-1).
        seed: Integer, seeds the kinds' order, the slots and the steps.
        workers: Integer >= 1, the workers of the launch (slots 0..workers-1).
        kinds: Sequence of fault kinds (`KINDS`), used in turn, then shuffled.
        epochs: Integer, or `None` (enough steps for every fault to hit).

    Returns:
        Dict: examples, batch_size, save_freq, epochs and faults (each with
        attempt, kind, slot, after_steps: steps of that start before it).
        A `disk_full` fault hits slot 0: the chief writes every backup, so a
        file-size limit elsewhere would only hit this script's result file.
    """
    rng = random.Random(seed)
    order = [kinds[i % len(kinds)] for i in range(faults)]
    rng.shuffle(order)
    schedule = []
    for i, kind in enumerate(order):
        slot, after_steps = rng.randrange(workers), rng.randint(SAVE_FREQ + 1, 8)
        if kind == "disk_full":
            slot = 0  # The chief (worker 0 at every start of a fixed launch) writes every backup.
        schedule.append({"attempt": i, "kind": kind, "slot": slot, "after_steps": after_steps})
    steps_per_epoch = EXAMPLES // BATCH_SIZE
    if epochs is None:  # Each start gains at most 8 steps: leave room for every fault and some after.
        epochs = max(3, math.ceil((8 * faults + steps_per_epoch) / steps_per_epoch))
    return {
        "examples": EXAMPLES,
        "batch_size": BATCH_SIZE,
        "save_freq": SAVE_FREQ,
        "epochs": epochs,
        "faults": schedule,
    }


def launch(plan, out_dir, workers, max_restarts, timeout, min_workers=None):
    """Runs `keras-dist launch` of `chaos_worker.py` with `plan`; returns (LauncherResult, wall seconds)."""
    from keras_dist.testing import clean_env, run_launcher

    os.makedirs(out_dir, exist_ok=True)
    plan_path = os.path.join(out_dir, "plan.json")
    with open(plan_path, "w") as f:
        json.dump(plan, f, indent=1)
    env = clean_env(KERAS_DIST_QUIET="1", TF_CPP_MIN_LOG_LEVEL="3")
    options = ["--num-workers", str(workers), "--max-restarts", str(max_restarts)]
    # 15 s: a frozen worker is caught quickly, while a worker that is only slow at an epoch boundary on a
    # busy machine (a new input iterator took over 5 s there, with 3 processes on 2 cores) is not flagged.
    options += ["--stall-timeout", str(STALL_TIMEOUT), "--grace-period", "3"]
    if min_workers is not None:
        options += ["--min-workers", str(min_workers)]
    start = time.monotonic()
    result = run_launcher([*options, WORKER, out_dir, plan_path], env=env, timeout=timeout)
    seconds = time.monotonic() - start
    with open(os.path.join(out_dir, "launcher.log"), "w") as f:  # The workers' output, then the launcher's.
        f.write(result.stdout + "\n" + result.stderr)
    return result, seconds


def read_result(out_dir, workers):
    """Returns each worker's result JSON (iterations, weights) from `out_dir`, or `None` where missing."""
    results = []
    for task_id in range(workers):
        path = os.path.join(out_dir, f"result-{task_id}.json")
        results.append(json.load(open(path)) if os.path.exists(path) else None)
    return results


def read_events(out_dir):
    path = os.path.join(out_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def max_weight_difference(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b, strict=True))


def run(faults=10, seed=0, workers=2, kinds=KINDS, out_dir=None, timeout=1500.0, plan=None, **launch_options):
    """Runs the reference and the chaos launch; returns the figures as a dict (see the module docstring).

    `plan` replaces the seeded one (`make_plan`); `launch_options` (`max_restarts`,
    `min_workers`) replace the chaos launch's defaults (faults + 1, none).
    """
    out_dir = out_dir or tempfile.mkdtemp(prefix="keras-dist-chaos-")
    plan = plan or make_plan(faults, seed, workers, kinds)
    quiet = dict(plan, faults=[])
    reference_dir, chaos_dir = os.path.join(out_dir, "reference"), os.path.join(out_dir, "chaos")
    reference_run, reference_seconds = launch(quiet, reference_dir, workers, 0, timeout)
    max_restarts = launch_options.get("max_restarts", len(plan["faults"]) + 1)
    chaos_run, chaos_seconds = launch(
        plan, chaos_dir, workers, max_restarts, timeout, launch_options.get("min_workers")
    )
    (reference,) = read_result(reference_dir, 1)
    results = [r for r in read_result(chaos_dir, workers) if r is not None] or [None]
    events = read_events(chaos_dir)
    starts = {}
    for event in events:
        if event["event"] == "start":
            starts.setdefault(event["attempt"], event)
    rows = []
    for event in events:
        if event["event"] != "fault":
            continue
        resumed = starts.get(event["attempt"] + 1)
        rows.append(
            {
                "attempt": event["attempt"],
                "kind": event["kind"],
                "slot": event["slot"],
                "at_step": event["step"],
                "resumed_at": None if resumed is None else resumed["step"],
                "replayed": None if resumed is None else max(event["step"] - resumed["step"], 0),
                "recovery_s": None if resumed is None else round(resumed["time"] - event["time"], 1),
            }
        )
    finished = chaos_run.returncode == 0 and all(r is not None for r in results)
    difference = None
    if finished and reference is not None:
        difference = max(max_weight_difference(r["weights"], reference["weights"]) for r in results)
    same_steps = finished and reference is not None and all(r["iterations"] == reference["iterations"] for r in results)
    return {
        "seed": seed,
        "workers": workers,
        "scheduled": len(plan["faults"]),
        "finished_workers": sum(r is not None for r in results),
        "injected": len(rows),
        "faults": rows,
        "launcher_status": chaos_run.returncode,
        "reference_status": reference_run.returncode,
        "steps": None if reference is None else reference["iterations"],
        "same_steps": same_steps,
        "max_weight_difference": difference,
        "survived": bool(same_steps and difference is not None and difference <= TOLERANCE),
        "steps_replayed": sum(row["replayed"] or 0 for row in rows),
        "reference_seconds": round(reference_seconds, 1),
        "chaos_seconds": round(chaos_seconds, 1),
        "time_lost_seconds": round(chaos_seconds - reference_seconds, 1),
        "out_dir": out_dir,
        "launcher_stderr": chaos_run.stderr,
    }


def print_report(report, file=sys.stdout):
    say = lambda text="": print(text, file=file)  # noqa: E731
    say(f"chaos run: {report['workers']} workers, seed {report['seed']}, {report['scheduled']} faults scheduled")
    say(
        f"{'start':>5}  {'fault':<15}{'slot':>4}  {'at step':>7}  {'resumed at':>10}  {'replayed':>8}  {'recovery s':>10}"
    )
    for row in report["faults"]:
        cells = [row["resumed_at"], row["replayed"], row["recovery_s"]]
        resumed, replayed, recovery = ("-" if c is None else c for c in cells)
        say(
            f"{row['attempt']:>5}  {row['kind']:<15}{row['slot']:>4}  {row['at_step']:>7}  {resumed:>10}  "
            f"{replayed:>8}  {recovery:>10}"
        )
    difference = report["max_weight_difference"]
    say(
        f"faults injected: {report['injected']} of {report['scheduled']}; launcher exit status "
        f"{report['launcher_status']}; steps {report['steps']} (same as the reference: {report['same_steps']})"
    )
    say(
        f"max |weight - reference weight|: {'-' if difference is None else f'{difference:.2e}'} "
        f"(tolerance {TOLERANCE:g}); survived: {report['survived']}"
    )
    say(
        f"steps replayed: {report['steps_replayed']}; time: reference {report['reference_seconds']} s, "
        f"chaos {report['chaos_seconds']} s, lost {report['time_lost_seconds']} s"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=10, help="faults to schedule (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the schedule (default 0)")
    parser.add_argument("--workers", type=int, default=2, choices=(1, 2, 3), help="workers (default 2)")
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma-separated fault kinds (default {','.join(KINDS)})"
    )
    parser.add_argument("--out", help="directory for the runs' files (default: a new temporary directory)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown fault kinds {unknown}; expected some of {', '.join(KINDS)}")
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
    report = run(args.faults, args.seed, args.workers, kinds, args.out)
    print_report(report)
    if not report["survived"]:
        print(report["launcher_stderr"][-3000:], file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: v for k, v in report.items() if k != "launcher_stderr"}, f, indent=1)
    return 0 if report["survived"] else 1


if __name__ == "__main__":
    sys.exit(main())
