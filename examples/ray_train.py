"""Train a `keras_dist.DistributedModel` on Ray Train workers and checkpoint it through Ray.

`ray.train.tensorflow.TensorflowTrainer` starts the workers and writes each one's
`TF_CONFIG` (worker tasks only, index = Ray's world rank); `import keras_dist` in
the training function reads it and joins the cluster, so the Keras code is the
same as with `keras-dist launch`. The weights equal one device's on the same
global batches (tests/integration/test_ray_train.py checks 1e-5).

    python examples/ray_train.py --num-workers 2 --storage-path /tmp/ray_results

Without `--address` the script starts a Ray cluster on this machine and keeps it
on 127.0.0.1 (TensorFlow's gRPC servers have no authentication); with
`--address auto` it joins a running cluster, whose workers need keras-dist.
"""

import argparse
import json
import os
import tempfile

import numpy as np

GLOBAL_BATCH_SIZE = 8  # examples per step, summed over every replica of every worker
EPOCHS = 2


def build_model(model_class):
    """Returns a compiled regression model with fixed initial weights (`keras.Model` or `DistributedModel`)."""
    import keras

    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = model_class(inputs, keras.layers.Dense(1)(hidden))
    rs = np.random.RandomState(42)
    model.set_weights([rs.normal(0, 0.5, w.shape).astype("float32") for w in model.get_weights()])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return model


def make_dataset(global_batch_size):
    """37 examples in global batches (the last one uneven), the same on every worker."""
    import tensorflow as tf

    rs = np.random.RandomState(0)
    x = rs.rand(37, 4).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32") + 0.3 * rs.rand(37, 1)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch_size)


def train_loop_per_worker(config):
    """Runs on every Ray Train worker, in its own process."""
    import ray.train

    # keras_dist: imported here, before any TensorFlow op: Ray has written TF_CONFIG, and the
    # import joins the cluster (MultiWorkerMirroredStrategy; worker 0, Ray's rank 0, is the chief).
    import keras_dist

    model = build_model(keras_dist.DistributedModel)
    # keras_dist: every worker reads the same global batches; TensorFlow splits each between them.
    history = model.fit(make_dataset(config["global_batch_size"]), epochs=config["epochs"], verbose=2)
    with tempfile.TemporaryDirectory() as directory:
        # keras_dist: `save_weights` is collective: every worker calls it, the chief writes the file.
        model.save_weights(os.path.join(directory, "model.weights.h5"))
        # keras_dist: only the chief has a file to report; every worker calls `report` (Ray's barrier).
        checkpoint = ray.train.Checkpoint.from_directory(directory) if keras_dist.is_chief() else None
        metrics = {
            "loss": history.history["loss"][-1],
            "num_replicas_in_sync": model.distribute_strategy.num_replicas_in_sync,
        }
        ray.train.report(metrics, checkpoint=checkpoint)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Train a DistributedModel with Ray Train.")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--storage-path", default=os.path.expanduser("~/ray_results"))
    parser.add_argument("--address", default=None, help="a running Ray cluster; default: start one here")
    args = parser.parse_args(argv)
    if args.address is None:
        # keras_dist: on Linux Ray would put the machine's routable address in TF_CONFIG;
        # this keeps a cluster of one machine on loopback. It must be set before `import ray`.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    # keras_dist: Ray sets only OMP_NUM_THREADS; these size TensorFlow's thread pools per worker
    # (`keras-dist launch` shares the cores out the same way). TF_ENABLE_ONEDNN_OPTS=0, when set,
    # makes CPU kernels round as on one device.
    threads = str(max(1, len(os.sched_getaffinity(0)) // args.num_workers))
    env_vars = {"KERAS_DIST_INTRA_OP_THREADS": threads, "KERAS_DIST_INTER_OP_THREADS": threads}
    env_vars.update({k: os.environ[k] for k in ("TF_ENABLE_ONEDNN_OPTS", "KERAS_DIST_QUIET") if k in os.environ})
    if args.address is None:
        ray.init(num_cpus=args.num_workers, include_dashboard=False, runtime_env={"env_vars": env_vars})
    else:
        ray.init(address=args.address, runtime_env={"env_vars": env_vars})
    try:
        trainer = TensorflowTrainer(
            train_loop_per_worker,
            train_loop_config={"global_batch_size": GLOBAL_BATCH_SIZE, "epochs": EPOCHS},
            scaling_config=ScalingConfig(num_workers=args.num_workers),
            run_config=RunConfig(name="keras_dist_ray_train", storage_path=args.storage_path),
        )
        result = trainer.fit()
    finally:
        ray.shutdown()
    print(f"metrics: {json.dumps(result.metrics)}")  # the chief's last report
    print(f"checkpoint: {os.path.join(result.checkpoint.path, 'model.weights.h5')}")


if __name__ == "__main__":
    main()
