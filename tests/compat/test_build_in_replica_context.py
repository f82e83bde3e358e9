"""A layer that calls a collective in `call` must build (Keras builds in cross-replica context)."""

import keras
import pytest
import tensorflow as tf
from _support import sum_regression

import keras_dist
from keras_dist import _compat
from keras_dist.testing import max_weight_difference

pytestmark = pytest.mark.compat


class GlobalBatchCenter(keras.layers.Layer):
    """Subtracts the mean over the global batch: sums and counts all-reduced over the replicas."""

    def call(self, x):
        context = tf.distribute.get_replica_context()  # None in cross-replica context: no guard here.
        total, count = context.all_reduce("SUM", [tf.reduce_sum(x, axis=0), tf.cast(tf.shape(x)[0], x.dtype)])
        return x - total / tf.maximum(count, 1.0)


def _model(cls, **kwargs):
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, kernel_initializer=keras.initializers.GlorotUniform(seed=1))(inputs)
    outputs = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2))(
        GlobalBatchCenter()(hidden)
    )
    model = cls(inputs, outputs, **kwargs)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


def test_without_fix_the_build_fails(mirrored_1x2_cpu):
    with _compat.disabled("build_in_replica_context"):
        model = _model(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu)
        with pytest.raises(RuntimeError, match="Unable to automatically build the model"):
            model.fit(*sum_regression(13, 3), batch_size=4, epochs=1, verbose=0)


def test_with_fix_it_trains_like_one_device(mirrored_1x2_cpu):
    x, y = sum_regression(13, 3)
    reference, model = _model(keras.Model), _model(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu)
    model.set_weights(reference.get_weights())
    for m in (reference, model):
        m.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(reference, model) < 1e-5
