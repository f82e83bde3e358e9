"""CommunicationOptions and the gradient all-reduce: validation, compression, sparse and None gradients."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from keras_dist.collectives import _all_reduce
from keras_dist.testing import max_weight_difference


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"implementation": "mpi"}, "implementation` must be one of"),
        ({"bytes_per_pack": -1}, "bytes_per_pack` must be an integer number of bytes"),
        ({"timeout_seconds": 0}, "timeout_seconds` must be a number of seconds > 0"),
        ({"compression": "int8"}, "compression` must be one of"),
    ],
)
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        keras_dist.CommunicationOptions(**kwargs)


def test_tensorflow_options_and_dicts_are_accepted():
    tf_options = tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=1024,
        timeout_seconds=5.0,
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
    )
    options = keras_dist.CommunicationOptions.from_value(tf_options)
    assert options == keras_dist.CommunicationOptions("ring", 1024, 5.0)
    assert keras_dist.CommunicationOptions.from_value({"compression": "bf16"}).compressed_dtype == tf.bfloat16
    assert options.to_tensorflow().bytes_per_pack == 1024
    with pytest.raises(TypeError, match="`communication` must be"):
        keras_dist.CommunicationOptions.from_value("ring")


def test_nccl_without_gpus_is_refused_at_construction(mirrored_1x2_cpu):
    with pytest.raises(ValueError, match="needs GPUs.*Fix: use implementation='ring'"):
        keras_dist.DistributedModel(strategy=mirrored_1x2_cpu, communication={"implementation": "nccl"})


def test_plan_shows_the_options(mirrored_1x2_cpu):
    plan = keras_dist.strategy.describe(
        mirrored_1x2_cpu, communication=keras_dist.CommunicationOptions(compression="fp16").describe()
    )
    assert "communication:        AUTO, pack auto, no timeout, fp16 compression" in str(plan)


def test_plan_shows_what_auto_packing_resolves_to(mirrored_1x2_cpu, monkeypatch, capsys):
    """The plan printed at construction gives "auto"'s value on its strategy (8 MiB between CPU workers: mw tests)."""
    options = keras_dist.CommunicationOptions(bytes_per_pack="auto")
    assert options.describe(mirrored_1x2_cpu) == "AUTO, pack auto (one pack), no timeout, no compression"
    explicit = keras_dist.CommunicationOptions(bytes_per_pack=4 * 2**20)
    assert (
        explicit.describe(mirrored_1x2_cpu)
        == explicit.describe()
        == "AUTO, pack 4194304 bytes, no timeout, no compression"
    )
    monkeypatch.delenv("KERAS_DIST_QUIET", raising=False)
    inputs = keras.Input((2,))
    keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy=mirrored_1x2_cpu)
    assert "communication:        AUTO, pack auto (one pack), no timeout, no compression" in capsys.readouterr().out


@pytest.mark.parametrize("compression, expected", [(None, 2 + 2**-10), ("fp16", 2.0), ("bf16", 2.0)])
def test_compression_sums_in_the_compressed_dtype(mirrored_1x2_cpu, compression, expected):
    """1 + 2**-11 on each replica: float32 keeps it, fp16 (11 significant bits) and bf16 round it to 1."""
    options = keras_dist.CommunicationOptions(compression=compression)

    @tf.function
    def step():
        def replica_fn():
            return _all_reduce.all_reduce_gradients([tf.constant([1 + 2**-11], tf.float32), None], options)[0]

        return mirrored_1x2_cpu.run(replica_fn)

    reduced, missing = step()
    assert missing is None
    values = mirrored_1x2_cpu.experimental_local_results(reduced)
    assert all(v.dtype == tf.float32 and float(v[0]) == expected for v in values)


def _classifier(model_class, communication=None, **kwargs):
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(50, 4, embeddings_initializer=keras.initializers.RandomUniform(seed=1))(inputs)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    unused = keras.layers.Dense(
        3, kernel_initializer="zeros", name="unused"
    )  # built, trainable, never in the graph: a None gradient
    unused.build((None, 4))
    outputs = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2))(hidden)
    extra = {} if communication is None else {"communication": communication}
    model = model_class(inputs, outputs, **extra, **kwargs)
    model.unused = unused
    model.compile(optimizer=keras.optimizers.SGD(0.5, momentum=0.9), loss="mse")
    return model


def _fit(model):
    rs = np.random.RandomState(0)
    x = rs.randint(0, 50, (37, 6)).astype("int32")
    model.fit(x, (x.mean(1, keepdims=True) / 50).astype("float32"), batch_size=8, epochs=3, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("compression, tolerance", [(None, 1e-5), ("bf16", 2e-2), ("fp16", 2e-3)])
def test_sparse_gradients_and_compression_against_single_device(mirrored_1x2_cpu, compression, tolerance):
    """Embedding gradients arrive as tf.IndexedSlices (all-gathered, not compressed); the rest is cast."""
    reference = _fit(_classifier(keras.Model))
    model = _fit(_classifier(keras_dist.DistributedModel, {"compression": compression}, strategy=mirrored_1x2_cpu))
    difference = max_weight_difference(reference, model)
    assert difference < tolerance, difference


def test_distribute_passes_options_to_the_wrapped_model(mirrored_1x2_cpu):
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model = keras_dist.distribute(
        plain, strategy=mirrored_1x2_cpu, communication={"compression": "bf16"}, auto_shard_policy="data"
    )
    assert model.communication.compression == "bf16" and model.auto_shard_policy == "data"
    again = keras_dist.distribute(model, strategy=mirrored_1x2_cpu, communication={"implementation": "ring"})
    assert again is model and model.communication.implementation == "ring" and model.auto_shard_policy == "auto"


def test_auto_packing_is_one_pack_on_one_machine(mirrored_1x2_cpu):
    """`bytes_per_pack="auto"` resolves to 0 (TensorFlow's one pack) except between CPU workers (tested there)."""
    options = keras_dist.CommunicationOptions()
    assert options.bytes_per_pack == "auto" and options.describe().startswith("AUTO, pack auto,")
    assert options.resolved(mirrored_1x2_cpu).bytes_per_pack == 0
    assert options.resolved(tf.distribute.get_strategy()).bytes_per_pack == 0
    assert options.to_tensorflow().bytes_per_pack == 0
    explicit = keras_dist.CommunicationOptions(bytes_per_pack=0)
    assert explicit.resolved(mirrored_1x2_cpu) is explicit and "one pack" in explicit.describe()
    with pytest.raises(ValueError, match="or 'auto'"):
        keras_dist.CommunicationOptions(bytes_per_pack=True)
