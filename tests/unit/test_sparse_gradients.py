"""Sparse gradients (`tf.IndexedSlices`) reach the optimizer with one row per index, at every replica count.

An `Embedding`'s gradient holds one row per lookup, and the gradient all-reduce
concatenates the replicas' rows. Keras 3's Adam, AdamW, RMSprop and Adagrad
square each row as it comes, and `clipnorm` takes the norm of the rows, so
without merging the update depends on how a row's gradient was split: a
position embedding (the same rows on every replica) moved x1.414 too far, and a
max pool whose ties break differently in a batch of 8 than of 16 gave other
numbers on 2 replicas than on 1. The references here are one device with the
table's gradient as it is mathematically: rows already unique (a position
embedding), or the gradient converted to a dense tensor before `apply`.
"""

import types

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


def _dense_gradients_apply(optimizer):
    """One device, the reference: `apply` gets each sparse gradient as the dense tensor it stands for."""
    keras_apply = type(optimizer).apply

    def apply(self, grads, trainable_variables=None):
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        return keras_apply(self, grads, trainable_variables)

    optimizer.apply = types.MethodType(apply, optimizer)
    return optimizer


# --- A position embedding: the same rows on every replica (keras.io's TokenAndPositionEmbedding).


class PositionEmbedding(keras.layers.Layer):
    def __init__(self, length, dim, **kwargs):
        super().__init__(**kwargs)
        self.length = length
        self.embedding = keras.layers.Embedding(length, dim, embeddings_initializer=keras.initializers.RandomUniform(seed=3))

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
def test_position_embedding_matches_one_device(multi_replica_strategy, optimizer):
    """Rows looked up with `arange` are unique on one device and repeat once per replica before the merge."""
    x, y = _position_data()
    reference = _position_model(keras.Model, OPTIMIZERS[optimizer]())
    model = _position_model(keras_dist.DistributedModel, OPTIMIZERS[optimizer](), strategy=multi_replica_strategy)
    model.set_weights(reference.get_weights())
    for m in (reference, model):  # 37 examples in batches of 8: the last batch is uneven.
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(reference, model) < TOL


# --- An Embedding with repeated token ids in every batch, and an uneven last batch.


def _token_model(model_class, optimizer, jit_compile="auto", **kwargs):
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(10, 4, embeddings_initializer=keras.initializers.RandomUniform(seed=1))(inputs)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    outputs = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2))(hidden)
    model = model_class(inputs, outputs, **kwargs)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    return model


def _token_data():
    rs = np.random.RandomState(0)
    x = rs.randint(0, 10, (37, 6)).astype("int32")  # 6 tokens from 10 ids: most ids repeat in every batch.
    return x, (x.mean(1, keepdims=True) / 10 + rs.rand(37, 1) * 0.1).astype("float32")


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_repeated_token_ids_match_one_device_with_the_tables_gradient(mirrored_1x2_cpu, optimizer):
    x, y = _token_data()
    reference = _token_model(keras.Model, _dense_gradients_apply(OPTIMIZERS[optimizer]()))
    model = _token_model(keras_dist.DistributedModel, OPTIMIZERS[optimizer](), strategy=mirrored_1x2_cpu)
    model.set_weights(reference.get_weights())
    for m in (reference, model):
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(reference, model) < TOL


def test_repeated_token_ids_on_three_replicas_and_on_one_device(mirrored_1x3_cpu):
    """The same numbers at 3 replicas (batches of 8 split 3/3/2, last 2/2/1) and on keras-dist's one device."""
    x, y = _token_data()
    reference = _token_model(keras.Model, _dense_gradients_apply(OPTIMIZERS["adam"]()))
    three = _token_model(keras_dist.DistributedModel, OPTIMIZERS["adam"](), strategy=mirrored_1x3_cpu)
    one = _token_model(keras_dist.DistributedModel, OPTIMIZERS["adam"](), strategy="one_device")
    for m in (three, one):
        m.set_weights(reference.get_weights())
    for m in (reference, three, one):
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(reference, three) < TOL
    assert max_weight_difference(reference, one) < TOL


def test_repeated_token_ids_on_one_device_with_xla():
    """`compile(jit_compile=True)` on one device: Keras compiles the whole step, the merge of the rows included."""
    x, y = _token_data()
    reference = _token_model(keras.Model, _dense_gradients_apply(OPTIMIZERS["adam"]()))
    model = _token_model(keras_dist.DistributedModel, OPTIMIZERS["adam"](), jit_compile=True, strategy="one_device")
    assert model.jit_compile is True
    model.set_weights(reference.get_weights())
    for m in (reference, model):
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(reference, model) < TOL


# --- r16's pattern: a max pool over zero padding has exact ties, broken differently by batch size.


def _padded_text():
    rs = np.random.RandomState(0)
    x = np.zeros((96, 40), "int64")
    for i in range(len(x)):
        n = rs.randint(8, 30)
        x[i, :n] = rs.randint(2, 50, n)  # Real tokens, then padding (id 0).
    y = (np.sum((x >= 2) & (x < 20), 1) > np.sum(x >= 30, 1)).astype("float32")
    return x, y


def _text_model(model_class, optimizer="adam", **kwargs):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((None,), dtype="int64")
    hidden = keras.layers.Embedding(50, 16)(inputs)
    hidden = keras.layers.Conv1D(16, 5, activation="relu", strides=2)(hidden)
    hidden = keras.layers.Conv1D(16, 5, activation="relu", strides=2)(hidden)
    hidden = keras.layers.GlobalMaxPooling1D()(hidden)
    model = model_class(inputs, keras.layers.Dense(1, activation="sigmoid")(hidden), **kwargs)
    model.compile(loss="binary_crossentropy", optimizer=optimizer)
    return model


def test_padded_max_pool_text_model_on_one_and_two_replicas(mirrored_1x2_cpu):
    """keras-dist on 1 replica and on 2, and one device with the table's gradient: one set of numbers."""
    x, y = _padded_text()
    reference = _text_model(keras.Model, _dense_gradients_apply(keras.optimizers.Adam()))
    one = _text_model(keras_dist.DistributedModel, strategy="one_device")
    two = _text_model(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu)
    for m in (one, two):
        m.set_weights(reference.get_weights())
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat(4)  # 24 Adam steps.
    for m in (reference, one, two):
        m.fit(dataset, verbose=0)
    assert max_weight_difference(one, two) < TOL
    assert max_weight_difference(reference, two) < TOL


# --- The all-reduce itself: rows merged, still sparse, with and without compression and example weighting.


@pytest.mark.parametrize(
    "compression, weighted", [(None, False), (None, True), ("fp16", False)], ids=["plain", "by_examples", "fp16"]
)
def test_all_reduce_returns_one_row_per_index_and_stays_sparse(mirrored_1x2_cpu, compression, weighted):
    options = keras_dist.CommunicationOptions(compression=compression)

    @tf.function
    def step():
        def replica_fn():
            replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
            rows = tf.IndexedSlices(
                tf.stack([tf.fill([2], 1.0 + replica), tf.fill([2], 10.0), tf.fill([2], 100.0)]),
                tf.constant([3, 1, 3], tf.int64),
                tf.constant([5, 2], tf.int64),
            )
            dense = tf.ones([2])
            (summed, dense_sum), _ = _all_reduce.all_reduce_gradients(
                [rows, dense], options, num_examples=tf.constant(4) if weighted else None
            )
            return summed.values, summed.indices, dense_sum

        return mirrored_1x2_cpu.run(replica_fn)

    values, indices, dense_sum = (mirrored_1x2_cpu.experimental_local_results(t) for t in step())
    for v, i, d in zip(values, indices, dense_sum):
        # Row 3: (1 + 100) on replica 0 and (2 + 100) on replica 1; row 1: 10 on each.
        assert i.dtype == tf.int64 and sorted(i.numpy().tolist()) == [1, 3]
        got = dict(zip(i.numpy().tolist(), v.numpy().tolist()))
        assert got == {3: [203.0, 203.0], 1: [20.0, 20.0]}
        np.testing.assert_allclose(d.numpy(), [2.0, 2.0])


def test_merge_sparse_rows_keeps_dense_tensors_and_none():
    rows = tf.IndexedSlices(tf.constant([[1.0], [2.0], [4.0]]), tf.constant([2, 0, 2]), tf.constant([3, 1]))
    merged = _all_reduce.merge_sparse_rows(rows)
    assert isinstance(merged, tf.IndexedSlices)
    assert merged.indices.numpy().tolist() == [2, 0] and merged.values.numpy().tolist() == [[5.0], [2.0]]
    assert merged.dense_shape.numpy().tolist() == [3, 1]
    np.testing.assert_array_equal(tf.convert_to_tensor(merged), tf.convert_to_tensor(rows))
    dense = tf.ones([2])
    assert _all_reduce.merge_sparse_rows(dense) is dense and _all_reduce.merge_sparse_rows(None) is None
