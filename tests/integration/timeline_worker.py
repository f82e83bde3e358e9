"""Worker script for the multi-worker timeline test, started by `keras-dist launch` with `KERAS_DIST_TIMELINE` set.

Usage: timeline_worker.py
  Trains a small regression for 2 epochs of 4 steps; on worker 1 the forward pass sleeps 0.2 s per step
  (a layer calling `time.sleep` through `tf.numpy_function`): the straggler the chief's report must name.
"""

import time

import keras
import numpy as np
import tensorflow as tf

import keras_dist  # Joins the cluster before TensorFlow runs anything.

SLOW = keras_dist.task_id() == 1


def _delay(values):
    if SLOW:
        time.sleep(0.2)
    return values


class Delay(keras.layers.Layer):
    def call(self, inputs):
        return tf.ensure_shape(tf.numpy_function(_delay, [inputs], tf.float32, stateful=True), inputs.shape)


def main():
    rng = np.random.RandomState(0)
    x = rng.rand(128, 8).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    inputs = keras.Input((8,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(Delay()(inputs)))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)


if __name__ == "__main__":
    main()
