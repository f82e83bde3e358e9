"""Bytes on the wire and step time of the gradient all-reduce, with and without compression.

A benchmark, not a test: it prints what it measured in this run and writes
JSON (`--json`), asserting nothing about speed.

For each `compression` in (None, "fp16", "bf16") it launches 2 local workers
(`keras-dist launch --num-workers 2`, TensorFlow's gRPC collectives on
loopback) that train a model of `--params` float32 parameters for `--steps`
steps, and measures:

  bytes/step  the growth of the loopback interface's transmitted bytes
              (`/proc/net/dev`, Linux) during the timed steps, divided by
              the steps: everything the workers sent each other (gradients,
              plus gRPC framing and heartbeats), not a computed size.
  step time   wall seconds per timed step on worker 0 (after warm-up steps).

Read it as ratios against `None`: with fp16/bf16 the gradient bytes halve,
so bytes/step should approach 0.5x; step time may not improve on loopback,
where casting costs about what it saves.

    python benchmarks/communication.py [--params 4000000] [--steps 20] [--json out.json]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

WORKER = r"""
import json, sys, time
import keras_dist
import keras, numpy as np

compression, params, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
width = int(params ** 0.5)
inputs = keras.Input((width,))
model = keras_dist.DistributedModel(
    inputs, keras.layers.Dense(width, use_bias=False)(inputs),
    communication={"compression": None if compression == "none" else compression},
)
model.compile(optimizer="sgd", loss="mse")
x = np.random.RandomState(0).rand(8 * (steps + 5), width).astype("float32")


def lo_tx_bytes():
    for line in open("/proc/net/dev"):
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[8])
    return 0


class Timer(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 5:
            self.start, self.tx = time.perf_counter(), lo_tx_bytes()

    def on_train_end(self, logs=None):
        self.seconds, self.bytes = time.perf_counter() - self.start, lo_tx_bytes() - self.tx


timer = Timer()
model.fit(x, x, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
if keras_dist.is_chief():
    timed = steps
    json.dump({"seconds_per_step": timer.seconds / timed, "bytes_per_step": timer.bytes / timed}, open(out, "w"))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=4_000_000, help="float32 parameters (one square Dense)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after 5 warm-up steps)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_DIST_QUIET": "1"}
    env.pop("TF_CONFIG", None)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER)
        for compression in ("none", "fp16", "bf16"):
            out = os.path.join(tmp, f"{compression}.json")
            command = [
                sys.executable,
                "-m",
                "keras_dist.cli",
                "launch",
                "--num-workers",
                "2",
                script,
                compression,
                str(args.params),
                str(args.steps),
                out,
            ]
            subprocess.run(command, env=env, check=True, capture_output=True, timeout=600)
            with open(out) as f:
                results[compression] = json.load(f)
    base = results["none"]
    width = int(args.params**0.5)
    print(
        f"2 workers on loopback, {width * width:,} float32 gradients "
        f"({width * width * 4 / 2**20:.1f} MiB) per step, {args.steps} timed steps\n"
    )
    print(f"{'compression':<12}{'bytes/step':>14}{'vs none':>9}{'s/step':>10}{'vs none':>9}")
    for name, r in results.items():
        print(
            f"{name:<12}{r['bytes_per_step']:>14,.0f}{r['bytes_per_step'] / base['bytes_per_step']:>8.2f}x"
            f"{r['seconds_per_step']:>10.3f}{r['seconds_per_step'] / base['seconds_per_step']:>8.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": width * width, "steps": args.steps, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
