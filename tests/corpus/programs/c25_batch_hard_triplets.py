"""Batch-hard triplet loss in a step of one's own (keras.io/examples/vision/metric_learning's model), 16x16 images.

Follows keras.io's "Metric learning for image similarity search": its `EmbeddingModel(keras.Model)`
with its own `train_step` (a tape, `self.optimizer.apply_gradients`, the loss given to the
compiled `loss` tracker found in `self.metrics`), a Rescaling + 3 strided Conv2D +
GlobalAveragePooling2D + Dense + UnitNormalization embedding, Adam(1e-3). Its in-batch softmax of
anchor/positive pairs is replaced by the batch-hard triplet loss of TensorFlow Addons'
`tfa.losses.TripletHardLoss` (Hermans et al., "In Defense of the Triplet Loss for Person
Re-Identification", 2017): for each anchor the farthest example of its class and the nearest of
another class in the batch, margin 1.0, L2 distances, the mean over the anchors.

One-line change: `class EmbeddingModel(keras.Model)` -> `class EmbeddingModel(keras_dist.DistributedModel)`.
The documented change for a loss that sees the whole batch (docs/global_batch_losses.md), the
cheaper way: each replica keeps its own anchors and gathers the candidates over the replicas
(`keras_dist.ops.all_gather` of the embeddings and labels), and
`keras_dist.ops.global_batch_offset` says which candidate is the anchor itself (both the
identity / 0 on one device). The loss is a mean over this replica's anchors, which keras-dist
weights by the replica's examples, as one device's mean over all anchors.
Changed: CIFAR-10's images and keras.io's `AnchorPositivePairs` sampler give way to arrays of
16x16 images in 6 classes, batched by `fit` (`shuffle=False`) so that each batch holds several
images of each class (keras.io's sampler draws one pair per class).
Covers: integer labels gathered beside the embeddings, a mask from the replica's offset,
max/min over the gathered candidates, a functional subclass; 77 images at batch 12 (last batch
5: 3 and 2 on 2 replicas), 2 epochs.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops

import keras_dist

CHANGE = "subclass"
height_width = 16  # keras.io: 32
num_classes = 6  # keras.io: 10
margin = 1.0  # tfa.losses.TripletHardLoss's default


def pairwise_distances(anchors, candidates):
    """L2 distances `(anchors, candidates)`, 0 where they coincide (TFA's `pairwise_distance`)."""
    squared = ops.sum(ops.square(anchors[:, None, :] - candidates[None, :, :]), axis=-1)
    return ops.where(squared > 0.0, ops.sqrt(ops.maximum(squared, 1e-16)), 0.0)


def batch_hard_triplet_loss(labels, embeddings):
    anchors, anchor_labels = embeddings, labels
    # keras_dist: each replica's anchors against the global batch's candidates (the identity and 0 on one device)
    offset = keras_dist.ops.global_batch_offset(embeddings)
    embeddings, labels = keras_dist.ops.all_gather((embeddings, labels))

    distances = pairwise_distances(anchors, embeddings)
    same_class = ops.equal(anchor_labels[:, None], labels[None, :])
    anchor_positions = ops.arange(ops.shape(anchors)[0]) + offset
    itself = ops.equal(anchor_positions[:, None], ops.arange(ops.shape(embeddings)[0])[None, :])
    # The farthest positive (another example of the anchor's class) and the nearest negative.
    hardest_positive = ops.max(ops.where(ops.logical_and(same_class, ops.logical_not(itself)), distances, 0.0), axis=1)
    hardest_negative = ops.min(ops.where(same_class, ops.stop_gradient(ops.max(distances)) + 1.0, distances), axis=1)
    return ops.mean(ops.maximum(hardest_positive - hardest_negative + margin, 0.0))


def make_embedding_model_class(Model):
    # keras_dist: class ...(keras.Model) -> class ...(keras_dist.DistributedModel) (`Model` is either)
    class EmbeddingModel(Model):
        def train_step(self, data):
            images, labels = data

            with tf.GradientTape() as tape:
                # Run the images through the model.
                embeddings = self(images, training=True)
                # keras.io: an in-batch softmax of anchor/positive similarities
                loss = batch_hard_triplet_loss(labels, embeddings)

            # Calculate gradients and apply via optimizer.
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))

            # Update and return metrics (specifically the one for the loss value).
            for metric in self.metrics:
                # Calling `self.compile` will by default add a `keras.metrics.Mean` loss
                if metric.name == "loss":
                    metric.update_state(loss)

            return {m.name: m.result() for m in self.metrics}

    return EmbeddingModel


def data():
    rs = np.random.RandomState(25)
    n = 77
    labels = np.arange(n) % num_classes  # every batch of 12 holds 2 images of each class
    # Each class a color, each image its own noise: close within a class, apart across.
    colors = rs.uniform(0, 255, (num_classes, 1, 1, 3))
    images = np.clip(colors[labels] + rs.normal(0, 60, (n, height_width, height_width, 3)), 0, 255)
    return images.astype("float32"), labels.astype("int32")


def build(Model, distribute):
    EmbeddingModel = make_embedding_model_class(Model)
    inputs = layers.Input(shape=(height_width, height_width, 3))
    x = layers.Rescaling(scale=1.0 / 255)(inputs)
    x = layers.Conv2D(filters=8, kernel_size=3, strides=2, activation="relu")(x)  # keras.io: 32 filters
    x = layers.Conv2D(filters=8, kernel_size=3, strides=2, activation="relu")(x)  # keras.io: 64
    x = layers.Conv2D(filters=16, kernel_size=3, strides=2, activation="relu")(x)  # keras.io: 128
    x = layers.GlobalAveragePooling2D()(x)
    embeddings = layers.Dense(units=8, activation=None)(x)
    embeddings = layers.UnitNormalization()(embeddings)

    model = EmbeddingModel(inputs, embeddings)
    # keras.io: loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), for its softmax
    # (self.compute_loss); the triplet loss is the step's own, and the "loss" tracker compile adds remains.
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-3))
    return model


def train(model, data):
    images, labels = data
    history = model.fit(images, labels, batch_size=12, epochs=2, shuffle=False, verbose=0)  # keras.io: 20 epochs
    return {"history": history.history, "predict": model.predict(images[:20], verbose=0)}
