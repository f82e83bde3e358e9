"""The gradient all-reduce's packs: last layers first, side values last, the same numbers (issue 23 item 1).

TensorFlow's collective all-reduce reverses the values of one `all_reduce` call before packing
them (`bytes_per_pack`) and launches the packs in that order; the backward pass computes the last
layers' gradients first. So keras-dist hands TensorFlow the side values (example counts, structure
flags, metric state) first and the gradients in variable order: the first pack holds the last
layers' gradients and waits only for them, and the side values travel last. Packing changes which values travel together, never the sums: a run with
many small packs equals a run with one pack, bit for bit, on 2 replicas.
"""

import keras
import numpy as np
import tensorflow as tf

import keras_dist
from keras_dist.collectives import _all_reduce


def test_the_first_pack_holds_the_last_variables_gradients_and_the_side_values_the_last(mirrored_1x2_cpu_collective):
    # What TensorFlow launches, not what keras-dist hands it: the collectives in the order the graph
    # creates them (the order they are launched in), each pack's size. TensorFlow reverses the list it
    # is given before packing, so handing it the gradients last-variable-first (as an earlier version
    # did) put the first layer's gradient and the side values in the first pack.
    strategy = mirrored_1x2_cpu_collective
    sizes = [7, 8, 9]  # a, b, c in variable order; the side values are 6 (extras), 1 (count), 6 (flags)

    def step():
        gradients = [tf.fill([n], float(i + 1)) for i, n in enumerate(sizes)]
        return _all_reduce.all_reduce_gradients(
            gradients,
            keras_dist.CommunicationOptions(bytes_per_pack=1),  # every value in a pack of its own
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
    assert packs[:3] == [9, 8, 7], packs  # the last variable's gradient first, the first variable's third
    assert sorted(packs[3:]) == [1, 6, 6], packs  # the example count, the extras and the flags after them
    summed, extras = function()
    for i, value in enumerate(summed):  # in variable order; each replica's mean counted by its examples
        for local in strategy.experimental_local_results(value):
            np.testing.assert_array_equal(local.numpy(), np.full([sizes[i]], float(i + 1)))
    np.testing.assert_array_equal(strategy.experimental_local_results(extras[0])[0].numpy(), np.full([6], 2.0))


def _trained_weights(strategy, bytes_per_pack):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((20,))
    hidden = keras.layers.Dense(64, activation="relu")(keras.layers.Dense(64, activation="relu")(inputs))
    model = keras_dist.DistributedModel(
        inputs,
        keras.layers.Dense(3)(hidden),
        strategy=strategy,
        communication=keras_dist.CommunicationOptions(bytes_per_pack=bytes_per_pack),
    )
    model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rs = np.random.RandomState(1)
    x, y = rs.rand(70, 20).astype("float32"), rs.randint(0, 3, 70)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return [w.numpy() for w in model.weights]


def test_small_packs_give_the_same_weights_bit_for_bit_as_one_pack(mirrored_1x2_cpu_collective):
    one_pack = _trained_weights(mirrored_1x2_cpu_collective, 0)
    small_packs = _trained_weights(mirrored_1x2_cpu_collective, 1024)  # 1 KB: most tensors in a pack of their own
    for a, b in zip(one_pack, small_packs):
        np.testing.assert_array_equal(a, b)
