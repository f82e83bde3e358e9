"""Does the gradient all-reduce overlap the backward pass? A TensorFlow profiler trace on 2 workers.

A benchmark, not a test: it prints what one run saw and asserts nothing about speed.

It trains the suite's MLP (784-512-512-10, global batch 256, SGD) on 2 local workers
(`keras-dist launch --num-workers 2`), traces one epoch of the chief with
`tf.profiler.experimental`, and reads the trace (`*.xplane.pb`) back: for each step, when the
backward pass's last matmul ended and when each pack's `CollectiveReduceV2` ran, in ms from the
step's start. Overlap means a pack starting before the backward pass ends. It also names what
each pack carries (from the traced graph), to show the packing order: the last layers' gradients
first, the side values (example count, structure flags, metric state) last.

    python benchmarks/overlap_trace.py [--bytes-per-pack 524288] [--steps 30] [--json out.json]

About 40 s on 2 CPU cores. The trace directory is kept (`--logdir`) for TensorBoard's profile
plugin.
"""

import argparse
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile


def _train_and_trace(bytes_per_pack, steps, logdir):
    """Worker side (under `keras-dist launch`): trains, traces one epoch on the chief, prints the packs."""
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_dist

    keras.utils.set_random_seed(0)
    inputs = keras.Input((784,))
    hidden = keras.layers.Dense(512, activation="relu")(inputs)
    hidden = keras.layers.Dense(512, activation="relu")(hidden)
    model = keras_dist.DistributedModel(
        inputs, keras.layers.Dense(10)(hidden), communication={"bytes_per_pack": bytes_per_pack}
    )
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rs = np.random.RandomState(0)
    x, y = rs.rand(256 * steps, 784).astype("float32"), rs.randint(0, 10, 256 * steps)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(256)
    model.fit(dataset, epochs=1, verbose=0)  # traced and warm
    if keras_dist.is_chief():
        tf.profiler.experimental.start(logdir)
    model.fit(dataset, epochs=1, verbose=0)
    if keras_dist.is_chief():
        tf.profiler.experimental.stop()
        with open(os.path.join(logdir, "packs.json"), "w") as f:
            json.dump(_packs(model.train_function), f)


def _packs(train_function):
    """For each `CollectiveReduceV2` of the traced step, in graph order: the ops whose values it carries."""
    functions, seen = [], set()

    def find(obj, depth=0):
        if depth > 4 or id(obj) in seen:
            return
        seen.add(id(obj))
        if hasattr(obj, "_list_all_concrete_functions"):
            functions.append(obj)
            return
        for name in ("__wrapped__", "_function", "function", "_fn"):
            if hasattr(obj, name):
                find(getattr(obj, name), depth + 1)
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                find(cell.cell_contents, depth + 1)
            except ValueError:
                pass

    find(train_function)
    for function in functions:
        for concrete in function._list_all_concrete_functions():
            graph_def = concrete.graph.as_graph_def()
            for library_function in graph_def.library.function:
                nodes = {n.name: n for n in library_function.node_def}
                reduces = [n for n in library_function.node_def if n.op == "CollectiveReduceV2"]
                if reduces:
                    return [_carried(nodes, r) for r in reduces]
    return []


def _carried(nodes, reduce):
    """The names of the values packed into `reduce` (through its concat, reshapes and slices; a gradient's scaling)."""
    concat = nodes.get(reduce.input[0].split(":")[0])
    while concat is not None and concat.op in ("Reshape", "Identity") and concat.input:  # TensorFlow's one-tensor pack
        concat = nodes.get(concat.input[0].split(":")[0])
    if concat is None:
        return [reduce.name, [reduce.input[0]]]
    carried = []
    for name in concat.input[:-1] if concat.op == "ConcatV2" else [concat.name]:  # a window of one piece: no concat
        node = nodes.get(name.split(":")[0])
        while node is not None and node.op in ("Reshape", "Mul", "Identity", "Cast", "StridedSlice") and node.input:
            node = nodes.get(node.input[0].split(":")[0])
        carried.append("?" if node is None else node.name.replace("gradient_tape/", "grad:"))
    return [reduce.name, carried]


def _read_trace(logdir):
    """Per traced step: its length, the end of the last gradient matmul, each pack's start and end (ms)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    path = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))[0]
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            base = line.timestamp_ns * 1000
            for event in line.events:
                start = base + event.offset_ps
                events.append((start, start + event.duration_ps, names.get(event.metadata_id, "?")))
    steps = sorted(e for e in events if e[2] == "one_step_on_iterator")
    rows = []
    for begin, end, _ in steps[2:]:  # the first steps of a trace carry the profiler's own start-up
        inside = [e for e in events if begin <= e[0] <= end]
        packs = sorted(e for e in inside if e[2].startswith("StatefulPartitionedCall/CollectiveReduceV2"))
        matmuls = [e for e in inside if "gradient_tape" in e[2] and "MatMul" in e[2]]
        if packs and matmuls:
            rows.append(
                {
                    "step_ms": _ms(end, begin),
                    "backward_end_ms": _ms(max(m[1] for m in matmuls), begin),
                    "packs_ms": [[_ms(p[0], begin), _ms(p[1], begin)] for p in packs],
                }
            )
    return rows


def _run_launch(command, timeout_seconds, env=None):
    """Runs `command` (the launcher) in its own process group; stops the whole group after `timeout_seconds`.

    `env`: the launcher's environment (default: this process's).

    Raises:
        subprocess.CalledProcessError: the launch failed.
        subprocess.TimeoutExpired: it ran past `timeout_seconds` (its workers are stopped too).
    """
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, start_new_session=True, env=env)
    try:
        returncode = process.wait(timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    if returncode != 0:
        raise subprocess.CalledProcessError(returncode, command)


def _ms(time_ps, begin_ps):
    """Milliseconds from `begin_ps` to `time_ps` (picoseconds, the trace's unit), to 0.01 ms."""
    return round((time_ps - begin_ps) / 1e9, 2)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes-per-pack", type=int, default=524288)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--logdir", default=None, help="where the trace goes (default: a temporary directory)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the launch is stopped")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _train_and_trace(args.bytes_per_pack, args.steps, args.logdir)
        return
    logdir = args.logdir or tempfile.mkdtemp(prefix="overlap_trace_")
    command = [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", "2", os.path.abspath(__file__)]
    command += ["--worker", "--bytes-per-pack", str(args.bytes_per_pack), "--steps", str(args.steps)]
    command += ["--logdir", logdir]
    load = os.getloadavg()[0]
    _run_launch(command, args.timeout)
    rows = _read_trace(logdir)
    with open(os.path.join(logdir, "packs.json")) as f:
        packs = json.load(f)
    print(f"MLP 784-512-512-10 on 2 workers, bytes_per_pack={args.bytes_per_pack}, load average {load:.2f}")
    for name, carried in packs:
        print(f"  {name}: {', '.join(carried)}")
    print("  step ms | backward pass ends | packs (start-end, ms from the step's start)")
    for row in rows[:8]:
        spans = "  ".join(f"{a:.2f}-{b:.2f}" for a, b in row["packs_ms"])
        print(f"  {row['step_ms']:7.1f} | {row['backward_end_ms']:18.2f} | {spans}")
    early = [r["backward_end_ms"] - r["packs_ms"][0][0] for r in rows]
    before = sum(e > 0 for e in early)
    print(
        f"steps whose first pack starts before the backward pass ends: {before} of {len(rows)}; "
        f"median (backward end - first pack start): {statistics.median(early):.2f} ms; "
        f"median step {statistics.median(r['step_ms'] for r in rows):.1f} ms; trace in {logdir}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes_per_pack": args.bytes_per_pack, "load_average": load, "packs": packs, "steps": rows}, f)


if __name__ == "__main__":
    main()
