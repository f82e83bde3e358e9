"""A sequence tagger compiled with TensorFlow's transformer tutorial's `masked_loss` and `masked_accuracy`.

One-line change: `keras.Model(inputs, outputs)` -> `keras_dist.DistributedModel(inputs, outputs)`.
Covers: loss and metric functions that divide by the tokens they keep themselves, `ops.sum(loss *
mask) / ops.sum(mask)` (tensorflow.org's "Neural machine translation with a Transformer and Keras"
writes them so, and public seq2seq scripts copy them), padding 0 masked in the loss only (no
`mask_zero`), an Embedding whose gradient rows repeat, a GRU over the sequence, Adam, `evaluate`.
Each replica keeps another number of tokens: the loss counts by its share of the global batch's
tokens. Before, it counted by examples (weights 1.1e-2 off on 2 replicas, no warning). 101
sequences at batch 16 (last batch 5), 2 epochs.
"""

import keras
import numpy as np
from keras import ops

CHANGE = "functional"


def masked_loss(label, pred):
    mask = ops.cast(label != 0, "float32")
    loss = keras.losses.sparse_categorical_crossentropy(label, pred, from_logits=True)
    return ops.sum(loss * mask) / ops.sum(mask)


def masked_accuracy(label, pred):
    pred = ops.cast(ops.argmax(pred, axis=-1), label.dtype)
    mask = ops.cast(label != 0, "float32")
    match = ops.cast(pred == label, "float32") * mask
    return ops.sum(match) / ops.sum(mask)


def data():
    rs = np.random.RandomState(34)
    lengths = rs.randint(1, 13, size=101)
    x = np.zeros((101, 12), "int32")
    y = np.zeros((101, 12), "int32")
    for i, n in enumerate(lengths):
        x[i, :n] = rs.randint(1, 20, size=n)
        y[i, :n] = x[i, :n] % 5 + 1
    return x, y


def build(Model, distribute):
    # keras_dist: keras.Model(...) -> keras_dist.DistributedModel(...) (`Model` is either)
    inputs = keras.Input(shape=(12,), dtype="int32")
    hidden = keras.layers.Embedding(20, 8)(inputs)
    hidden = keras.layers.GRU(16, return_sequences=True)(hidden)
    model = Model(inputs, keras.layers.Dense(6)(hidden))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=masked_loss, metrics=[masked_accuracy])
    return model


def train(model, data):
    x, y = data
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    evaluation = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    return {"history": history.history, "evaluate": evaluation, "predict": model.predict(x[:10], verbose=0)}
