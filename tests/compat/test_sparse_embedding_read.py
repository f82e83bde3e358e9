"""An Embedding reads the rows it looks up, not its whole table, in every step (issue 23 item 3).

Keras' `Embedding.call` (TensorFlow backend) is `ops.take(self.embeddings, ids)`: a dense
`ReadVariableOp` of the table, then `GatherV2`. Once the optimizer has applied a sparse
gradient (`ResourceScatterSub`) TensorFlow copies the table on every dense read, so the step
time grows with the table (1M x 64: 24 ms a step against 5 ms at 10K rows on one device). With
the fix the layers of a DistributedModel read rows with `ResourceGather`, as tf.keras 2 did.
The tests look at the traced step, not at the clock: no dense read of the table feeds a gather.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from keras_dist import _compat
from keras_dist._runtime import keras_internals as ki

pytestmark = pytest.mark.compat

ROWS, DIM = 50, 8
FIX = "sparse_embedding_read"


@pytest.fixture(params=["mirrored_1x2_cpu", "one_device"])
def strategy(request):
    if request.param == "one_device":
        return tf.distribute.OneDeviceStrategy("/cpu:0")
    return request.getfixturevalue(request.param)


def _data(num_examples=32, seed=0):
    rs = np.random.RandomState(seed)
    ids = rs.randint(-3, ROWS, (num_examples, 4)).astype("int32")  # Negative ids too: Keras wraps them.
    return ids, rs.rand(num_examples, 1).astype("float32")


def _functional(cls, mask_zero=False, **kwargs):
    inputs = keras.Input((4,), dtype="int32")
    embedded = keras.layers.Embedding(ROWS, DIM, mask_zero=mask_zero)(inputs)
    pooled = keras.layers.GlobalAveragePooling1D()(embedded)  # Uses the mask when there is one.
    return cls(inputs, keras.layers.Dense(1)(pooled), **kwargs)


def _fit(model, optimizer="sgd", epochs=2):
    model.compile(
        optimizer=keras.optimizers.SGD(0.1) if optimizer == "sgd" else keras.optimizers.Adam(0.01), loss="mse"
    )
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    return model


def _table_gathers(model):
    """`(op type, type of the op feeding its params)` for every gather in the traced train step, nested functions too."""
    found = []
    for function in ki.tf_functions_behind(model.train_function):
        for concrete in function._list_all_concrete_functions():
            graph_def = concrete.graph.as_graph_def()
            for nodes in [graph_def.node, *(f.node_def for f in graph_def.library.function)]:
                op_of = {node.name: node.op for node in nodes}
                for node in nodes:
                    if node.op in ("GatherV2", "ResourceGather"):
                        found.append((node.op, op_of.get(node.input[0].split(":")[0], "argument")))
    return found


def test_without_fix_the_step_gathers_from_a_dense_read_of_the_table(strategy):
    keras.utils.set_random_seed(0)
    with _compat.disabled(FIX):
        model = _fit(_functional(keras_dist.DistributedModel, strategy=strategy))
        gathers = _table_gathers(model)
    assert ("GatherV2", "ReadVariableOp") in gathers, gathers
    assert not [g for g in gathers if g[0] == "ResourceGather"], gathers


def test_with_fix_the_step_reads_only_the_rows(strategy):
    keras.utils.set_random_seed(0)
    model = _fit(_functional(keras_dist.DistributedModel, strategy=strategy))
    gathers = _table_gathers(model)
    assert ("GatherV2", "ReadVariableOp") not in gathers, gathers
    resource_gathers = [g for g in gathers if g[0] == "ResourceGather"]
    assert len(resource_gathers) >= strategy.num_replicas_in_sync, gathers  # Each replica reads its own copy.


def _weights_after_fit(strategy, *, disabled, optimizer, mask_zero):
    keras.utils.set_random_seed(3)
    with _compat.disabled(*disabled):
        if strategy is None:
            model = _functional(keras.Model, mask_zero=mask_zero)
        else:
            model = _functional(keras_dist.DistributedModel, mask_zero=mask_zero, strategy=strategy)
        initial = model.get_weights()
        return initial, _fit(model, optimizer).get_weights()


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("mask_zero", [False, True], ids=["no_mask", "mask_zero"])
def test_with_fix_weights_match_keras_own_lookup(strategy, optimizer, mask_zero):
    initial, with_fix = _weights_after_fit(strategy, disabled=[], optimizer=optimizer, mask_zero=mask_zero)
    assert not np.array_equal(initial[0], with_fix[0])  # The table trained.
    for _, reference in (
        _weights_after_fit(strategy, disabled=[FIX], optimizer=optimizer, mask_zero=mask_zero),
        _weights_after_fit(None, disabled=[], optimizer=optimizer, mask_zero=mask_zero),  # Plain keras.Model.
    ):
        assert len(with_fix) == len(reference)
        for got, expected in zip(with_fix, reference, strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def _embedding_of(model):
    return next(layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.Embedding))


def test_with_fix_gradient_is_indexed_slices_on_each_replica(strategy):
    model = _functional(keras_dist.DistributedModel, strategy=strategy)
    _fit(model, epochs=1)
    layer = _embedding_of(model)
    ids = tf.constant(_data(8)[0])

    @tf.function(autograph=False)
    def gradient_types():
        def replica_step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(ids))
            gradient = tape.gradient(loss, layer.embeddings.value)
            assert isinstance(gradient, tf.IndexedSlices), type(gradient)
            return tf.reduce_sum(gradient.values)

        return strategy.run(replica_step)

    gradient_types()


def test_with_fix_a_subclassed_model_and_a_sequential_build_and_train(mirrored_1x2_cpu):
    class Recommender(keras_dist.DistributedModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.embedding = keras.layers.Embedding(ROWS, DIM)
            self.head = keras.layers.Dense(1)

        def call(self, ids):
            return self.head(keras.ops.mean(self.embedding(ids), axis=1))

    sequential = keras_dist.distribute(
        keras.Sequential([keras.layers.Embedding(ROWS, DIM), keras.layers.Flatten(), keras.layers.Dense(1)]),
        strategy=mirrored_1x2_cpu,
    )
    for model in (Recommender(strategy=mirrored_1x2_cpu), sequential):
        _fit(model)
        assert ("GatherV2", "ReadVariableOp") not in _table_gathers(model)
        assert np.isfinite(model.predict(_data(5)[0], verbose=0)).all()


def test_with_fix_mixed_float16_matches_keras(mirrored_1x2_cpu):
    x = _data(8)[0]
    try:
        keras.mixed_precision.set_global_policy("mixed_float16")
        weights, outputs = [], []
        for disabled in ([], [FIX]):
            keras.utils.set_random_seed(5)
            with _compat.disabled(*disabled):
                model = _fit(_functional(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu))
                outputs.append(_embedding_of(model)(x))
                weights.append(model.get_weights())
                gathers = _table_gathers(model)
                assert (("GatherV2", "ReadVariableOp") in gathers) == bool(disabled), gathers
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert outputs[0].dtype == outputs[1].dtype == tf.float16
    np.testing.assert_array_equal(outputs[0], outputs[1])
    assert weights[0][0].dtype == np.float32
    for got, expected in zip(*weights, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_with_fix_other_lookups_run_keras_own_call(strategy):
    """Ragged ids, a LoRA table and `stateless_call` take Keras' path; their values are Keras'."""
    model = _fit(_functional(keras_dist.DistributedModel, strategy=strategy), epochs=1)
    layer = _embedding_of(model)
    table = keras.ops.convert_to_numpy(layer.embeddings)
    ragged = tf.ragged.constant([[1, 2, 3], [4]])
    np.testing.assert_array_equal(layer(ragged).flat_values, table[[1, 2, 3, 4]])
    other = np.ones_like(table)
    outputs, _ = layer.stateless_call([other], [], tf.constant([[1, -1]]))
    np.testing.assert_array_equal(outputs, other[[1, -1]][None])
    layer.enable_lora(2, b_initializer="ones")
    with_lora = keras.ops.convert_to_numpy(layer.embeddings)
    assert not np.allclose(with_lora, table)
    np.testing.assert_allclose(layer(tf.constant([[1, 2]])), with_lora[[1, 2]][None], rtol=1e-6)
