"""`keras_dist.ops`: losses that see the whole batch train to one device's weights (issue 25 item 1).

The programs are written as keras.io writes them (the SimCLR pretraining of
"Semi-supervised image classification using contrastive pretraining with
SimCLR", a batch-hard triplet loss), plus the documented change: gather what
the loss compares with `keras_dist.ops.all_gather`. Each is compared with
plain Keras on one device from the same weights on the same batches, on
uneven parts (10 examples, batch 4 on 3 replicas: 2/1/1, then 1/1/0 with a
replica without examples). Without the change they differ (checked here too:
the tests can fail).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import keras_dist
from keras_dist.testing import assert_matches_single_device

X = np.random.RandomState(0).rand(10, 4).astype("float32")
VIEWS = (X, (X + 0.05 * np.random.RandomState(1).rand(10, 4)).astype("float32"))


def test_all_gather_gives_the_global_batch_in_order_on_every_replica(mirrored_1x3_cpu):
    strategy = mirrored_1x3_cpu
    parts = [np.arange(2, dtype="float32"), np.arange(2, 3, dtype="float32"), np.zeros([0], "float32")]

    def step(part):
        with tf.GradientTape() as tape:
            tape.watch(part)
            gathered = keras_dist.ops.all_gather(part)
            loss = ops.sum(gathered * ops.arange(1.0, 4.0))  # the weights of positions 0, 1, 2: 1, 2, 3
        return gathered, keras_dist.ops.global_batch_offset(part), tape.gradient(loss, part)

    values = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(parts[context.replica_id_in_sync_group])
    )
    gathered, offsets, gradients = tf.function(lambda v: strategy.run(step, (v,)))(values)
    local = strategy.experimental_local_results
    for g in local(gathered):
        np.testing.assert_array_equal(g.numpy(), [0.0, 1.0, 2.0])
    assert [int(o) for o in local(offsets)] == [0, 2, 3]
    # Outside a keras-dist step the gradient is TensorFlow's: summed over the 3 replicas' (equal) losses.
    assert [g.numpy().tolist() for g in local(gradients)] == [[3.0, 6.0], [9.0], []]


def test_on_one_device_it_is_the_identity():
    x = tf.constant(X)
    assert keras_dist.ops.all_gather(x) is x
    assert int(keras_dist.ops.global_batch_offset(x)) == 0
    assert keras_dist.ops.num_replicas() == 1


def test_outside_a_step_it_says_where_to_call_it(mirrored_1x2_cpu):
    with mirrored_1x2_cpu.scope(), pytest.raises(RuntimeError, match="inside the step"):
        keras_dist.ops.all_gather(tf.constant(X))


def _simclr(gather):
    """keras.io's SimCLR `ContrastiveModel` (Dense encoder, no augmentation: the two views are inputs)."""

    def build(cls, **kwargs):
        class ContrastiveModel(cls):
            def __init__(self, **kw):
                super().__init__(**kw)
                self.temperature = 0.1
                self.encoder = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(8)])
                self.projection_head = keras.Sequential(
                    [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(4)]
                )

            def compile(self, contrastive_optimizer, **kw):
                super().compile(**kw)
                self.contrastive_optimizer = contrastive_optimizer
                self.contrastive_loss_tracker = keras.metrics.Mean(name="c_loss")
                self.contrastive_accuracy = keras.metrics.SparseCategoricalAccuracy(name="c_acc")

            @property
            def metrics(self):
                return [self.contrastive_loss_tracker, self.contrastive_accuracy]

            def call(self, x):
                return self.projection_head(self.encoder(x))

            def contrastive_loss(self, projections_1, projections_2):
                if gather:  # keras_dist: the negatives of the whole batch
                    projections_1, projections_2 = keras_dist.ops.all_gather((projections_1, projections_2))
                projections_1 = ops.normalize(projections_1, axis=1)
                projections_2 = ops.normalize(projections_2, axis=1)
                similarities = ops.matmul(projections_1, ops.transpose(projections_2)) / self.temperature
                batch_size = ops.shape(projections_1)[0]
                contrastive_labels = ops.arange(batch_size)
                self.contrastive_accuracy.update_state(contrastive_labels, similarities)
                loss_1_2 = keras.losses.sparse_categorical_crossentropy(
                    contrastive_labels, similarities, from_logits=True
                )
                loss_2_1 = keras.losses.sparse_categorical_crossentropy(
                    contrastive_labels, ops.transpose(similarities), from_logits=True
                )
                return (loss_1_2 + loss_2_1) / 2

            def train_step(self, data):
                view_1, view_2 = data
                with tf.GradientTape() as tape:
                    projections_1 = self.projection_head(self.encoder(view_1, training=True), training=True)
                    projections_2 = self.projection_head(self.encoder(view_2, training=True), training=True)
                    contrastive_loss = self.contrastive_loss(projections_1, projections_2)
                weights = self.encoder.trainable_weights + self.projection_head.trainable_weights
                gradients = tape.gradient(contrastive_loss, weights)
                self.contrastive_optimizer.apply_gradients(zip(gradients, weights))
                self.contrastive_loss_tracker.update_state(contrastive_loss)
                return {m.name: m.result() for m in self.metrics}

        model = ContrastiveModel(**kwargs)
        model.compile(contrastive_optimizer=keras.optimizers.Adam(0.01))
        model(X)
        return model

    return build


def _fit(model):
    dataset = tf.data.Dataset.from_tensor_slices(VIEWS).batch(4)
    return model.fit(dataset, epochs=2, verbose=0)


def test_simclr_with_the_gathered_projections_matches_one_device(mirrored_1x3_cpu):
    assert_matches_single_device(
        _simclr(gather=True), strategy=mirrored_1x3_cpu, train=_fit, atol=1e-6, rtol=0.0, logs_atol=1e-6, logs_rtol=1e-5
    )


def test_simclr_without_the_gather_sees_fewer_negatives(mirrored_1x2_cpu):
    # Even parts on 2 replicas (on 3, replica 2's empty part has no logits to take a softmax of).
    with pytest.raises(AssertionError, match="weight"):
        assert_matches_single_device(_simclr(gather=False), strategy=mirrored_1x2_cpu, train=_fit, atol=1e-4)


def _triplet(gather):
    """A batch-hard triplet loss: each replica's anchors against the gathered batch (the cheaper way)."""

    def batch_hard(labels, embeddings):
        anchors, anchor_labels = embeddings, labels
        if gather:  # keras_dist: the candidates of the whole batch, this replica's anchors
            offset = keras_dist.ops.global_batch_offset(embeddings)
            embeddings, labels = keras_dist.ops.all_gather((embeddings, labels))
        else:
            offset = 0
        distances = ops.sum(ops.square(anchors[:, None, :] - embeddings[None, :, :]), axis=-1)
        same = ops.equal(anchor_labels[:, None], labels[None, :])
        own = ops.equal(
            ops.arange(ops.shape(anchors)[0])[:, None] + offset, ops.arange(ops.shape(embeddings)[0])[None, :]
        )
        hardest_positive = ops.max(ops.where(ops.logical_and(same, ops.logical_not(own)), distances, 0.0), axis=1)
        hardest_negative = ops.min(ops.where(same, 1e9, distances), axis=1)
        return ops.mean(ops.maximum(hardest_positive - hardest_negative + 0.5, 0.0))

    def build(cls, **kwargs):
        class TripletModel(cls):
            def train_step(self, data):
                x, labels = data
                with tf.GradientTape() as tape:
                    loss = batch_hard(labels, self(x, training=True))
                gradients = tape.gradient(loss, self.trainable_weights)
                self.optimizer.apply_gradients(zip(gradients, self.trainable_weights))
                self.loss_tracker.update_state(loss)
                return {"loss": self.loss_tracker.result()}

        inputs = keras.Input((4,))
        model = TripletModel(inputs, keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(inputs)), **kwargs)
        model.loss_tracker = keras.metrics.Mean(name="loss")
        model.compile(optimizer=keras.optimizers.SGD(0.1))
        return model

    return build


def _fit_triplets(model):
    labels = np.array([0, 1, 0, 1, 2, 2, 0, 1, 2, 0], "int32")
    return model.fit(X, labels, batch_size=4, epochs=2, shuffle=False, verbose=0)


def test_batch_hard_triplets_against_the_gathered_batch_match_one_device(mirrored_1x3_cpu):
    assert_matches_single_device(
        _triplet(gather=True),
        strategy=mirrored_1x3_cpu,
        train=_fit_triplets,
        atol=1e-6,
        rtol=0.0,
        logs_atol=1e-6,
        logs_rtol=1e-5,
    )


def _metric_learning(cls, **kwargs):
    """keras.io "Metric learning for image similarity search": `self.compute_loss` on the gathered similarities.

    keras.io's batches stack the anchors and positives on axis 0 (a batch of 2 x num_classes), which a
    split of the batch over replicas would cut in two; here they are stacked on axis 1.
    """

    class EmbeddingModel(cls):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.hidden = keras.layers.Dense(8, activation="relu")
            self.projection = keras.layers.Dense(3)
            self.normalize = keras.layers.UnitNormalization()

        def call(self, x):
            return self.normalize(self.projection(self.hidden(x)))

        def train_step(self, data):
            anchors, positives = data[:, 0], data[:, 1]  # keras.io: data[0], data[1]
            with tf.GradientTape() as tape:
                anchor_embeddings = self(anchors, training=True)
                positive_embeddings = self(positives, training=True)
                # keras_dist: every replica's anchors and positives
                anchor_embeddings, positive_embeddings = keras_dist.ops.all_gather(
                    (anchor_embeddings, positive_embeddings)
                )
                similarities = ops.einsum("ae,pe->ap", anchor_embeddings, positive_embeddings)
                similarities /= 0.2
                sparse_labels = ops.arange(ops.shape(similarities)[0])  # keras.io: ops.arange(num_classes)
                loss = self.compute_loss(y=sparse_labels, y_pred=similarities)
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(sparse_labels, similarities)
            return {m.name: m.result() for m in self.metrics}

    model = EmbeddingModel(**kwargs)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    model(X)
    return model


def test_keras_io_metric_learning_with_compute_loss_on_the_gathered_batch_matches_one_device(mirrored_1x3_cpu):
    pairs = np.stack(VIEWS, axis=1)  # (10, 2, 4): anchor and positive of each example

    def fit(model):
        dataset = tf.data.Dataset.from_tensor_slices(pairs).batch(5)  # 2 batches of 5, split over 3 replicas
        return model.fit(dataset, epochs=2, verbose=0)

    assert_matches_single_device(
        _metric_learning, strategy=mirrored_1x3_cpu, train=fit, atol=1e-6, rtol=0.0, logs_atol=1e-6, logs_rtol=1e-5
    )
