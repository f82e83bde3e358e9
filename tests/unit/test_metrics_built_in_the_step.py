"""A model Keras cannot build ahead gets its metric state in the first step; validation mid-`fit` re-homes it.

keras.io's graph attention network: the batches are node indices, the model runs on a feature
table it keeps, and a step of its own gathers the outputs at the indices. Keras cannot call the
model on a batch to build it, so the compiled metric's variables are made inside the first
step. The first validation re-homed them onto the strategy and set the train function to
`None`, which `fit`'s loop then called: "'NoneType' object is not callable" at the second epoch
(a new-user probe). Now the train function is made again and the run matches one device.
"""

import keras
import numpy as np
import tensorflow as tf

from keras_dist.testing import assert_matches_single_device

FEATURES = np.random.RandomState(9).randn(40, 5).astype("float32")
LABELS = np.argmax(FEATURES[:, :3], 1).astype("int32")


class _NodeModel:
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.node_states = tf.constant(FEATURES)
        self.out = keras.layers.Dense(3)

    def call(self, node_states):
        return self.out(node_states)

    def train_step(self, data):
        indices, labels = data
        with tf.GradientTape() as tape:
            outputs = tf.gather(self(self.node_states), indices)
            loss = self.compute_loss(y=labels, y_pred=outputs)
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_weights), self.trainable_weights))
        for metric in self.metrics:
            if metric.name != "loss":
                metric.update_state(labels, outputs)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        indices, labels = data
        outputs = tf.gather(self(self.node_states), indices)
        for metric in self.metrics:
            if metric.name != "loss":
                metric.update_state(labels, outputs)
        return {m.name: m.result() for m in self.metrics}


def test_validation_after_metrics_made_in_the_first_step(mirrored_1x2_cpu):
    def build(cls, **kwargs):
        model = type("NodeModel", (_NodeModel, cls), {})(**kwargs)
        model(tf.constant(FEATURES))
        model.compile(
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=keras.optimizers.Adam(0.02),
            metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")],
        )
        return model

    def train(model):
        indices = np.arange(35)
        return model.fit(
            indices, LABELS[indices], batch_size=8, epochs=2, shuffle=False, validation_split=0.1, verbose=0
        )

    assert_matches_single_device(
        build, strategy=mirrored_1x2_cpu, train=train, atol=1e-5, rtol=0.0, logs_atol=1e-6, logs_rtol=1e-5
    )
