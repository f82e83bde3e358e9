"""Sparse gradients (`tf.IndexedSlices`) reach the optimizer with the rows plain Keras has on one device.

Keras 3's Adam, AdamW, RMSprop and Adagrad apply a sparse gradient row by row
(each row squared, then the rows added into the table's slots), and
`clipnorm` takes the norm of the rows, so the update depends on the rows
themselves, not only on their sum. One device has one row per entry of the
lookup's index tensor: a token id seen twice in a batch gives two rows, a
position embedding looked up with `ops.arange` one row per position summed
over the batch. The reference here is plain Keras on one device, as users run
it: token rows are each replica's own rows concatenated, a position
embedding's rows (the same indices on every replica) are the replicas' rows
summed position by position.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import keras_dist
from keras_dist.collectives import _all_reduce
from keras_dist.testing import max_weight_difference

TOL = 1e-5

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "sgd_momentum_clipnorm": lambda: keras.optimizers.SGD(0.5, momentum=0.9, clipnorm=0.05),
}


def _fit_both(build, optimizer, x, y, strategy, batch_size=8, **kwargs):
    """Plain Keras on one device and keras-dist under `strategy`, same weights and batches: max |dW|."""
    reference = build(keras.Model, OPTIMIZERS[optimizer](), **kwargs)
    model = build(keras_dist.DistributedModel, OPTIMIZERS[optimizer](), strategy=strategy, **kwargs)
    model.set_weights(reference.get_weights())
    for m in (reference, model):
        m.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return max_weight_difference(reference, model)


# --- A position embedding: the same rows on every replica (keras.io's TokenAndPositionEmbedding).


class PositionEmbedding(keras.layers.Layer):
    def __init__(self, length, dim, **kwargs):
        super().__init__(**kwargs)
        self.length = length
        self.embedding = keras.layers.Embedding(
            length, dim, embeddings_initializer=keras.initializers.RandomUniform(seed=3)
        )

    def call(self, x):
        return x + self.embedding(ops.arange(0, self.length))  # (length, dim), broadcast over the batch.


def _position_model(model_class, optimizer, **kwargs):
    inputs = keras.Input((8, 4))
    hidden = keras.layers.Flatten()(PositionEmbedding(8, 4)(inputs))
    outputs = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2))(hidden)
    model = model_class(inputs, outputs, **kwargs)
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _position_data():
    rs = np.random.RandomState(0)
    return rs.rand(37, 8, 4).astype("float32"), rs.rand(37, 1).astype("float32")


@pytest.mark.parametrize("optimizer", ["adam", "rmsprop"])
def test_position_embedding_matches_plain_keras(multi_replica_strategy, optimizer):
    """`arange` rows: one row per position on one device, so the replicas' rows are summed position by position.

    Sent as they were gathered (one row per position and replica), Adam squared the parts: 2.2e-2 off
    on 2 replicas, 3.5e-2 on 3. 37 examples in batches of 8: the last batch (5) is uneven.
    """
    x, y = _position_data()
    assert _fit_both(_position_model, optimizer, x, y, multi_replica_strategy) < TOL


# --- An Embedding with repeated token ids in every batch, and an uneven last batch.


def _token_model(model_class, optimizer, jit_compile="auto", **kwargs):
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(10, 4, embeddings_initializer=keras.initializers.RandomUniform(seed=1))(inputs)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    outputs = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2))(hidden)
    model = model_class(inputs, outputs, **kwargs)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    return model


def _token_data(n=37):
    rs = np.random.RandomState(0)
    x = rs.randint(0, 10, (n, 6)).astype("int32")  # 6 tokens from 10 ids: most ids repeat in every batch.
    return x, (x.mean(1, keepdims=True) / 10 + rs.rand(n, 1) * 0.1).astype("float32")


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_repeated_token_ids_match_plain_keras(multi_replica_strategy, optimizer):
    """Plain Keras squares a repeated id's rows one by one; merged by id, keras-dist was 0.14 off (Adam)."""
    x, y = _token_data()
    assert _fit_both(_token_model, optimizer, x, y, multi_replica_strategy) < TOL


# --- Both kinds in one model, with a last batch of 1 (the other replicas get no example).


def _token_and_position_model(model_class, optimizer, **kwargs):
    inputs = keras.Input((6,), dtype="int32")
    tokens = keras.layers.Embedding(10, 4, embeddings_initializer=keras.initializers.RandomUniform(seed=1))(inputs)
    layer = PositionEmbedding(6, 4)
    hidden = keras.layers.GlobalAveragePooling1D()(layer(tokens))
    outputs = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2))(hidden)
    model = model_class(inputs, outputs, **kwargs)
    model.compile(optimizer=optimizer, loss="mse")
    return model


@pytest.mark.parametrize("optimizer", ["adam", "adagrad"])
def test_token_and_position_embeddings_in_one_model_match_plain_keras(multi_replica_strategy, optimizer):
    """Token rows concatenated and position rows summed in one step; the last batch of 1 leaves replicas empty."""
    x, y = _token_data(33)
    assert _fit_both(_token_and_position_model, optimizer, x, y, multi_replica_strategy) < TOL


# --- keras-dist on one device is plain Keras: nothing merged.


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_one_device_equals_plain_keras(jit_compile):
    x, y = _token_data()
    reference = _token_model(keras.Model, OPTIMIZERS["adam"](), jit_compile=jit_compile)
    model = _token_model(
        keras_dist.DistributedModel, OPTIMIZERS["adam"](), jit_compile=jit_compile, strategy="one_device"
    )
    assert model.jit_compile is jit_compile
    model.set_weights(reference.get_weights())
    for m in (reference, model):
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(reference, model) < TOL


# --- The all-reduce itself: which rows come back, still sparse, with compression, weighting and checks.


def _all_reduce_rows(strategy, rows_of, **kwargs):
    """Runs `all_reduce_gradients` on `[rows_of(replica), ones(2)]` and one extra: replica 0's `(values, indices)`."""
    compression = kwargs.pop("compression", None)
    options = keras_dist.CommunicationOptions(compression=compression)
    # Equal example counts on every replica: weighting by examples divides the sum by the replicas (their mean).
    undo_mean = strategy.num_replicas_in_sync if "num_examples" in kwargs else 1

    @tf.function
    def step():
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            values, indices = rows_of(replica)
            rows = tf.IndexedSlices(values, indices, tf.constant([5, 2], tf.int64))
            (summed, dense_sum), (extra,) = _all_reduce.all_reduce_gradients(
                [rows, tf.ones([2])], options, extras=[tf.constant([3.0])], **kwargs
            )
            return summed.values, summed.indices, dense_sum, extra

        return strategy.run(replica_fn)

    results = [strategy.experimental_local_results(t) for t in step()]
    for per_replica in results:  # Every replica decides alike.
        for value in per_replica[1:]:
            np.testing.assert_array_equal(value.numpy(), per_replica[0].numpy())
    values, indices, dense_sum, extra = (r[0] for r in results)
    assert indices.dtype == tf.int64
    np.testing.assert_allclose(dense_sum.numpy() * undo_mean, [strategy.num_replicas_in_sync] * 2)
    np.testing.assert_allclose(extra.numpy(), [3.0 * strategy.num_replicas_in_sync])
    return (values.numpy() * undo_mean).tolist(), indices.numpy().tolist()


VARIANTS = [
    {},
    {"num_examples": tf.constant(4)},
    {"compression": "fp16"},
    {"names": ["table", "dense"]},
]
VARIANT_IDS = ["plain", "by_examples", "fp16", "structure_check"]


@pytest.mark.parametrize("kwargs", VARIANTS, ids=VARIANT_IDS)
def test_identical_indices_on_every_replica_are_summed_position_by_position(mirrored_1x2_cpu, kwargs):
    """A position embedding's rows: the same 3 indices (a repeat included) on both replicas give 3 rows."""

    def rows_of(replica):
        first = 1.0 + tf.cast(replica, tf.float32)
        return tf.stack([tf.fill([2], first), tf.fill([2], 10.0), tf.fill([2], 100.0)]), tf.constant(
            [3, 1, 3], tf.int64
        )

    values, indices = _all_reduce_rows(mirrored_1x2_cpu, rows_of, **kwargs)
    assert indices == [3, 1, 3]  # Not merged by index: one device has these three rows.
    assert values == [[3.0, 3.0], [20.0, 20.0], [200.0, 200.0]]


@pytest.mark.parametrize("kwargs", VARIANTS, ids=VARIANT_IDS)
def test_different_indices_are_kept_as_gathered(mirrored_1x2_cpu, kwargs):
    """Token rows: different ids on each replica (a repeated one included) are one device's rows, concatenated."""

    def rows_of(replica):
        values = tf.stack([tf.fill([2], 1.0), tf.fill([2], 2.0)]) * (1.0 + tf.cast(replica, tf.float32))
        return values, tf.where(tf.equal(replica, 0), tf.constant([3, 3], tf.int64), tf.constant([3, 4], tf.int64))

    values, indices = _all_reduce_rows(mirrored_1x2_cpu, rows_of, **kwargs)
    assert sorted(zip(indices, values)) == sorted([(3, [1.0, 1.0]), (3, [2.0, 2.0]), (3, [2.0, 2.0]), (4, [4.0, 4.0])])


def test_uneven_and_empty_replicas_are_kept_as_gathered(mirrored_1x3_cpu):
    """Replica 2 sends no row, replica 1 one row: the rows are concatenated, the empty replica adds none."""

    def rows_of(replica):
        n = tf.gather(tf.constant([2, 1, 0]), replica)
        return tf.ones([n, 2]) * (1.0 + tf.cast(replica, tf.float32)), tf.fill([n], tf.constant(3, tf.int64))

    values, indices = _all_reduce_rows(mirrored_1x3_cpu, rows_of)
    assert indices == [3, 3, 3] and sorted(values) == [[1.0, 1.0], [1.0, 1.0], [2.0, 2.0]]


def test_every_replica_empty_gives_no_rows(mirrored_1x2_cpu):
    values, indices = _all_reduce_rows(mirrored_1x2_cpu, lambda replica: (tf.zeros([0, 2]), tf.zeros([0], tf.int64)))
    assert values == [] and indices == []


def test_equal_lengths_with_different_indices_are_kept_as_gathered(mirrored_1x3_cpu):
    def rows_of(replica):
        return tf.ones([2, 2]), tf.stack([tf.constant(1, tf.int64), tf.cast(replica, tf.int64)])

    values, indices = _all_reduce_rows(mirrored_1x3_cpu, rows_of)
    assert sorted(indices) == [0, 1, 1, 1, 1, 2] and values == [[1.0, 1.0]] * 6
