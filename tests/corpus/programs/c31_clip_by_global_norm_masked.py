"""A masked sequence classifier whose own `train_step` clips by the global norm, as public scripts write it.

One-line change: `class ClippedModel(keras.Model)` -> `class ClippedModel(keras_dist.DistributedModel)`,
built functionally: `ClippedModel(inputs, outputs)`.
Covers: `gradients, _ = tf.clip_by_global_norm(gradients, clip_norm)` between `tape.gradient` and
`optimizer.apply_gradients` (the pattern of public bug reports and RL scripts; keras.io's own
examples pass `clipnorm` to the optimizer instead), an `Embedding(mask_zero=True)` whose gradient is
`tf.IndexedSlices` with repeated rows, a GRU over the mask, `self.compute_loss`, Adam, a `Mean`
loss tracker listed in `metrics`, the norm logged. Before keras-dist summed `tape.gradient` over the
replicas, each replica clipped its own gradient by its own norm (the clip binds here: norms of
about 2-4 against 0.5). 75 examples at batch 16 (last batch 11), 2 epochs.
"""

import keras
import numpy as np
import tensorflow as tf

CHANGE = "subclass"
CLIP_NORM = 0.5


def make_clipped_model_class(Model):
    # keras_dist: class ...(keras.Model) -> class ...(keras_dist.DistributedModel) (`Model` is either)
    class ClippedModel(Model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.norm_tracker = keras.metrics.Mean(name="grad_norm")

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            gradients = tape.gradient(loss, self.trainable_variables)
            gradients, norm = tf.clip_by_global_norm(gradients, CLIP_NORM)
            self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
            self.loss_tracker.update_state(loss)
            self.norm_tracker.update_state(norm)
            return {"loss": self.loss_tracker.result(), "grad_norm": self.norm_tracker.result()}

        @property
        def metrics(self):
            return [self.loss_tracker, self.norm_tracker]

    return ClippedModel


def data():
    rs = np.random.RandomState(31)
    lengths = rs.randint(2, 10, size=75)
    x = np.zeros((75, 10), "int32")
    for i, n in enumerate(lengths):
        x[i, :n] = rs.randint(1, 6, size=n)  # 5 tokens: rows repeat within and across examples
    y = (x.sum(axis=1) % 3).astype("int32")
    return x, y


def build(Model, distribute):
    ClippedModel = make_clipped_model_class(Model)
    inputs = keras.Input(shape=(10,), dtype="int32")
    hidden = keras.layers.Embedding(6, 8, mask_zero=True)(inputs)
    hidden = keras.layers.GRU(8)(hidden)
    outputs = keras.layers.Dense(3)(hidden)
    model = ClippedModel(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def train(model, data):
    x, y = data
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    return {"history": history.history, "predict": model.predict(x[:10], verbose=0)}
