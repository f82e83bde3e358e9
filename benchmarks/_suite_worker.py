"""One measurement of `benchmarks/suite.py`: one system, one workload, in this process.

Not meant to be run by hand (the suite starts it, once per process or once per
worker under `keras-dist launch`). Order matters: flags are parsed and the
devices configured before TensorFlow (or JAX) runs its first operation.

Systems:
  keras_dist  `keras_dist.DistributedModel`, `strategy="auto"` (simulated CPU
              replicas via KERAS_DIST_CPU_REPLICAS, workers via TF_CONFIG).
  keras       raw Keras 3 `keras.Model` under the `tf.distribute` strategy that
              keras-dist would pick: MirroredStrategy over the simulated CPU
              devices (ReductionToOneDevice, as keras-dist uses), or TensorFlow's
              MultiWorkerMirroredStrategy for several workers.
  keras_loop  raw Keras 3 `keras.Model` trained by a custom loop
              (`strategy.run` of forward, loss, gradients and `optimizer.apply`
              in one `tf.function`, the loss fetched every step as `fit` does):
              what works under MultiWorkerMirroredStrategy, where Keras 3.15's
              `fit` fails (a PerReplica batch in `_maybe_symbolic_build`).
  tf_keras    tf.keras 2 (the `tf_keras` package) under the same strategies.
  jax         Keras 3 on JAX with `keras.distribution.DataParallel` over
              XLA's simulated host devices (one process only).
  horovod     Horovod's Keras API (`horovod.tensorflow.keras`, Gloo) on the
              tf.keras of the Python it runs in (the suite's `--horovod-python`):
              `hvd.DistributedOptimizer`, variables broadcast from rank 0, each
              process one shard at `global batch / size` (horovodrun, one
              process per worker, no tf.distribute strategy).

Workloads: see `benchmarks/suite.py`; `recommender` is an `Embedding(--embedding-rows, 64)`
table (8 ids per example, a fifth of them from 100 popular ids) averaged into `Dense(10)`.

Timing: `fit` runs 1 step first (process start to the end of that fit is the
startup time), then `--epochs` epochs of `--steps` steps; a callback that uses
only epoch hooks (batch hooks would add a host sync, and under keras-dist a
per-batch agreement) times every epoch; the first timed epoch is warm-up.
Writes JSON to `--out` (worker 0 only), with this process's peak RSS in bytes
(`ru_maxrss`) as `peak_rss_bytes`; every other worker writes its own
`{"peak_rss_bytes": ...}` to `<--out>.worker<index>` before worker 0 writes `--out`.
"""

import argparse
import json
import os
import resource
import sys
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--system", required=True, choices=["keras_dist", "keras", "keras_loop", "tf_keras", "jax", "horovod"]
    )
    parser.add_argument("--workload", required=True, choices=["mlp", "cnn", "digits", "sequence", "recommender"])
    parser.add_argument("--replicas", type=int, default=1, help="simulated CPU replicas in this process")
    parser.add_argument("--gpu", action="store_true", help="mirror over all GPUs instead of CPU replicas")
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--embedding-rows", type=int, default=1_000_000, help="rows of the recommender's table")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed epoch")
    parser.add_argument("--epochs", type=int, default=4, help="timed epochs (the first is warm-up)")
    parser.add_argument("--intra-op-threads", type=int, default=0, help="0 = TensorFlow's default")
    parser.add_argument("--inter-op-threads", type=int, default=0, help="0 = TensorFlow's default")
    parser.add_argument("--out", required=True)
    return parser.parse_args()


ARGS = parse_args()
STARTED_AT = float(os.environ.get("SUITE_STARTED_AT", time.time()))
MULTI_WORKER = "TF_CONFIG" in os.environ and len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]) > 1
WORKER_INDEX = json.loads(os.environ["TF_CONFIG"])["task"]["index"] if MULTI_WORKER else 0
HOROVOD_SIZE = int(os.environ.get("HOROVOD_SIZE", "1")) if ARGS.system == "horovod" else 1
if ARGS.system == "horovod":  # horovodrun's rank, not TF_CONFIG's
    WORKER_INDEX = int(os.environ.get("HOROVOD_RANK", "0"))
IS_CHIEF = WORKER_INDEX == 0


def setup():
    """Configures devices and threads, creates the strategy; returns (keras module, strategy or None)."""
    if ARGS.system == "jax":
        os.environ["KERAS_BACKEND"] = "jax"
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={ARGS.replicas}"
        import keras

        if ARGS.replicas > 1:
            import jax

            keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
        return keras, None
    if ARGS.system == "keras_dist":
        if ARGS.replicas > 1:
            os.environ["KERAS_DIST_CPU_REPLICAS"] = str(ARGS.replicas)
        import keras

        import keras_dist  # noqa: F401 (joins the cluster at import under TF_CONFIG)

        return keras, None
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import tensorflow as tf

    _apply_threads(tf)
    if ARGS.system == "horovod":
        import horovod.tensorflow.keras as hvd

        hvd.init()
        return tf.keras, None
    if ARGS.system == "tf_keras":
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
        import tf_keras as keras
    else:
        import keras
    if MULTI_WORKER:
        return keras, tf.distribute.MultiWorkerMirroredStrategy()
    if ARGS.gpu:
        return keras, tf.distribute.MirroredStrategy()
    if ARGS.replicas > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * ARGS.replicas)
        devices = [f"/cpu:{i}" for i in range(ARGS.replicas)]
        return keras, tf.distribute.MirroredStrategy(devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
    return keras, None


def _apply_threads(tf):
    """Gives raw TensorFlow the thread pools `keras-dist launch` gives keras-dist (same env variables)."""
    intra = int(os.environ.get("KERAS_DIST_INTRA_OP_THREADS", "0") or 0)
    inter = int(os.environ.get("KERAS_DIST_INTER_OP_THREADS", "0") or 0)
    if intra:
        tf.config.threading.set_intra_op_parallelism_threads(intra)
    if inter:
        tf.config.threading.set_inter_op_parallelism_threads(inter)


def build(keras):
    """Returns (inputs, outputs, dataset, optimizer) for the workload."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.RandomState(0)
    batch = ARGS.global_batch_size // HOROVOD_SIZE  # Horovod: each process batches its own shard
    L = keras.layers
    if ARGS.workload == "mlp":
        x = rng.rand(batch * 8, 784).astype("float32")
        y = rng.randint(0, 10, len(x)).astype("int32")
        inputs = keras.Input((784,))
        h = L.Dense(512, activation="relu")(L.Dense(512, activation="relu")(inputs))
        outputs = L.Dense(10)(h)
    elif ARGS.workload == "cnn":
        x = rng.rand(batch * 4, 32, 32, 3).astype("float32")
        y = rng.randint(0, 10, len(x)).astype("int32")
        inputs = keras.Input((32, 32, 3))
        h = L.Conv2D(32, 3, padding="same", activation="relu")(inputs)
        h = L.MaxPooling2D()(h)
        h = L.Conv2D(64, 3, padding="same", activation="relu")(h)
        h = L.MaxPooling2D()(h)
        h = L.Conv2D(64, 3, padding="same", activation="relu")(h)
        outputs = L.Dense(10)(L.GlobalAveragePooling2D()(h))
    elif ARGS.workload == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = (digits.images / 16.0).astype("float32")[..., None]
        y = digits.target.astype("int32")
        inputs = keras.Input((8, 8, 1))
        h = L.Conv2D(32, 3, padding="same", activation="relu")(inputs)
        h = L.Conv2D(64, 3, padding="same", activation="relu")(h)
        outputs = L.Dense(10)(L.Dropout(0.3)(L.Flatten()(h)))
    elif ARGS.workload == "recommender":
        rows = ARGS.embedding_rows
        ids = rng.randint(0, rows, (batch * 8, 8))
        popular = rng.rand(*ids.shape) < 0.2  # Popular ids repeat within and across batches.
        ids[popular] = rng.randint(0, min(100, rows), popular.sum())
        x = ids.astype("int32")
        y = rng.randint(0, 10, len(x)).astype("int32")
        inputs = keras.Input((8,), dtype="int32")
        h = L.GlobalAveragePooling1D()(L.Embedding(rows, 64)(inputs))
        outputs = L.Dense(10)(h)
    else:
        return _sequence(keras, rng, batch)
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if ARGS.system == "horovod":  # Its own shard; tf.distribute shards the others' (auto-sharding)
        ds = ds.shard(HOROVOD_SIZE, WORKER_INDEX)
    ds = ds.repeat().batch(batch, drop_remainder=True)
    return inputs, outputs, ds.prefetch(2), keras.optimizers.SGD(0.01)


def _sequence(keras, rng, batch):
    """Variable-length token sequences (8..64), padded per batch to one of 4 bucket lengths; masked GRU."""
    import tensorflow as tf

    lengths = rng.randint(8, 65, batch * 8)
    tokens = [rng.randint(1, 1000, n).astype("int32") for n in lengths]
    labels = (lengths > 36).astype("int32")

    def generate():
        yield from zip(tokens, labels)

    ds = (
        tf.data.Dataset.from_generator(
            generate, output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.int32))
        )
        .cache()
        .repeat()
    )
    # Padded to the bucket's upper bound: every batch has one of 4 static lengths (16, 32, 48, 64).
    ds = ds.bucket_by_sequence_length(
        lambda x, y: tf.shape(x)[0], [17, 33, 49, 65], [batch] * 5, pad_to_bucket_boundary=True, drop_remainder=True
    )
    inputs = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(1000, 32, mask_zero=True)(inputs)
    h = keras.layers.GRU(32)(h)
    outputs = keras.layers.Dense(2)(h)
    return inputs, outputs, ds.prefetch(2), keras.optimizers.SGD(0.01)


def make_model(keras, strategy, inputs_outputs_factory):
    import contextlib

    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        inputs, outputs, ds, optimizer = inputs_outputs_factory()
        if ARGS.system == "keras_dist":
            import keras_dist

            model = keras_dist.DistributedModel(inputs, outputs)
        elif ARGS.system == "horovod":
            import horovod.tensorflow.keras as hvd

            model, optimizer = keras.Model(inputs, outputs), hvd.DistributedOptimizer(optimizer)
        else:
            model = keras.Model(inputs, outputs)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer=optimizer, loss=loss)
    return model, ds


def custom_loop(keras, strategy, model, ds):
    """Returns `fit(steps_per_epoch, epochs, callbacks)` for raw Keras 3 under `strategy`, without `fit`."""
    import tensorflow as tf

    strategy = strategy or tf.distribute.get_strategy()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    iterator = iter(strategy.experimental_distribute_dataset(ds))

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            per_example = loss_fn(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=ARGS.global_batch_size)
        gradients = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply(gradients, model.trainable_variables)
        return loss

    @tf.function
    def train_step():
        x, y = next(iterator)
        return strategy.reduce("SUM", strategy.run(replica_step, args=(x, y)), axis=None)

    def fit(steps_per_epoch, epochs, callbacks=()):
        for epoch in range(epochs):
            for callback in callbacks:
                callback.on_epoch_begin(epoch)
            for _ in range(steps_per_epoch):
                float(train_step())  # The host sync `fit` does for its logs.
            for callback in callbacks:
                callback.on_epoch_end(epoch)

    return fit


def main():
    keras, strategy = setup()
    model, ds = make_model(keras, strategy, lambda: build(keras))
    fit = custom_loop(keras, strategy, model, ds) if ARGS.system == "keras_loop" else None
    if fit is None:

        def fit(steps_per_epoch, epochs, callbacks=()):
            callbacks = list(callbacks)
            if ARGS.system == "horovod":  # Every rank starts from rank 0's weights, as Horovod's examples do.
                import horovod.tensorflow.keras as hvd

                callbacks.insert(0, hvd.callbacks.BroadcastGlobalVariablesCallback(0))
            model.fit(ds, steps_per_epoch=steps_per_epoch, epochs=epochs, verbose=0, callbacks=callbacks)

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self.start)

    fit(1, 1)
    startup_seconds = time.time() - STARTED_AT
    timer = EpochTimer()
    fit(ARGS.steps, ARGS.epochs, callbacks=[timer])
    step_seconds = [seconds / ARGS.steps for seconds in timer.seconds[1:]]
    if ARGS.system == "jax":
        replicas = ARGS.replicas
    elif ARGS.system == "tf_keras":
        replicas = strategy.num_replicas_in_sync if strategy is not None else 1
    elif ARGS.system == "horovod":
        replicas = HOROVOD_SIZE
    else:
        replicas = model.distribute_strategy.num_replicas_in_sync
    peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kibibytes.
    if not IS_CHIEF:
        with open(f"{ARGS.out}.worker{WORKER_INDEX}", "w") as f:
            json.dump({"peak_rss_bytes": peak_rss_bytes}, f)
        return
    with open(ARGS.out, "w") as f:
        json.dump(
            {
                "startup_seconds": startup_seconds,
                "step_seconds": step_seconds,
                "num_replicas_in_sync": replicas,
                "global_batch_size": ARGS.global_batch_size,
                "peak_rss_bytes": peak_rss_bytes,
            },
            f,
        )


if __name__ == "__main__":
    main()
    sys.stdout.flush()
