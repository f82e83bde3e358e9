"""Loss curves of the main example on 1 device, 2 CPU replicas and 2 local workers (same global batches).

    python benchmarks/loss_curves.py [--epochs 5] [--global-batch-size 64] [--seed 0] [--json PATH]
    python benchmarks/plot.py --figure loss_curves      # docs/images/loss_curves.png

Trains the CNN of `examples/digits_cnn.py` (the same layers and data split; that script trains
at import, so they are repeated here) three times, each in a fresh process: on one device, on 2
simulated CPU replicas (`MirroredStrategy`), and on 2 local workers (`keras-dist launch
--num-workers 2`, `MultiWorkerMirroredStrategy`, one replica each). Every run uses the same seed
and the same global batches; the running mean of the loss Keras reports after each step, and each
epoch's loss, are written to `benchmarks/results/loss_curves.json`, with the largest difference
from the one-device run. Dropout is left out by default (`--dropout 0`): with it, every replica
draws its masks from its own random stream, so the runs would train on different masks.
About a minute on 2 CPU cores.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = ("one_device", "cpu_replicas_1x2", "workers_2x1")


def _parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dropout", type=float, default=0.0, help="the example's Dropout rate (it uses 0.3)")
    parser.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "loss_curves.json"))
    parser.add_argument("--run", choices=RUNS, help=argparse.SUPPRESS)  # One training run (a child process).
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def train(args):
    """One run in this process; the chief writes {epoch_loss, step_loss, num_replicas_in_sync} to `args.out`."""
    import keras_dist  # Under `keras-dist launch` this joins the cluster.

    if args.run == "cpu_replicas_1x2":
        keras_dist.simulate_cpu_replicas(2)
    import keras
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    keras.utils.set_random_seed(args.seed)
    digits = load_digits()  # As in examples/digits_cnn.py.
    x = (digits.images / 16.0).astype("float32")[..., np.newaxis]
    y = digits.target.astype("int32")
    x_train, _, y_train, _ = train_test_split(x, y, test_size=0.2, stratify=y, random_state=args.seed)
    inputs = keras.Input(shape=(8, 8, 1))
    h = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    h = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(h)
    h = keras.layers.Flatten()(h)
    if args.dropout:
        h = keras.layers.Dropout(args.dropout)(h)
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(10)(h), name="digits_cnn")
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=2e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    train_ds = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(len(x_train), seed=args.seed)
        .batch(args.global_batch_size)
    )
    step_loss = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: step_loss.append(float(logs["loss"]))
    )
    history = model.fit(train_ds, epochs=args.epochs, callbacks=[record], verbose=0)
    if keras_dist.is_chief():
        result = {
            "epoch_loss": [float(v) for v in history.history["loss"]],
            "step_loss": step_loss,  # Keras' running mean of the epoch's loss after each step.
            "num_replicas_in_sync": model.distribute_strategy.num_replicas_in_sync,
            "num_workers": keras_dist.num_workers(),
        }
        with open(args.out, "w") as f:
            json.dump(result, f)


def _run_child(run, args, out):
    script = os.path.abspath(__file__)
    options = [
        "--run",
        run,
        "--out",
        out,
        "--epochs",
        str(args.epochs),
        "--seed",
        str(args.seed),
        "--global-batch-size",
        str(args.global_batch_size),
        "--dropout",
        str(args.dropout),
    ]
    if run == "workers_2x1":
        command = [sys.executable, "-m", "keras_dist.cli", "launch", "--num-workers", "2", script, *options]
    else:
        command = [sys.executable, script, *options]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_DIST_QUIET="1")
    env.pop("KERAS_DIST_CPU_REPLICAS", None)
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if completed.returncode != 0:
        sys.exit(f"{run} failed (exit {completed.returncode}):\n{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main():
    args = _parse()
    if args.run:
        return train(args)
    results = {
        "global_batch_size": args.global_batch_size,
        "epochs": args.epochs,
        "seed": args.seed,
        "dropout": args.dropout,
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for run in RUNS:
            results["runs"][run] = _run_child(run, args, os.path.join(tmp, run + ".json"))
            print(f"{run:>18}: epoch losses", " ".join(f"{v:.6f}" for v in results["runs"][run]["epoch_loss"]))
    reference = results["runs"]["one_device"]["step_loss"]
    for run in RUNS[1:]:
        steps = results["runs"][run]["step_loss"]
        assert len(steps) == len(reference), (run, len(steps), len(reference))
        results["runs"][run]["max_abs_difference"] = max(abs(a - b) for a, b in zip(steps, reference))
    results["max_abs_difference"] = max(results["runs"][run]["max_abs_difference"] for run in RUNS[1:])
    print(f"largest difference from one device (per-step running loss): {results['max_abs_difference']:.3g}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print("wrote", args.json)


if __name__ == "__main__":
    main()
