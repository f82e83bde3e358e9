"""A model whose `call` handles the `tf.RaggedTensor` it gets must build from ragged batches."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from keras_dist import _compat

pytestmark = pytest.mark.compat


class MeanOfTokens(keras_dist.DistributedModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = keras.layers.Embedding(10, 2)
        self.dense = keras.layers.Dense(1)

    def call(self, tokens):
        lengths = tf.cast(tokens.row_lengths(), "float32")[:, None]  # Only a RaggedTensor has row_lengths.
        return self.dense(tf.reduce_sum(self.embedding(tokens.to_tensor()), axis=1) / lengths)


def _ragged_batches():
    tokens = tf.ragged.constant([[1, 2], [3], [4, 5, 6], [7, 8], [9]])
    return tf.data.Dataset.from_tensor_slices((tokens, np.ones((5, 1), "float32"))).ragged_batch(4)


def test_without_fix_the_build_traces_call_on_a_dense_tensor(mirrored_1x2_cpu):
    with _compat.disabled("ragged_symbolic_build"):
        model = MeanOfTokens(strategy=mirrored_1x2_cpu)
        model.compile(optimizer="sgd", loss="mse")
        with pytest.raises(RuntimeError, match="has no attribute 'row_lengths'"):
            model.fit(_ragged_batches(), epochs=1, verbose=0)


def test_with_fix_it_builds_and_trains(mirrored_1x2_cpu):
    model = MeanOfTokens(strategy=mirrored_1x2_cpu)
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    history = model.fit(_ragged_batches(), epochs=2, verbose=0).history
    assert np.all(np.isfinite(history["loss"])) and "mae" in history
    assert model.predict(_ragged_batches(), verbose=0).shape == (5, 1)
