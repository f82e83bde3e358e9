"""keras.io's custom `train_step` guide with Keras 3's gradient accumulation and clipping by hand.

Follows keras.io/guides/custom_train_step_in_tensorflow (the loop over `self.metrics`), as public
scripts combine it with `keras.optimizers.Adam(gradient_accumulation_steps=k)` (Keras 3's way to a
larger effective batch) and `tf.clip_by_global_norm` between `tape.gradient` and
`apply_gradients`. One-line change: `class AccumulatingModel(keras.Model)` ->
`class AccumulatingModel(keras_dist.DistributedModel)`, built functionally.
Covers: each micro-batch's gradient clipped by its own global norm, then accumulated (k=3) by
Keras' optimizer; an `Embedding` whose gradient is `tf.IndexedSlices` with repeated rows; the
norm logged by a `Mean` tracker next to the compiled loss tracker and `mae`. Until stop 50 each
replica clipped its own gradient there (the clip binds: norms of about 6 against 0.5; the logged norm
5.956 against one device's 5.912, predictions 1.9e-3 off). A `Sum` of the batch losses next to it
(the epoch's total loss, as public scripts log it) read N times one device's until stop 51.
87 examples at batch 16 (last batch 7), 2 epochs (12 micro-batches: 4 updates).
"""

import keras
import numpy as np
import tensorflow as tf

CHANGE = "subclass"
CLIP_NORM = 0.5


def make_accumulating_model_class(Model):
    # keras_dist: class ...(keras.Model) -> class ...(keras_dist.DistributedModel) (`Model` is either)
    class AccumulatingModel(Model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.norm_tracker = keras.metrics.Mean(name="grad_norm")
            self.loss_sum = keras.metrics.Sum(name="loss_sum")

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            gradients = tape.gradient(loss, self.trainable_variables)
            gradients, norm = tf.clip_by_global_norm(gradients, CLIP_NORM)
            self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                elif metric.name not in ("grad_norm", "loss_sum"):
                    metric.update_state(y, y_pred)
            self.norm_tracker.update_state(norm)
            self.loss_sum.update_state(loss)
            return {m.name: m.result() for m in self.metrics}

        @property
        def metrics(self):
            return super().metrics + [self.norm_tracker, self.loss_sum]

    return AccumulatingModel


def data():
    rs = np.random.RandomState(41)
    ids = rs.randint(0, 8, size=(87, 6)).astype("int32")  # 8 ids: rows repeat within and across examples
    y = (ids.sum(axis=1, keepdims=True) / 10.0 + rs.normal(0, 0.1, (87, 1))).astype("float32")
    return ids, y


def build(Model, distribute):
    AccumulatingModel = make_accumulating_model_class(Model)
    inputs = keras.Input(shape=(6,), dtype="int32")
    hidden = keras.layers.Embedding(8, 4)(inputs)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    hidden = keras.layers.Dense(8, activation="relu")(hidden)
    outputs = keras.layers.Dense(1)(hidden)
    model = AccumulatingModel(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=0.05, gradient_accumulation_steps=3),
        loss="mse",
        metrics=["mae"],
    )
    return model


def train(model, data):
    x, y = data
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    return {
        "history": history.history,
        "evaluate": model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True),
        "predict": model.predict(x[:10], verbose=0),
    }
