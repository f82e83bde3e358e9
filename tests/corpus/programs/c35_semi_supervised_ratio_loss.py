"""A semi-supervised autoencoder: reconstruction on every example, a class loss on the labelled few.

One-line change: `keras.Model(inputs, outputs)` -> `keras_dist.DistributedModel(inputs, outputs)`.
Covers: two outputs, `mse` on one and on the other a loss and a metric written as a ratio of sums
over the labelled examples (`ops.sum(loss * labelled) / ops.sum(labelled)`, unlabelled examples
marked -1, as public semi-supervised scripts write it), `loss_weights`, Adam, `evaluate`. About one
example in six is labelled: one replica's part of a batch often holds none, and its ratio is 0 / 0.
Before, that replica's NaN made the weights NaN on 2 replicas where one device trains on. 240
examples at batch 16, 2 epochs.
"""

import keras
import numpy as np
from keras import ops

CHANGE = "functional"


def labelled_loss(label, logits):
    labelled = ops.cast(label >= 0, "float32")
    loss = keras.losses.sparse_categorical_crossentropy(ops.maximum(label, 0), logits, from_logits=True)
    return ops.sum(loss * labelled) / ops.sum(labelled)


def labelled_accuracy(label, logits):
    labelled = ops.cast(label >= 0, "float32")
    hit = ops.cast(
        ops.cast(ops.argmax(logits, axis=-1), "int32") == ops.cast(ops.maximum(label, 0), "int32"), "float32"
    )
    return ops.sum(hit * labelled) / ops.sum(labelled)


def data():
    rs = np.random.RandomState(35)
    x = rs.rand(240, 20).astype("float32")
    label = (x[:, :3].argmax(-1)).astype("int32")
    label[rs.rand(240) > 0.17] = -1
    label[:16] = -1  # The first batch: no labels at all on either replica.
    label[3] = 1  # ...but one, on the first replica's part.
    return x, {"recon": x, "cls": label}


def build(Model, distribute):
    # keras_dist: keras.Model(...) -> keras_dist.DistributedModel(...) (`Model` is either)
    inputs = keras.Input(shape=(20,))
    code = keras.layers.Dense(8, activation="relu")(inputs)
    recon = keras.layers.Dense(20, name="recon")(code)
    cls = keras.layers.Dense(3, name="cls")(code)
    model = Model(inputs, {"recon": recon, "cls": cls})
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss={"recon": "mse", "cls": labelled_loss},
        loss_weights={"recon": 1.0, "cls": 0.3},
        metrics={"cls": [labelled_accuracy]},
    )
    return model


def train(model, data):
    x, y = data
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    evaluation = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    return {"history": history.history, "evaluate": evaluation, "predict": model.predict(x[:10], verbose=0)}
