"""SimCLR contrastive pretraining (keras.io/examples/vision/semisupervised_simclr), 32x32 images.

Follows "Semi-supervised image classification using contrastive pretraining with SimCLR":
its `ContrastiveModel` (encoder, projection head, linear probe), `compile(contrastive_optimizer,
probe_optimizer)`, the NT-Xent `contrastive_loss` over the batch's similarity matrix, a
`train_step` with two tapes (contrastive, then the probe on the labeled images), a `test_step`
of the probe, and four trackers; `fit` on the zipped unlabeled and labeled datasets with the
test set as validation data.

One-line change: `class ContrastiveModel(keras.Model)` -> `class ContrastiveModel(keras_dist.DistributedModel)`.
The documented change for a loss that sees the whole batch (docs/global_batch_losses.md): the
first line of `contrastive_loss` gathers both views' projections over the replicas
(`keras_dist.ops.all_gather`, the identity on one device), so every replica compares each
image with the global batch's negatives, as one device does. The global batch's order on 2
replicas is another (each replica's unlabeled then labeled images); the loss, a sum over
matched pairs, does not depend on it.
For the comparison the augmenters are off (`AUGMENT = False`: Rescaling only; keras.io's
random flips, translations, zooms and color jitter are drawn by each replica for its own
images, which cannot match one device), so both views are the same image; the datasets'
shuffles have a seed (keras.io leaves them unseeded). The summaries are not printed.
Covers: a loss returning one value per example (its gradient is their sum), two optimizers,
gradients of sub-models, trackers of a vector loss, SparseCategoricalAccuracy of the
similarity matrix; 100 unlabeled + 20 labeled images in 5 steps of 20 + 4, 2 epochs,
validation on 30 images at batch 21 (last batch 9).
"""

import math

import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops

import keras_dist

CHANGE = "subclass"
AUGMENT = False  # keras.io: random augmentations (see the docstring)

# Dataset hyperparameters
unlabeled_dataset_size = 100  # keras.io: 100000
labeled_dataset_size = 20  # keras.io: 5000
image_size = 32  # keras.io: 96
image_channels = 3

# Algorithm hyperparameters
num_epochs = 2  # keras.io: 20
batch_size = 21  # keras.io: 525
width = 8  # keras.io: 128
temperature = 0.1
# Stronger augmentations for contrastive, weaker ones for supervised training
contrastive_augmentation = {"min_area": 0.25, "brightness": 0.6, "jitter": 0.2}
classification_augmentation = {
    "min_area": 0.75,
    "brightness": 0.3,
    "jitter": 0.1,
}


def _images(rs, n):
    """n images of 4x4 random color blocks (8x8 pixels each), values 0..255, as STL-10's uint8 images."""
    blocks = rs.randint(0, 256, (n, 4, 4, image_channels))
    return np.kron(blocks, np.ones((1, image_size // 4, image_size // 4, 1))).astype("float32")


def data():
    rs = np.random.RandomState(7)
    unlabeled = _images(rs, unlabeled_dataset_size)
    labeled = _images(rs, labeled_dataset_size)
    labels = rs.randint(0, 10, labeled_dataset_size).astype("int64")
    test, test_labels = _images(rs, 30), rs.randint(0, 10, 30).astype("int64")
    # keras.io: tfds.load("stl10", split="unlabelled" / "train" / "test", as_supervised=True)
    return (unlabeled, -np.ones(unlabeled_dataset_size, "int64")), (labeled, labels), (test, test_labels)


def prepare_dataset(data):
    (unlabeled, unlabeled_labels), (labeled, labels), (test, test_labels) = data
    # Labeled and unlabeled samples are loaded synchronously
    # with batch sizes selected accordingly
    steps_per_epoch = (unlabeled_dataset_size + labeled_dataset_size) // batch_size
    unlabeled_batch_size = unlabeled_dataset_size // steps_per_epoch
    labeled_batch_size = labeled_dataset_size // steps_per_epoch

    unlabeled_train_dataset = (
        tf.data.Dataset.from_tensor_slices((unlabeled, unlabeled_labels))
        .shuffle(buffer_size=10 * unlabeled_batch_size, seed=1)
        .batch(unlabeled_batch_size)
    )
    labeled_train_dataset = (
        tf.data.Dataset.from_tensor_slices((labeled, labels))
        .shuffle(buffer_size=10 * labeled_batch_size, seed=2)
        .batch(labeled_batch_size)
    )
    test_dataset = tf.data.Dataset.from_tensor_slices((test, test_labels)).batch(batch_size).prefetch(tf.data.AUTOTUNE)

    # Labeled and unlabeled datasets are zipped together
    train_dataset = tf.data.Dataset.zip((unlabeled_train_dataset, labeled_train_dataset)).prefetch(
        buffer_size=tf.data.AUTOTUNE
    )

    return train_dataset, labeled_train_dataset, test_dataset


# Distorts the color distibutions of images
class RandomColorAffine(layers.Layer):
    def __init__(self, brightness=0, jitter=0, **kwargs):
        super().__init__(**kwargs)

        self.seed_generator = keras.random.SeedGenerator(1337)
        self.brightness = brightness
        self.jitter = jitter

    def get_config(self):
        config = super().get_config()
        config.update({"brightness": self.brightness, "jitter": self.jitter})
        return config

    def call(self, images, training=True):
        if training:
            batch_size = ops.shape(images)[0]

            # Same for all colors
            brightness_scales = 1 + keras.random.uniform(
                (batch_size, 1, 1, 1),
                minval=-self.brightness,
                maxval=self.brightness,
                seed=self.seed_generator,
            )
            # Different for all colors
            jitter_matrices = keras.random.uniform(
                (batch_size, 1, 3, 3),
                minval=-self.jitter,
                maxval=self.jitter,
                seed=self.seed_generator,
            )

            color_transforms = (
                ops.tile(ops.expand_dims(ops.eye(3), axis=0), (batch_size, 1, 1, 1)) * brightness_scales
                + jitter_matrices
            )
            images = ops.clip(ops.matmul(images, color_transforms), 0, 1)
        return images


# Image augmentation module
def get_augmenter(min_area, brightness, jitter):
    zoom_factor = 1.0 - math.sqrt(min_area)
    if not AUGMENT:
        return keras.Sequential([layers.Rescaling(1 / 255)])
    return keras.Sequential(
        [
            layers.Rescaling(1 / 255),
            layers.RandomFlip("horizontal"),
            layers.RandomTranslation(zoom_factor / 2, zoom_factor / 2),
            layers.RandomZoom((-zoom_factor, 0.0), (-zoom_factor, 0.0)),
            RandomColorAffine(brightness, jitter),
        ]
    )


# Define the encoder architecture
def get_encoder():
    return keras.Sequential(
        [
            layers.Conv2D(width, kernel_size=3, strides=2, activation="relu"),
            layers.Conv2D(width, kernel_size=3, strides=2, activation="relu"),
            layers.Conv2D(width, kernel_size=3, strides=2, activation="relu"),
            layers.Conv2D(width, kernel_size=3, strides=2, activation="relu"),
            layers.Flatten(),
            layers.Dense(width, activation="relu"),
        ],
        name="encoder",
    )


def make_contrastive_model_class(Model):
    # Define the contrastive model with model-subclassing
    # keras_dist: class ...(keras.Model) -> class ...(keras_dist.DistributedModel) (`Model` is either)
    class ContrastiveModel(Model):
        def __init__(self):
            super().__init__()

            self.temperature = temperature
            self.contrastive_augmenter = get_augmenter(**contrastive_augmentation)
            self.classification_augmenter = get_augmenter(**classification_augmentation)
            self.encoder = get_encoder()
            # Non-linear MLP as projection head
            self.projection_head = keras.Sequential(
                [
                    keras.Input(shape=(width,)),
                    layers.Dense(width, activation="relu"),
                    layers.Dense(width),
                ],
                name="projection_head",
            )
            # Single dense layer for linear probing
            self.linear_probe = keras.Sequential(
                [layers.Input(shape=(width,)), layers.Dense(10)],
                name="linear_probe",
            )
            # keras.io prints self.encoder.summary(), self.projection_head.summary(), self.linear_probe.summary()

        def compile(self, contrastive_optimizer, probe_optimizer, **kwargs):
            super().compile(**kwargs)

            self.contrastive_optimizer = contrastive_optimizer
            self.probe_optimizer = probe_optimizer

            # self.contrastive_loss will be defined as a method
            self.probe_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

            self.contrastive_loss_tracker = keras.metrics.Mean(name="c_loss")
            self.contrastive_accuracy = keras.metrics.SparseCategoricalAccuracy(name="c_acc")
            self.probe_loss_tracker = keras.metrics.Mean(name="p_loss")
            self.probe_accuracy = keras.metrics.SparseCategoricalAccuracy(name="p_acc")

        @property
        def metrics(self):
            return [
                self.contrastive_loss_tracker,
                self.contrastive_accuracy,
                self.probe_loss_tracker,
                self.probe_accuracy,
            ]

        def contrastive_loss(self, projections_1, projections_2):
            # InfoNCE loss (information noise-contrastive estimation)
            # NT-Xent loss (normalized temperature-scaled cross entropy)

            # keras_dist: the global batch's projections on every replica (the identity on one device)
            projections_1, projections_2 = keras_dist.ops.all_gather((projections_1, projections_2))

            # Cosine similarity: the dot product of the l2-normalized feature vectors
            projections_1 = ops.normalize(projections_1, axis=1)
            projections_2 = ops.normalize(projections_2, axis=1)
            similarities = ops.matmul(projections_1, ops.transpose(projections_2)) / self.temperature

            # The similarity between the representations of two augmented views of the
            # same image should be higher than their similarity with other views
            batch_size = ops.shape(projections_1)[0]
            contrastive_labels = ops.arange(batch_size)
            self.contrastive_accuracy.update_state(contrastive_labels, similarities)
            self.contrastive_accuracy.update_state(contrastive_labels, ops.transpose(similarities))

            # The temperature-scaled similarities are used as logits for cross-entropy
            # a symmetrized version of the loss is used here
            loss_1_2 = keras.losses.sparse_categorical_crossentropy(contrastive_labels, similarities, from_logits=True)
            loss_2_1 = keras.losses.sparse_categorical_crossentropy(
                contrastive_labels, ops.transpose(similarities), from_logits=True
            )
            return (loss_1_2 + loss_2_1) / 2

        def train_step(self, data):
            (unlabeled_images, _), (labeled_images, labels) = data

            # Both labeled and unlabeled images are used, without labels
            images = ops.concatenate((unlabeled_images, labeled_images), axis=0)
            # Each image is augmented twice, differently
            augmented_images_1 = self.contrastive_augmenter(images, training=True)
            augmented_images_2 = self.contrastive_augmenter(images, training=True)
            with tf.GradientTape() as tape:
                features_1 = self.encoder(augmented_images_1, training=True)
                features_2 = self.encoder(augmented_images_2, training=True)
                # The representations are passed through a projection mlp
                projections_1 = self.projection_head(features_1, training=True)
                projections_2 = self.projection_head(features_2, training=True)
                contrastive_loss = self.contrastive_loss(projections_1, projections_2)
            gradients = tape.gradient(
                contrastive_loss,
                self.encoder.trainable_weights + self.projection_head.trainable_weights,
            )
            self.contrastive_optimizer.apply_gradients(
                zip(
                    gradients,
                    self.encoder.trainable_weights + self.projection_head.trainable_weights,
                )
            )
            self.contrastive_loss_tracker.update_state(contrastive_loss)

            # Labels are only used in evalutation for an on-the-fly logistic regression
            preprocessed_images = self.classification_augmenter(labeled_images, training=True)
            with tf.GradientTape() as tape:
                # the encoder is used in inference mode here to avoid regularization
                # and updating the batch normalization paramers if they are used
                features = self.encoder(preprocessed_images, training=False)
                class_logits = self.linear_probe(features, training=False)
                probe_loss = self.probe_loss(labels, class_logits)
            gradients = tape.gradient(probe_loss, self.linear_probe.trainable_weights)
            self.probe_optimizer.apply_gradients(zip(gradients, self.linear_probe.trainable_weights))
            self.probe_loss_tracker.update_state(probe_loss)
            self.probe_accuracy.update_state(labels, class_logits)

            return {m.name: m.result() for m in self.metrics}

        def test_step(self, data):
            labeled_images, labels = data

            # For testing the components are used with a training=False flag
            preprocessed_images = self.classification_augmenter(labeled_images, training=False)
            features = self.encoder(preprocessed_images, training=False)
            class_logits = self.linear_probe(features, training=False)
            probe_loss = self.probe_loss(labels, class_logits)
            self.probe_loss_tracker.update_state(probe_loss)
            self.probe_accuracy.update_state(labels, class_logits)

            # Only the probe metrics are logged at test time
            return {m.name: m.result() for m in self.metrics[2:]}

    return ContrastiveModel


def build(Model, distribute):
    ContrastiveModel = make_contrastive_model_class(Model)
    # Contrastive pretraining
    pretraining_model = ContrastiveModel()
    pretraining_model.compile(
        contrastive_optimizer=keras.optimizers.Adam(),
        probe_optimizer=keras.optimizers.Adam(),
    )
    # Built here (keras.io's first fit builds it) so that both runs start from the same weights.
    pretraining_model.linear_probe(pretraining_model.encoder(np.zeros((1, image_size, image_size, 3), "float32")))
    return pretraining_model


def train(pretraining_model, data):
    train_dataset, labeled_train_dataset, test_dataset = prepare_dataset(data)
    pretraining_history = pretraining_model.fit(
        train_dataset, epochs=num_epochs, validation_data=test_dataset, verbose=0
    )
    return {
        "history": pretraining_history.history,
        "evaluate": pretraining_model.evaluate(test_dataset, verbose=0, return_dict=True),
    }
