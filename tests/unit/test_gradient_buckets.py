"""The gradient all-reduce's packs: reverse variable order, side values last, the same numbers (issue 23 item 1).

TensorFlow packs the values of one `all_reduce` call in list order (`bytes_per_pack`) and
launches the packs in order; the backward pass computes the last layers' gradients first. So
keras-dist hands TensorFlow the gradients in reverse variable order, the side values (example
counts, structure flags, metric state) last: the first pack no longer waits for the first
layer's gradient. Packing changes which values travel together, never the sums: a run with
many small packs equals a run with one pack, bit for bit, on 2 replicas.
"""

import keras
import numpy as np
import tensorflow as tf

import keras_dist
from keras_dist.collectives import _all_reduce


def test_gradients_travel_last_variable_first_and_the_side_values_last(mirrored_1x2_cpu, monkeypatch):
    strategy = mirrored_1x2_cpu
    sent = []
    original = tf.distribute.ReplicaContext.all_reduce

    def recording(self, reduce_op, value, options=None):
        sent.append([tuple(v.shape) for v in tf.nest.flatten(value)])
        return original(self, reduce_op, value, options=options)

    monkeypatch.setattr(tf.distribute.ReplicaContext, "all_reduce", recording)
    shapes = [(3,), (4, 2), (5,)]

    def step():
        gradients = [tf.fill(shape, float(i + 1)) for i, shape in enumerate(shapes)]
        return _all_reduce.all_reduce_gradients(
            gradients, keras_dist.CommunicationOptions(), names=["a", "b", "c"], num_examples=2, extras=[tf.ones([6])]
        )

    summed, extras = tf.function(lambda: strategy.run(step))()
    assert sent[0][:3] == [(5,), (4, 2), (3,)], sent  # the last variable's gradient first
    assert sent[0][3:] == [(6,), (1,), (6,)], sent  # then the extras, the example count, the structure flags
    for i, value in enumerate(summed):  # back in variable order; each replica's mean counted by its examples
        for local in strategy.experimental_local_results(value):
            np.testing.assert_array_equal(local.numpy(), np.full(shapes[i], float(i + 1)))
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
