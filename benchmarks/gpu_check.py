"""The GPU check (issue 23 item 6): keras-dist against raw Keras on one GPU, and all-reduce bus bandwidth.

A benchmark, not a test: it prints what it measured and writes JSON, asserting
nothing about speed. Sized for under 8 minutes on one large GPU
(`benchmarks/gpu_check.sh`, which the `device` tool runs when a GPU is lent).

Throughput, keras-dist (`keras_dist.DistributedModel`, `strategy="auto"`)
against raw Keras 3 (`keras.Model`, no strategy) on one GPU, each
(model, system) in a fresh process, the systems in A B B A order over the two
models (a drift in the GPU's clocks hits both alike):

  resnet50      `keras.applications.ResNet50(weights=None)`, synthetic 224x224x3
                images, 1000 classes, SGD with momentum.
  transformer   4 encoder blocks (d_model 256, 4 heads, FFN 1024) over 256
                synthetic tokens (vocabulary 20,000), mean-pooled, 2 classes, Adam.
  configs       `fp32` (float32, graph), `mixed` (`mixed_float16`, graph) and
                `mixed_xla` (`mixed_float16`, `jit_compile=True`), run one after
                the other in the same process (`keras.backend.clear_session()`
                between them).

Each config: one cached batch repeated by `tf.data` (the input costs nothing),
a warm-up epoch, then `--epochs` epochs of `--steps` steps timed by epoch hooks;
examples/s = global batch / median step time; peak GPU memory from
`tf.config.experimental.get_memory_info` (reset between configs).

Bus bandwidth: GPU 0 carved into 2 logical GPUs (`memory_limit` each), float32
all-reduce of 1 KB to 256 MB under `MirroredStrategy` with each of
TensorFlow's cross-device ops (`NcclAllReduce`, `HierarchicalCopyAllReduce`,
`ReductionToOneDevice`): bus bandwidth = bytes x 2(n-1)/n / time (the
nccl-tests definition), median of `--repeats`. NCCL may refuse two ranks on
one physical GPU: the JSON then holds its error, and the other ops' figures.

    bash benchmarks/gpu_check.sh                       # all of it, JSON in benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py [--models resnet50,transformer] [--configs fp32,mixed,mixed_xla] [--json out.json]
    python benchmarks/gpu_check.py --smoke             # tiny CPU run that checks the script (CI runs it);
                                                       # a one-block stand-in replaces ResNet-50 there
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODELS = ("resnet50", "transformer")
CONFIGS = ("fp32", "mixed", "mixed_xla")
SYSTEMS = ("keras", "keras_dist")
CROSS_DEVICE_OPS = ("NcclAllReduce", "HierarchicalCopyAllReduce", "ReductionToOneDevice")
FULL = {"resnet50": {"batch": 128, "image": 224}, "transformer": {"batch": 64, "tokens": 256, "layers": 4}}
SMOKE = {
    "resnet50": {"batch": 4, "image": 16, "stand_in": True},
    "transformer": {"batch": 4, "tokens": 16, "layers": 1},
}


def _build(keras, name, sizes):
    """Returns `(inputs, outputs, optimizer, batch)` for one model, built in the current scope."""
    if name == "resnet50":
        size = sizes["image"]
        if sizes.get("stand_in"):  # --smoke: one residual block checks the script; ResNet-50 takes minutes on CPU.
            images = keras.Input((size, size, 3))
            x = keras.layers.Conv2D(8, 3, padding="same")(images)
            x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x) + x)
            outputs = keras.layers.Dense(1000, activation="softmax", dtype="float32")(
                keras.layers.GlobalAveragePooling2D()(x)
            )
            return [images], [outputs], keras.optimizers.SGD(0.1, momentum=0.9)
        base = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=1000)
        return base.inputs, base.outputs, keras.optimizers.SGD(0.1, momentum=0.9)
    layers = keras.layers
    tokens = keras.Input((sizes["tokens"],), dtype="int32")
    x = layers.Embedding(sizes.get("vocabulary", 20000), 256)(tokens)
    for _ in range(sizes["layers"]):
        attention = layers.MultiHeadAttention(num_heads=4, key_dim=64)(x, x)
        x = layers.LayerNormalization()(x + attention)
        feed_forward = layers.Dense(256)(layers.Dense(1024, activation="gelu")(x))
        x = layers.LayerNormalization()(x + feed_forward)
    outputs = layers.Dense(2, dtype="float32")(layers.GlobalAveragePooling1D()(x))
    return [tokens], [outputs], keras.optimizers.Adam(1e-4)


def _data(tf, name, sizes):
    batch = sizes["batch"]
    if name == "resnet50":
        size = sizes["image"]
        x = tf.random.uniform((batch, size, size, 3), seed=0)
        y = tf.random.uniform((batch,), maxval=1000, dtype=tf.int32, seed=0)
    else:
        x = tf.random.uniform((batch, sizes["tokens"]), maxval=sizes.get("vocabulary", 20000), dtype=tf.int32, seed=0)
        y = tf.random.uniform((batch,), maxval=2, dtype=tf.int32, seed=0)
    return tf.data.Dataset.from_tensors((x, y)).cache().repeat().prefetch(tf.data.AUTOTUNE)


def measure_throughput(args):
    """Child process: one (model, system), every config; writes `{config: figures}` to `args.out`."""
    if args.system == "keras_dist":
        import keras_dist
    import keras
    import tensorflow as tf

    sizes = (SMOKE if args.smoke else FULL)[args.model]
    gpus = tf.config.list_logical_devices("GPU")
    results = {}
    for config in args.configs.split(","):
        keras.backend.clear_session()
        keras.mixed_precision.set_global_policy("mixed_float16" if config.startswith("mixed") else "float32")
        if gpus:
            tf.config.experimental.reset_memory_stats("GPU:0")
        started = time.perf_counter()
        inputs, outputs, optimizer = _build(keras, args.model, sizes)
        model = (keras_dist.DistributedModel if args.system == "keras_dist" else keras.Model)(inputs, outputs)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=args.model == "transformer"),
            jit_compile=config.endswith("xla"),
        )
        ds = _data(tf, args.model, sizes)

        class EpochTimer(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.seconds = []

            def on_epoch_begin(self, epoch, logs=None):
                self.start = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                self.seconds.append(time.perf_counter() - self.start)

        timer = EpochTimer()
        setup_seconds = time.perf_counter() - started
        model.fit(ds, steps_per_epoch=args.steps, epochs=args.epochs + 1, verbose=0, callbacks=[timer])
        step_seconds = [s / args.steps for s in timer.seconds[1:]]
        results[config] = {
            "step_seconds": step_seconds,
            "examples_per_second": sizes["batch"] / statistics.median(step_seconds),
            "build_seconds": setup_seconds,
            "warm_up_epoch_seconds": timer.seconds[0],  # tracing (and XLA compilation) included
            "peak_memory_gib": tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**30 if gpus else None,
            "num_replicas_in_sync": getattr(
                model, "distribute_strategy", tf.distribute.get_strategy()
            ).num_replicas_in_sync,
        }
        print(
            f"{args.model} {args.system} {config}: {results[config]['examples_per_second']:.1f} examples/s", flush=True
        )
    with open(args.out, "w") as f:
        json.dump({"devices": [d.name for d in gpus] or ["CPU"], "batch": sizes["batch"], "configs": results}, f)


def measure_bandwidth(args):
    """Child process: all-reduce bus bandwidth on 2 logical devices carved from device 0; writes JSON."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        limit = 4096 if args.smoke else 24576  # MB per logical GPU: room for 256 MB x a few buffers
        tf.config.set_logical_device_configuration(gpus[0], [tf.config.LogicalDeviceConfiguration(limit)] * 2)
        devices = ["/gpu:0", "/gpu:1"]
    else:
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
        devices = ["/cpu:0", "/cpu:1"]
    sizes = [2**10, 2**14, 2**20] if args.smoke else [2**10, 2**14, 2**18, 2**20, 2**22, 2**24, 2**26, 2**28]
    results = {}
    for name in CROSS_DEVICE_OPS:
        entry = results.setdefault(name, {"bytes": [], "bus_gb_per_s": [], "median_seconds": []})
        try:
            strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=getattr(tf.distribute, name)())
            for size in sizes:
                values = strategy.experimental_distribute_values_from_function(
                    lambda context, size=size: tf.fill([size // 4], 1.0)
                )
                reduce = tf.function(
                    lambda v, strategy=strategy: strategy.run(
                        lambda x: tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, x), (v,)
                    )
                )
                reduced = reduce(values)  # Traces, and checks the sum.
                first = strategy.experimental_local_results(reduced)[0]
                if float(first[0]) != 2.0:
                    raise RuntimeError(f"{name}: the all-reduce of ones gave {float(first[0])}, expected 2.0")
                seconds = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    for result in strategy.experimental_local_results(reduce(values)):
                        result.numpy()[:1]  # Waits for every replica's result.
                    seconds.append(time.perf_counter() - start)
                median = statistics.median(seconds)
                entry["bytes"].append(size)
                entry["median_seconds"].append(median)
                entry["bus_gb_per_s"].append(size * 2 * (2 - 1) / 2 / median / 1e9)
        except Exception as error:  # noqa: BLE001  (recorded: NCCL may refuse two ranks on one GPU)
            entry["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
        print(f"bandwidth {name}: {entry.get('error') or 'done'}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"devices": devices, "results": results}, f)


def _child(args, tmp, extra, started_at_env):
    out = os.path.join(tmp, f"{'-'.join(extra[1::2])}.json")
    command = [sys.executable, os.path.abspath(__file__), *extra, "--out", out, "--steps", str(args.steps)]
    command += ["--epochs", str(args.epochs), "--repeats", str(args.repeats), "--configs", ",".join(args.configs)]
    if args.smoke:
        command.append("--smoke")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_DIST_QUIET": "1", started_at_env: repr(time.time())}
    env.pop("TF_CONFIG", None)
    left = args.budget_s - (time.perf_counter() - args.started)
    if left < 30:
        return {"error": f"not run: {left:.0f} s of the {args.budget_s:.0f} s budget left"}
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped at the {args.budget_s:.0f} s budget"}
    if proc.returncode != 0 or not os.path.exists(out):
        lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "Error" in line]
        return {"error": (lines[-1] if lines else f"exit status {proc.returncode}")[-400:]}
    with open(out) as f:
        return json.load(f)


def run(args):
    """Parent: the throughput children in A B B A order, then the bandwidth child; returns the report dict."""
    report = {"load_average_start": os.getloadavg(), "throughput": {}, "bandwidth": None}
    order = [(m, s) for i, m in enumerate(args.models) for s in (SYSTEMS if i % 2 == 0 else SYSTEMS[::-1])]
    with tempfile.TemporaryDirectory() as tmp:
        for model, system in order:
            result = _child(args, tmp, ["--model", model, "--system", system], "GPU_CHECK_STARTED_AT")
            report["throughput"].setdefault(model, {})[system] = result
        if not args.no_bandwidth:
            report["bandwidth"] = _child(args, tmp, ["--bandwidth", "yes"], "GPU_CHECK_STARTED_AT")
    for systems in report["throughput"].values():
        ours, theirs = systems.get("keras_dist", {}), systems.get("keras", {})
        for config in args.configs:
            a, b = ours.get("configs", {}).get(config), theirs.get("configs", {}).get(config)
            if a and b:
                systems.setdefault("keras_dist_over_keras_throughput", {})[config] = (
                    a["examples_per_second"] / b["examples_per_second"]
                )
    report["load_average_end"] = os.getloadavg()
    report["elapsed_seconds"] = time.perf_counter() - args.started
    return report


def _size(num_bytes):
    return f"{num_bytes // 2**20}MB" if num_bytes >= 2**20 else f"{num_bytes // 2**10}KB"


def print_report(report, args):
    print(f"\nthroughput on {'CPU (smoke)' if args.smoke else 'one GPU'}: examples/s (peak GiB)")
    print(f"{'model':<13}{'config':<11}{'keras':>18}{'keras_dist':>18}{'kd / keras':>12}")
    for model, systems in report["throughput"].items():
        for config in args.configs:
            cells = []
            for system in SYSTEMS:
                figures = systems.get(system, {}).get("configs", {}).get(config)
                if figures is None:
                    cells.append(f"{(systems.get(system) or {}).get('error', 'not run')[:16]:>18}")
                    continue
                peak = f" ({figures['peak_memory_gib']:.1f})" if figures["peak_memory_gib"] is not None else ""
                cells.append(f"{figures['examples_per_second']:>12,.1f}{peak:>6}")
            ratio = systems.get("keras_dist_over_keras_throughput", {}).get(config)
            print(f"{model:<13}{config:<11}{''.join(cells)}{(f'{ratio:.3f}x' if ratio else '-'):>12}")
    bandwidth = report["bandwidth"]
    if bandwidth is not None:
        print(f"\nall-reduce bus bandwidth, 2 logical devices on {', '.join(bandwidth.get('devices', ['?']))}: GB/s")
        for name, entry in (bandwidth.get("results") or {}).items():
            figures = " ".join(f"{_size(b)}:{bw:.3g}" for b, bw in zip(entry["bytes"], entry["bus_gb_per_s"]))
            print(f"  {name:<27}{figures}{'  ' + entry['error'] if 'error' in entry else ''}")
        if "error" in bandwidth:
            print(f"  {bandwidth['error']}")
    load = report["load_average_start"][0], report["load_average_end"][0]
    print(f"\ntook {report['elapsed_seconds']:.0f} s; load average {load[0]:.2f} at start, {load[1]:.2f} at end")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=None, help="steps per timed epoch (default 20; smoke 2)")
    parser.add_argument("--epochs", type=int, default=None, help="timed epochs after a warm-up (default 3; smoke 1)")
    parser.add_argument("--repeats", type=int, default=None, help="all-reduce repeats per size (default 20; smoke 2)")
    parser.add_argument("--budget-s", type=float, default=450, help="stop starting children after this many seconds")
    parser.add_argument("--no-bandwidth", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU: checks the script")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--model", help=argparse.SUPPRESS)  # Child: one (model, system).
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--bandwidth", help=argparse.SUPPRESS)  # Child: the all-reduce bandwidth.
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name, full, smoke in (("steps", 20, 2), ("epochs", 3, 1), ("repeats", 20, 2)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    if args.model:
        return measure_throughput(args)
    if args.bandwidth:
        return measure_bandwidth(args)
    args.models, args.configs = args.models.split(","), args.configs.split(",")
    for values, allowed, flag in ((args.models, MODELS, "--models"), (args.configs, CONFIGS, "--configs")):
        bad = [v for v in values if v not in allowed]
        if bad:
            parser.error(f"{flag}: expected some of {', '.join(allowed)}; received {', '.join(bad)}")
    args.started = time.perf_counter()
    report = run(args)
    report["config"] = {k: v for k, v in vars(args).items() if k not in ("json", "started")}
    print_report(report, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
