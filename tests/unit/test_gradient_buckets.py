"""The gradient all-reduce's windows: last layers first, large gradients in parts, side values in the last window.

With `bytes_per_pack` > 0, keras-dist reads the dense gradients as one stream, the last variable's
first, cuts it into windows of exactly that many bytes (a gradient larger than a window spans
several) and sums each window with one collective, in stream order; the side values (example
counts, structure flags, metric state) ride in the last window (`keras_dist/collectives/_windows.py`,
issue 23 item 1). Windows change which values travel together, never the sums: a run with many small
windows equals a run with one pack, bit for bit, on 2 replicas.
"""

import random

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from keras_dist.collectives import _all_reduce, _windows


def test_the_windows_are_launched_last_variable_first_with_the_side_values_in_the_last(mirrored_1x2_cpu_collective):
    # What TensorFlow launches: the collectives in the order the graph creates them (the order they are
    # launched in, TensorFlow orders the collectives of a step) and each one's size in floats.
    strategy = mirrored_1x2_cpu_collective
    sizes = [7, 8, 9]  # a, b, c in variable order; the side values are 6 (extras), 1 (count), 6 (flags)

    def step():
        gradients = [tf.fill([n], float(i + 1)) for i, n in enumerate(sizes)]
        return _all_reduce.all_reduce_gradients(
            gradients,
            keras_dist.CommunicationOptions(bytes_per_pack=36),  # 9 floats a window
            names=["a", "b", "c"],
            num_examples=2,
            extras=[tf.ones([6])],
        )

    function = tf.function(lambda: strategy.run(step))
    graph = function.get_concrete_function().graph
    packs = [
        op.inputs[0].shape.num_elements()
        for op in graph.get_operations()
        if op.type == "CollectiveReduceV2" and op.device.endswith("CPU:0")
    ]
    # c (9); b (8) and a's first element (1); a's other 6 with the 13 side values. Before the windows,
    # TensorFlow's packing sent [9, 8, 7] and then the side values in a collective of their own.
    assert packs == [9, 9, 6 + 13], packs
    summed, extras = function()
    for i, value in enumerate(summed):  # in variable order; each replica's mean counted by its examples
        for local in strategy.experimental_local_results(value):
            np.testing.assert_array_equal(local.numpy(), np.full([sizes[i]], float(i + 1)))
    np.testing.assert_array_equal(strategy.experimental_local_results(extras[0])[0].numpy(), np.full([6], 2.0))


def test_the_plan_cuts_a_large_value_into_windows_and_keeps_the_side_values_whole():
    f32 = tf.float32
    # 10 MiB of float32 in 4 MiB windows: 4 MiB, 4 MiB, then the last 2 MiB with the side values.
    mib = 2**20 // 4
    assert _windows.plan_windows([10 * mib], [f32], 4 * 2**20, side_sizes=[3]) == [
        [("value", 0, 0, 4 * mib)],
        [("value", 0, 4 * mib, 8 * mib)],
        [("value", 0, 8 * mib, 10 * mib), ("side", 0, 0, 3)],
    ]
    # A full last window still takes the side values (one collective fewer), larger than the window.
    assert _windows.plan_windows([4], [f32], 16, side_sizes=[2]) == [[("value", 0, 0, 4), ("side", 0, 0, 2)]]
    # A change of dtype closes the window; float16 side values are not possible, float32 ones go last.
    assert _windows.plan_windows([2, 3], [f32, tf.float16], 64, side_sizes=[1]) == [
        [("value", 1, 0, 3)],
        [("value", 0, 0, 2), ("side", 0, 0, 1)],
    ]
    assert _windows.plan_windows([2], [tf.float16], 64, side_sizes=[1]) == [[("value", 0, 0, 2)], [("side", 0, 0, 1)]]
    assert _windows.plan_windows([], [], 64, side_sizes=[5]) == [[("side", 0, 0, 5)]]
    assert _windows.plan_windows([0, 2], [f32, f32], 64) == [[("value", 1, 0, 2)]]  # no elements, no piece
    # An empty float32 value last in the stream must not let the side values join a float16 window.
    assert _windows.plan_windows([0, 2], [f32, tf.float16], 64, side_sizes=[1]) == [
        [("value", 1, 0, 2)],
        [("side", 0, 0, 1)],
    ]
    with pytest.raises(ValueError, match="bytes_per_pack"):
        _windows.plan_windows([1], [f32], 0)


def test_a_gradient_without_elements_is_returned_as_it_is(mirrored_1x2_cpu_collective):
    strategy = mirrored_1x2_cpu_collective
    options = keras_dist.CommunicationOptions(bytes_per_pack=8)

    def step():
        return _all_reduce.all_reduce_gradients([tf.zeros([0, 3]), tf.ones([5])], options)[0]

    empty, full = tf.function(lambda: strategy.run(step))()
    assert strategy.experimental_local_results(empty)[0].shape == (0, 3)
    np.testing.assert_array_equal(strategy.experimental_local_results(full)[1].numpy(), np.full([5], 2.0))


def test_every_element_travels_once_and_no_window_exceeds_its_size():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([0, 1, 3, 64, 1000, 5000]) for _ in range(rng.randint(1, 6))]
        dtypes = [rng.choice([tf.float32, tf.float32, tf.bfloat16]) for _ in sizes]
        window_bytes = rng.choice([4, 16, 100, 4096, 10**6])
        windows = _windows.plan_windows(sizes, dtypes, window_bytes, side_sizes=[2])
        seen = {i: [] for i in range(len(sizes))}
        for window in windows:
            assert window, windows
            values = [p for p in window if p[0] == "value"]
            assert len({dtypes[i] for _, i, _, _ in values}) <= 1
            if any(p[0] == "side" for p in window):  # float32 side values share a window with float32 only
                assert {dtypes[i] for _, i, _, _ in values} <= {tf.float32}, (sizes, dtypes, windows)
            if values and not any(p[0] == "side" for p in window):
                assert sum((b - a) * dtypes[i].size for _, i, a, b in values) <= max(window_bytes, 4)
            for _, i, a, b in values:
                seen[i].append((a, b))
        for i, n in enumerate(sizes):  # in order, contiguous, complete
            assert [a for a, _ in seen[i]] == sorted(a for a, _ in seen[i])
            assert sum(b - a for a, b in seen[i]) == n and all(b > a for a, b in seen[i])
        # Stream order: the last value's elements travel first.
        order = [i for w in windows for kind, i, _, _ in w if kind == "value"]
        assert order == sorted(order, reverse=True)
        assert [p for p in windows[-1] if p[0] == "side"] == [("side", 0, 0, 2)]


def _trained_weights(strategy, bytes_per_pack, compression=None, embedding=False):
    keras.utils.set_random_seed(0)
    rs = np.random.RandomState(1)
    if embedding:  # token ids: the table's gradient is rows (all-gathered, outside the windows)
        inputs = keras.Input((5,), dtype="int32")
        features = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 16)(inputs))
        x = rs.randint(0, 50, (70, 5)).astype("int32")
    else:
        inputs = keras.Input((20,))
        features = inputs
        x = rs.rand(70, 20).astype("float32")
    hidden = keras.layers.Dense(64, activation="relu")(keras.layers.Dense(64, activation="relu")(features))
    model = keras_dist.DistributedModel(
        inputs,
        keras.layers.Dense(3)(hidden),
        strategy=strategy,
        communication=keras_dist.CommunicationOptions(bytes_per_pack=bytes_per_pack, compression=compression),
    )
    model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    y = rs.randint(0, 3, 70)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return [w.numpy() for w in model.weights]


@pytest.mark.parametrize(
    "compression, embedding",
    [(None, False), ("fp16", False), (None, True)],
    ids=["float32", "fp16-compressed", "with-embedding-rows"],
)
def test_small_windows_give_the_same_weights_bit_for_bit_as_one_pack(
    mirrored_1x2_cpu_collective, compression, embedding
):
    one_pack = _trained_weights(mirrored_1x2_cpu_collective, 0, compression, embedding)
    # 1 KB: the 64x64 kernel spans 16 windows, most values share a window with a neighbour's part.
    small_windows = _trained_weights(mirrored_1x2_cpu_collective, 1024, compression, embedding)
    for a, b in zip(one_pack, small_windows):
        np.testing.assert_array_equal(a, b)


def _collectives_in_train_step(model):
    """CollectiveReduceV2 ops of the first replica in the traced one-step graph (nested functions included)."""
    from keras_dist.callbacks._monitors import _tf_functions_in

    def count(graph):
        own = sum(op.type == "CollectiveReduceV2" and op.device.endswith("CPU:0") for op in graph.get_operations())
        return own + sum(count(f.graph) for f in graph._functions.values() if hasattr(f, "graph"))

    return max(
        count(concrete.graph)
        for f in _tf_functions_in(model.train_function)
        if "one_step_on_data" in getattr(f, "__name__", "")
        for concrete in f._list_all_concrete_functions()
    )


def _dense_on_sequences(strategy, bytes_per_pack):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 8))  # Dense on a 3-D input: its kernel's gradient is traced as (None, 32)
    features = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(32, activation="relu")(inputs))
    model = keras_dist.DistributedModel(
        inputs,
        keras.layers.Dense(3)(features),
        strategy=strategy,
        communication=keras_dist.CommunicationOptions(bytes_per_pack=bytes_per_pack),
    )
    model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rs = np.random.RandomState(1)
    x, y = rs.rand(42, 4, 8).astype("float32"), rs.randint(0, 3, 42)  # a partial last batch: no static batch size
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return model


def test_a_dense_layer_on_sequences_still_gets_windows(mirrored_1x2_cpu_collective):
    # The probe's transformer: one gradient of unknown static shape sent the whole step through one
    # collective (TensorFlow: "not packing values due to the unknown or inconsistent shape").
    windows = _dense_on_sequences(mirrored_1x2_cpu_collective, 256)  # 387 floats in 64-float windows
    one_pack = _dense_on_sequences(mirrored_1x2_cpu_collective, 0)
    assert _collectives_in_train_step(windows) == 7, _collectives_in_train_step(windows)
    assert _collectives_in_train_step(one_pack) == 1
    for a, b in zip(windows.weights, one_pack.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
