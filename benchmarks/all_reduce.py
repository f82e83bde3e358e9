"""All-reduce bus bandwidth, packing, and step time with gradient accumulation, on 2 local workers.

A benchmark, not a test: it prints what it measured in this run and writes
JSON (`--json`), asserting nothing about speed. Everything runs on this
machine: 2 worker processes (`keras-dist launch --num-workers 2`, TensorFlow's
gRPC collectives on loopback, one CPU replica each).

  bus bandwidth  for 1, 16 and 64 MB float32 tensors: `size * 2(n-1)/n / time`
                 per all-reduce, n = 2 replicas (the nccl-tests definition of
                 "busbw"), next to the loopback TCP throughput measured in the
                 same run (one socket, 256 MB) as the ceiling.
  packing        256 tensors of 4 KB summed in one `all_reduce` call, with
                 `bytes_per_pack` 0 (TensorFlow's default) and 64 KB, and the
                 same 1 MB as one tensor.
  structure      one all-reduce of 8 floats: what the per-step gradient-structure
                 check costs under MultiWorkerMirroredStrategy (a model with 4
                 trainable variables sends 2 x 4 flags).
  accumulation   seconds per micro-batch step of `DistributedModel.fit` with
                 `gradient_accumulation_steps` 1 and 4 (4 MB of gradients,
                 all-reduced once per k micro-batches).
  gradients      effective throughput of keras-dist's gradient all-reduce
                 (`all_reduce_gradients`, what `fit` runs): 64 MB of float32
                 gradients in 16 tensors, float32 bytes per second (busbw as
                 above), for `bytes_per_pack` "auto" (the default) / 0 / 4 / 8 /
                 16 MB and compression
                 none / fp16 / bf16, next to TensorFlow's own
                 `ReplicaContext.all_reduce` of the same tensors; variants
                 interleaved over `--rounds` rounds, median reported.

  gather         `--only gather`: one tensor of the MLP's 2.7 MB of gradients, 16 and
                 64 MB summed by TensorFlow's all-reduce (the ring: reduce-scatter,
                 then all-gather), by its all-gather then a local sum (one exchange of
                 the whole tensor), and by keras-dist's gradient all-reduce; interleaved.

  Horovod        with `--horovod-python PATH` (the Python of a virtual environment with
                 Horovod built with TensorFlow and Gloo, `horovodrun` beside it), the
                 gradients section also runs Horovod's `allreduce` (Gloo, what
                 `hvd.DistributedOptimizer` calls per gradient, tensor fusion on) of the
                 same 64 MB, uncompressed and with `hvd.Compression.fp16`, on 2 local
                 processes with one intra-op and one inter-op thread each (keras-dist's
                 launcher share): one launch of each system per round, A B A B.

    python benchmarks/all_reduce.py [--repeats 10] [--rounds 3] [--only gradients] [--json out.json]
        [--horovod-python /path/to/venv/bin/python]
"""

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time

import overlap_trace  # benchmarks/, this script's directory: its launcher runner
import suite  # benchmarks/: where the Horovod peer's horovodrun is found

WORKER = r'''
import json, sys, time
import keras_dist
import keras, numpy as np, tensorflow as tf

repeats, out, rounds, only = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
CURVE_SIZES = [int(s) for s in sys.argv[5].split(",")]
strategy = keras_dist.resolve_strategy("auto")
n = strategy.num_replicas_in_sync
results = {"num_replicas_in_sync": n}


def gradient_all_reduce(layout):
    """keras-dist's all_reduce_gradients on 64 MB of float32 (`layout`: 16 tensors or one), variants interleaved."""
    from keras_dist.collectives import _all_reduce

    size = 64 * 2**20
    count = 16 if layout == "16x4MB" else 1
    gradients = [tf.ones([size // 4 // count]) for _ in range(count)]
    variants = {"tensorflow_all_reduce pack=0": 0, "tensorflow_all_reduce pack=8MB": 8 * 2**20}
    for compression in (None, "fp16", "bf16"):
        for pack in ("auto", 0, 4, 8, 16):
            name = f"keras_dist compression={compression} pack={pack}" + ("" if pack == "auto" else "MB")
            if pack == "auto" and compression is not None:
                continue
            variants[name] = keras_dist.CommunicationOptions(
                compression=compression, bytes_per_pack=pack if pack == "auto" else pack * 2**20
            )
    steps = {}
    for name, options in variants.items():
        if isinstance(options, int):  # TensorFlow's own packing (whole tensors, at least `bytes_per_pack` a pack)
            tf_options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=options)
            fn = lambda tf_options=tf_options: tf.distribute.get_replica_context().all_reduce("SUM", gradients, options=tf_options)
        else:
            fn = lambda options=options: _all_reduce.all_reduce_gradients(gradients, options)[0]
        steps[name] = tf.function(lambda fn=fn: strategy.run(fn))
        for _ in range(2):
            steps[name]()
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(repeats):
                step()
            times[name].append((time.perf_counter() - start) / repeats)
    return {
        name: {"seconds": sorted(t)[len(t) // 2], "all_rounds": t, "effective_busbw_MBps": size * 2 * (n - 1) / n / sorted(t)[len(t) // 2] / 2**20}
        for name, t in times.items()
    }


def curve():
    """Bus bandwidth of one float32 tensor from 1 KB to 256 MB: TensorFlow's all-reduce vs keras-dist's gradient all-reduce."""
    from keras_dist.collectives import _all_reduce

    options = keras_dist.CommunicationOptions()  # "auto": 8 MiB windows between CPU workers
    rows = {}
    for size in CURVE_SIZES:
        value = tf.ones([size // 4])
        steps = {
            "tensorflow": tf.function(lambda: strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("SUM", [value]))),
            "keras_dist": tf.function(lambda: strategy.run(lambda: _all_reduce.all_reduce_gradients([value], options)[0])),
        }
        rows[size] = {
            name: {**row, "busbw_MBps": size * 2 * (n - 1) / n / row["seconds"] / 2**20}
            for name, row in _interleaved(steps, size).items()
        }
    return rows


def _interleaved(steps, size):
    """Seconds per call of each of `steps` (tf.functions) on `size` bytes, over interleaved rounds: median and all rounds."""
    for step in steps.values():
        step()
    calls = max(2, min(200, int(0.3 * 300e6 / size)))  # about 0.3 s a measurement at 300 MB/s
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(calls):
                out = step()
            tf.nest.flatten(out)[0].numpy()
            times[name].append((time.perf_counter() - start) / calls)
    return {name: {"seconds": sorted(t)[len(t) // 2], "all_rounds": t} for name, t in times.items()}


def memory(variant):
    """Peak RSS (bytes, `ru_maxrss`) of this worker around 3 all-reduces of one 256 MB float32 gradient under `variant`."""
    import resource

    from keras_dist.collectives import _all_reduce

    value = tf.random.uniform([64 * 2**20])  # 256 MB, one gradient
    value.numpy()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if variant == "tensorflow":
        fn = lambda: tf.distribute.get_replica_context().all_reduce("SUM", [value])
    else:
        compression, pack = variant.split(":")
        options = keras_dist.CommunicationOptions(
            compression=None if compression == "none" else compression, bytes_per_pack=pack if pack == "auto" else int(pack)
        )
        fn = lambda: _all_reduce.all_reduce_gradients([value], options)[0]
    step = tf.function(lambda: strategy.run(fn))
    for _ in range(3):
        tf.nest.flatten(step())[0].numpy()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_rss_before_bytes": before, "peak_rss_after_bytes": after, "gradient_bytes": 256 * 2**20}


def gather_then_sum():
    """One float32 tensor per size summed three ways, interleaved: TensorFlow's all-reduce, its all-gather then a
    local sum (one exchange of the whole tensor instead of the ring's reduce-scatter and all-gather), keras-dist's."""
    from keras_dist.collectives import _all_reduce

    options = keras_dist.CommunicationOptions()
    rows = {}
    for size in CURVE_SIZES:
        value = tf.ones([size // 4])
        context = tf.distribute.get_replica_context
        steps = {
            "all_reduce": tf.function(lambda: strategy.run(lambda: context().all_reduce("SUM", value))),
            "all_gather_then_sum": tf.function(
                lambda: strategy.run(lambda: tf.reduce_sum(context().all_gather(value[None], axis=0), axis=0))
            ),
            "keras_dist": tf.function(lambda: strategy.run(lambda: _all_reduce.all_reduce_gradients([value], options)[0])),
        }
        rows[size] = _interleaved(steps, size)
    return rows


if only.startswith("memory:"):
    results["memory"] = memory(only[len("memory:") :])
    if keras_dist.is_chief():
        json.dump(results, open(out, "w"))
    sys.exit(0)

if only in ("gradients", "curve", "gather"):
    if only == "gradients":
        results["gradients_64MB"] = gradient_all_reduce("16x4MB")
        results["gradients_64MB_one_tensor"] = gradient_all_reduce("1x64MB")
    elif only == "gather":
        results["gather"] = gather_then_sum()
    else:
        results["curve"] = curve()
    if keras_dist.is_chief():
        json.dump(results, open(out, "w"))
    sys.exit(0)


def timed(values, options):
    @tf.function
    def step():
        return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("SUM", values, options=options))

    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats


default = tf.distribute.experimental.CommunicationOptions()
for megabytes in (1, 16, 64):
    size = megabytes * 2**20
    seconds = timed(tf.ones([size // 4]), default)
    results[f"allreduce_{megabytes}MB"] = {"seconds": seconds, "busbw_MBps": size * 2 * (n - 1) / n / seconds / 2**20}

small = [tf.ones([1024]) for _ in range(256)]
results["packing"] = {
    "256x4KB_pack_default": timed(small, default),
    "256x4KB_pack_64KB": timed(small, tf.distribute.experimental.CommunicationOptions(bytes_per_pack=64 * 1024)),
    "1x1MB": timed(tf.ones([256 * 1024]), default),
}

results["structure_check_8_floats"] = timed(tf.ones([8]), default)

x = np.random.RandomState(0).rand(64 * 48, 256).astype("float32")
timings = {1: [], 4: []}
for _ in range(3):  # interleaved, median reported: one worker process per core is noisy
    for k in (1, 4):
        inputs = keras.Input((256,))
        model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(keras.layers.Dense(4096, activation="relu")(inputs)))
        model.compile(optimizer=keras.optimizers.SGD(0.01, gradient_accumulation_steps=k if k > 1 else None), loss="mse")
        model.fit(x[:64 * 4], x[:64 * 4, :1], batch_size=64, epochs=1, verbose=0)  # trace
        start = time.perf_counter()
        model.fit(x, x[:, :1], batch_size=64, epochs=1, verbose=0, shuffle=False)
        timings[k].append((time.perf_counter() - start) / 48)
for k, seconds in timings.items():
    results[f"accumulation_k{k}_seconds_per_step"] = sorted(seconds)[1]
    results[f"accumulation_k{k}_all_runs"] = seconds
results["gradients_64MB"] = gradient_all_reduce("16x4MB")
results["gradients_64MB_one_tensor"] = gradient_all_reduce("1x64MB")
if keras_dist.is_chief():
    json.dump(results, open(out, "w"))
'''


HOROVOD_WORKER = r"""
import json, sys, time
import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
import horovod
import horovod.tensorflow as hvd

hvd.init()
repeats, out = int(sys.argv[1]), sys.argv[2]
size, n = 64 * 2**20, hvd.size()
results = {}
for key, count in (("gradients_64MB", 16), ("gradients_64MB_one_tensor", 1)):
    gradients = [tf.ones([size // 4 // count]) for _ in range(count)]
    results[key] = {}
    for name, compression in (("horovod gloo", hvd.Compression.none), ("horovod gloo fp16", hvd.Compression.fp16)):
        # One allreduce per gradient, as hvd.DistributedOptimizer runs them; Horovod fuses them (tensor fusion).
        step = tf.function(lambda c=compression: [
            hvd.allreduce(g, op=hvd.Sum, compression=c, name=f"gradient_{i}") for i, g in enumerate(gradients)
        ])
        for _ in range(2):
            step()
        start = time.perf_counter()
        for _ in range(repeats):
            reduced = step()
        reduced[0].numpy()
        seconds = (time.perf_counter() - start) / repeats
        results[key][name] = {"seconds": seconds, "all_rounds": [seconds]}
if hvd.rank() == 0:
    json.dump({"num_replicas_in_sync": n, "horovod_version": horovod.__version__, "tensorflow_version": tf.__version__, **results}, open(out, "w"))
"""


def _horovod(args, env):
    """One Horovod launch (`horovodrun --gloo -np 2` on localhost) of HOROVOD_WORKER; returns rank 0's results.

    Raises:
        FileNotFoundError: no `horovodrun` beside `--horovod-python`.
        subprocess.CalledProcessError: the launch failed (install Horovod with HOROVOD_WITH_TENSORFLOW=1
            HOROVOD_WITH_GLOO=1; `horovodrun --check-build` lists what it has).
        subprocess.TimeoutExpired: past `--timeout` seconds (its processes are stopped too).
    """
    horovodrun = suite.horovodrun_beside(args.horovod_python)
    with tempfile.TemporaryDirectory() as tmp:
        script, out = os.path.join(tmp, "horovod_worker.py"), os.path.join(tmp, "out.json")
        with open(script, "w") as f:
            f.write(HOROVOD_WORKER)
        command = [horovodrun, "--gloo", "-np", "2", "-H", "localhost:2", args.horovod_python, script]
        overlap_trace._run_launch(command + [str(args.repeats), out], args.timeout, env=env)
        with open(out) as f:
            return json.load(f)


def _interleaved_with_horovod(args, env):
    """The gradients section, one launch per system and round (keras-dist, then Horovod); rounds merged, medians."""
    merged = None
    one_round = argparse.Namespace(**{**vars(args), "rounds": 1})
    for _ in range(args.rounds):
        for results in (_launch(one_round, "gradients", env), _horovod(args, env)):
            if merged is None:
                merged = {"num_replicas_in_sync": results["num_replicas_in_sync"]}
            for key in ("gradients_64MB", "gradients_64MB_one_tensor"):
                for name, row in results[key].items():
                    merged.setdefault(key, {}).setdefault(name, {"all_rounds": []})["all_rounds"] += row["all_rounds"]
            if "horovod_version" in results:
                merged["horovod_version"] = results["horovod_version"]
    n, size = merged["num_replicas_in_sync"], 64 * 2**20
    for key in ("gradients_64MB", "gradients_64MB_one_tensor"):
        for row in merged[key].values():
            rounds = sorted(row["all_rounds"])
            row["seconds"] = rounds[len(rounds) // 2]
            row["effective_busbw_MBps"] = size * 2 * (n - 1) / n / row["seconds"] / 2**20
    return merged


def loopback_tcp_MBps(total=256 * 2**20, chunk=2**20):
    """Returns MB/s of one TCP stream over 127.0.0.1, sending `total` bytes."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    received = [0]

    def receive():
        connection, _ = server.accept()
        while received[0] < total:
            data = connection.recv(chunk)
            if not data:
                break
            received[0] += len(data)
        connection.close()

    thread = threading.Thread(target=receive)
    thread.start()
    client = socket.create_connection(server.getsockname())
    payload = b"\0" * chunk
    start = time.perf_counter()
    for _ in range(total // chunk):
        client.sendall(payload)
    client.close()
    thread.join()
    seconds = time.perf_counter() - start
    server.close()
    return received[0] / seconds / 2**20


def loopback_tcp_curve(sizes, seconds=0.3):
    """MB/s (2**20 bytes) of one TCP stream over 127.0.0.1 for each message size: send `size` bytes, wait for a 1-byte reply.

    The reply makes each figure a round trip, as one all-reduce is; a median of 3 timings of about `seconds` each.
    """
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def serve():
        buffer = memoryview(bytearray(2**22))
        connection, _ = server.accept()
        with connection:
            while True:
                header = connection.recv(8, socket.MSG_WAITALL)
                if len(header) < 8:
                    return
                left = int.from_bytes(header, "little")
                while left:
                    left -= connection.recv_into(buffer, min(left, len(buffer)))
                connection.sendall(b"\1")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = socket.create_connection(server.getsockname())
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rates = {}
    for size in sizes:
        payload = memoryview(bytearray(size))
        calls = max(2, min(2000, int(seconds * 2e9 / size)))
        timings = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(calls):
                client.sendall(size.to_bytes(8, "little"))
                client.sendall(payload)
                client.recv(1)
            timings.append((time.perf_counter() - start) / calls)
        rates[size] = size / sorted(timings)[1] / 2**20
    client.close()
    thread.join(timeout=10)
    server.close()
    return rates


def _launch(args, only, env):
    """Runs the worker script on 2 local workers (`keras-dist launch`); returns the chief's results."""
    with tempfile.TemporaryDirectory() as tmp:
        script, out = os.path.join(tmp, "worker.py"), os.path.join(tmp, "out.json")
        with open(script, "w") as f:
            f.write(WORKER)
        command = [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", "2", script]
        command += [str(args.repeats), out, str(args.rounds), only, args.sizes]
        # Its own process group, killed whole after --timeout: no worker outlives a stuck run.
        overlap_trace._run_launch(command, args.timeout, env=env)
        with open(out) as f:
            return json.load(f)


GATHER_SIZES = "2678824,16777216,67108864"  # The MLP's (784-512-512-10) float32 gradients; 16 and 64 MB.

MEMORY_VARIANTS = ["tensorflow", "none:0", "none:auto", "none:1048576", "fp16:0", "fp16:auto"]


def _memory_report(args, env):
    """Peak RSS of the chief around one 256 MB gradient's all-reduce, each variant in fresh workers."""
    load_start = os.getloadavg()
    rows = {variant: _launch(args, f"memory:{variant}", env)["memory"] for variant in MEMORY_VARIANTS}
    print("one 256 MB float32 gradient, 3 all-reduces, 2 workers x 1 CPU replica; the chief's peak RSS")
    print(f"{'variant (compression:bytes_per_pack)':<40}{'before MB':>11}{'after MB':>10}{'added / gradient':>18}")
    for variant, row in rows.items():
        added = (row["peak_rss_after_bytes"] - row["peak_rss_before_bytes"]) / row["gradient_bytes"]
        row["added_over_gradient"] = added
        before, after = row["peak_rss_before_bytes"] / 2**20, row["peak_rss_after_bytes"] / 2**20
        print(f"{variant:<40}{before:>11,.0f}{after:>10,.0f}{added:>17.2f}x")
    print(f"load average (1, 5, 15 min): {load_start} at the start, {os.getloadavg()} at the end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"memory": rows, "load_average_start": load_start, "load_average_end": os.getloadavg()}, f, indent=2
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="timed all-reduces per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the gradient all-reduce variants")
    parser.add_argument(
        "--only",
        choices=["all", "gradients", "curve", "memory", "gather"],
        default="all",
        help="every section; the gradient all-reduce only; the bus-bandwidth curve (1 KB to 256 MB) only; the "
        "peak memory of one 256 MB gradient's all-reduce only; or all-reduce against all-gather then sum "
        "(at --sizes, default for it: the MLP's 2.7 MB of gradients, 16 and 64 MB)",
    )
    parser.add_argument(
        "--sizes",
        help="bytes of the curve's tensors, comma-separated (default 1 KB to 256 MB, x4 steps; with --only gather "
        f"{GATHER_SIZES})",
    )
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument(
        "--horovod-python",
        help="with --only gradients: the Python of a virtual environment with Horovod (TensorFlow, Gloo), run as a peer",
    )
    parser.add_argument(
        "--timeout", type=float, default=900, help="seconds before a launch (and its workers) is stopped"
    )
    args = parser.parse_args()
    if args.sizes is None:
        args.sizes = GATHER_SIZES if args.only == "gather" else ",".join(str(4**k * 1024) for k in range(10))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_DIST_QUIET": "1"}
    env.pop("TF_CONFIG", None)
    load_start = os.getloadavg()
    tcp = loopback_tcp_MBps()
    sizes = [int(x) for x in args.sizes.split(",")]
    if args.only == "memory":
        _memory_report(args, env)
        return
    if args.horovod_python and args.only != "gradients":
        parser.error(f"--horovod-python runs with --only gradients; received --only {args.only}")
    results = _interleaved_with_horovod(args, env) if args.horovod_python else _launch(args, args.only, env)
    results["loopback_tcp_MBps"] = tcp
    print(f"2 workers x 1 CPU replica on loopback; loopback TCP (1 stream): {tcp:,.0f} MB/s\n")
    if args.only == "gather":
        print(
            f"{'bytes':>12}{'all-reduce ms':>15}{'all-gather + sum ms':>21}{'keras-dist ms':>15}{'gather / reduce':>17}"
        )
        for size in sizes:
            row = {name: r["seconds"] * 1e3 for name, r in results["gather"][str(size)].items()}
            print(
                f"{size:>12,}{row['all_reduce']:>15.2f}{row['all_gather_then_sum']:>21.2f}{row['keras_dist']:>15.2f}"
                f"{row['all_gather_then_sum'] / row['all_reduce']:>16.2f}x"
            )
        results["load_average_start"], results["load_average_end"] = load_start, os.getloadavg()
        print(f"load average (1, 5, 15 min): {load_start} at the start, {results['load_average_end']} at the end")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return
    if args.only == "curve":
        tcp_curve = loopback_tcp_curve(sizes)
        results["loopback_tcp_curve_MBps"] = {str(k): v for k, v in tcp_curve.items()}
        print(
            f"{'bytes':>12}{'TensorFlow busbw':>18}{'keras-dist busbw':>18}{'loopback TCP':>14}{'kd / TF':>9}{'kd / TCP':>10}"
        )
        for size in sizes:
            row = results["curve"][str(size)]
            tf_bw, kd_bw, tcp_bw = row["tensorflow"]["busbw_MBps"], row["keras_dist"]["busbw_MBps"], tcp_curve[size]
            print(
                f"{size:>12,}{tf_bw:>18,.1f}{kd_bw:>18,.1f}{tcp_bw:>14,.0f}{kd_bw / tf_bw:>8.2f}x{kd_bw / tcp_bw:>9.3f}x"
            )
        earlier = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "all_reduce.json")
        if os.path.exists(earlier):  # TensorFlow's one-tensor figures of the committed earlier run, for the plot
            with open(earlier) as f:
                old = json.load(f)
            results["earlier_run_tensorflow_MBps"] = {
                str(mb * 2**20): old[f"allreduce_{mb}MB"]["busbw_MBps"]
                for mb in (1, 16, 64)
                if f"allreduce_{mb}MB" in old
            }
        results["load_average_start"], results["load_average_end"] = load_start, os.getloadavg()
        print(f"load average (1, 5, 15 min): {load_start} at the start, {results['load_average_end']} at the end")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return
    for key, label in (("gradients_64MB", "in 16 tensors"), ("gradients_64MB_one_tensor", "in one tensor")):
        _print_gradients(results[key], f"gradient all-reduce, 64 MB float32 {label}", tcp)
    results["load_average_start"], results["load_average_end"] = load_start, os.getloadavg()
    print(f"load average (1, 5, 15 min): {load_start} at the start, {results['load_average_end']} at the end")
    if args.only == "gradients":
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return
    print()
    print(f"{'all-reduce':<12}{'seconds':>10}{'busbw MB/s':>12}{'/ TCP':>8}")
    for megabytes in (1, 16, 64):
        r = results[f"allreduce_{megabytes}MB"]
        print(f"{megabytes:>4} MB     {r['seconds']:>10.4f}{r['busbw_MBps']:>12,.0f}{r['busbw_MBps'] / tcp:>7.2f}x")
    packing = results["packing"]
    base = packing["1x1MB"]
    print(f"\n{'1 MB as':<30}{'seconds':>10}{'vs 1 tensor':>13}")
    for name, seconds in packing.items():
        print(f"{name:<30}{seconds:>10.4f}{seconds / base:>12.2f}x")
    check = results["structure_check_8_floats"]
    print(f"\ngradient-structure check (8 floats): {check:.4f} s ({check / base:.2f}x one 1 MB all-reduce)")
    k1, k4 = results["accumulation_k1_seconds_per_step"], results["accumulation_k4_seconds_per_step"]
    print(f"\naccumulation (median of 3): {k1:.4f} s/step with k=1, {k4:.4f} s/step with k=4 ({k4 / k1:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def _print_gradients(gradients, title, tcp):
    print(f"{title:<50}{'seconds':>10}{'effective MB/s':>16}{'/ TCP':>8}{'rounds, MB/s':>16}")
    for name, r in gradients.items():
        rounds = r.get("all_rounds") or [r["seconds"]]
        size = r["effective_busbw_MBps"] * r["seconds"]  # MB
        spread = f"{size / max(rounds):,.0f}-{size / min(rounds):,.0f}"
        print(
            f"{name:<50}{r['seconds']:>10.4f}{r['effective_busbw_MBps']:>16,.0f}{r['effective_busbw_MBps'] / tcp:>7.2f}x"
            f"{spread:>16}"
        )
    print()


if __name__ == "__main__":
    main()
