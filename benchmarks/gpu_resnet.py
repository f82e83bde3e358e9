"""ResNet-50 throughput and GPU memory: keras-dist against raw Keras 3, mixed precision, all GPUs.

A benchmark, not a test, and never part of CI: it prints what it measured in
this run and writes JSON (`--json`), asserting nothing about speed.

Each system runs in its own process (`--system`, started by this script), on
`keras.applications.ResNet50(weights=None)` with `mixed_float16`, synthetic
ImageNet-shaped data (224x224x3 images, 1000 classes, generated on the device
side by a repeated `tf.data` pipeline of one cached global batch, so the input
costs nothing), SGD with momentum, under `MirroredStrategy` over all visible
GPUs (keras-dist: `strategy="auto"`, which picks the same with NCCL).

  examples/s   global batch / median step time, over `--steps` steps of each
               of `--epochs` epochs after a warm-up epoch (epoch hooks only).
  memory       `tf.config.experimental.get_memory_info("GPU:0")["peak"]`,
               in GiB, after training.
  startup      process start to the end of the first step, in seconds.

Sized for about 10 minutes on one large GPU with the defaults (2 systems x 2
interleaved repeats, each a fresh process of ~1-2 min, most of it start-up and
XLA-free tracing); `--smoke` runs a tiny version on CPU (ResNet-50 at 32x32,
batch 8, 2 steps) to check the script itself.

    python benchmarks/gpu_resnet.py [--global-batch-size 256] [--steps 50] [--repeats 2] [--json out.json]
    python benchmarks/gpu_resnet.py --smoke
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def measure(args):
    """Runs inside the child process for one system; writes its figures to `args.out`."""
    started_at = float(os.environ.get("GPU_RESNET_STARTED_AT", time.time()))
    if args.system == "keras_dist":
        import keras_dist
    import keras
    import tensorflow as tf

    keras.mixed_precision.set_global_policy("mixed_float16")
    size, batch = args.image_size, args.global_batch_size

    def build():
        model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=1000)
        return model.inputs, model.outputs

    if args.system == "keras_dist":
        inputs, outputs = build()
        model = keras_dist.DistributedModel(inputs, outputs)
        strategy = model.distribute_strategy
    else:
        gpus = tf.config.list_logical_devices("GPU")
        strategy = tf.distribute.MirroredStrategy() if gpus else tf.distribute.get_strategy()
        with strategy.scope():
            model = keras.Model(*build())
    with strategy.scope():
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=False),
        )
    images = tf.random.uniform((batch, size, size, 3), seed=0)
    labels = tf.random.uniform((batch,), maxval=1000, dtype=tf.int32, seed=0)
    ds = tf.data.Dataset.from_tensors((images, labels)).cache().repeat().prefetch(tf.data.AUTOTUNE)

    class EpochTimer(keras.callbacks.Callback):
        seconds = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self.start)

    model.fit(ds, steps_per_epoch=1, epochs=1, verbose=0)
    startup_seconds = time.time() - started_at
    timer = EpochTimer()
    model.fit(ds, steps_per_epoch=args.steps, epochs=args.epochs + 1, verbose=0, callbacks=[timer])
    step_seconds = [s / args.steps for s in timer.seconds[1:]]
    peak = None
    if tf.config.list_physical_devices("GPU"):
        peak = tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**30
    with open(args.out, "w") as f:
        json.dump(
            {
                "step_seconds": step_seconds,
                "startup_seconds": startup_seconds,
                "peak_memory_gib_gpu0": peak,
                "num_replicas_in_sync": strategy.num_replicas_in_sync,
                "devices": [d.name for d in tf.config.list_logical_devices("GPU")] or ["CPU"],
            },
            f,
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch-size", type=int, default=256, help="examples per step, all GPUs")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=50, help="steps per timed epoch")
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per process (after a warm-up epoch)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds over the systems")
    parser.add_argument("--systems", default="keras_dist,keras")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run: 32x32 images, batch 8, 2 steps")
    parser.add_argument("--timeout", type=float, default=400, help="seconds per process")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--system", help=argparse.SUPPRESS)  # Child process: measure one system.
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.global_batch_size, args.image_size, args.steps, args.epochs, args.repeats = 8, 32, 2, 1, 1
    if args.system:
        return measure(args)
    started = time.perf_counter()
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_DIST_QUIET": "1"}
    env.pop("TF_CONFIG", None)
    runs = {name: [] for name in args.systems.split(",")}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for name in runs:
                out = os.path.join(tmp, f"{name}.json")
                command = [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--system",
                    name,
                    "--out",
                    out,
                    "--global-batch-size",
                    str(args.global_batch_size),
                    "--image-size",
                    str(args.image_size),
                    "--steps",
                    str(args.steps),
                    "--epochs",
                    str(args.epochs),
                ]
                env["GPU_RESNET_STARTED_AT"] = repr(time.time())
                proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
                if proc.returncode != 0:
                    print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                    raise SystemExit(f"{name}: exit status {proc.returncode}")
                with open(out) as f:
                    runs[name].append(json.load(f))
    summary = {}
    for name, results in runs.items():
        step = statistics.median(s for r in results for s in r["step_seconds"])
        peaks = [r["peak_memory_gib_gpu0"] for r in results if r["peak_memory_gib_gpu0"] is not None]
        summary[name] = {
            "median_step_seconds": step,
            "examples_per_second": args.global_batch_size / step,
            "peak_memory_gib_gpu0": max(peaks) if peaks else None,
            "startup_seconds": statistics.median(r["startup_seconds"] for r in results),
            "num_replicas_in_sync": results[0]["num_replicas_in_sync"],
            "devices": results[0]["devices"],
            "runs": results,
        }
    first = next(iter(summary.values()))
    print(
        f"ResNet-50, mixed_float16, {args.image_size}x{args.image_size}x3, global batch {args.global_batch_size}, "
        f"{first['num_replicas_in_sync']} replica(s) on {', '.join(first['devices'])}"
    )
    print(f"{'system':<12}{'ms/step':>10}{'examples/s':>12}{'peak GiB':>10}{'startup s':>11}")
    for name, r in summary.items():
        peak = f"{r['peak_memory_gib_gpu0']:.2f}" if r["peak_memory_gib_gpu0"] is not None else "-"
        print(
            f"{name:<12}{r['median_step_seconds'] * 1e3:>10.1f}{r['examples_per_second']:>12,.0f}{peak:>10}"
            f"{r['startup_seconds']:>11.1f}"
        )
    if "keras_dist" in summary and "keras" in summary:
        ratio = summary["keras_dist"]["median_step_seconds"] / summary["keras"]["median_step_seconds"]
        print(f"keras_dist / keras step time: {ratio:.2f}x")
    print(f"took {time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": summary}, f, indent=2)


if __name__ == "__main__":
    main()
