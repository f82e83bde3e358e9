"""DCGAN overriding `train_step` (keras.io/examples/generative/dcgan_overriding_train_step), 8x8 images.

One-line change: `class GAN(keras.Model)` -> `class GAN(keras_dist.DistributedModel)`.
Written as keras.io writes it: `GAN(discriminator=..., generator=..., latent_dim=...)`, its own
`compile(d_optimizer, g_optimizer, loss_fn)` with two Adam optimizers created outside any
scope, no `call()`, two `Mean` trackers returned from `train_step`.
For the comparison the latent vectors come with the data (drawn once in `data()`; keras.io
draws them with `keras.random.normal` in `train_step`, which each replica would draw for its
own examples) and the label noise is scaled by 0.0 (keras.io: 0.05 * uniform noise).
Covers: two optimizers, two tapes per step, gradients of sub-models only, `generator.predict`
afterwards; 72 images at batch 32 (last batch 8).
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops

CHANGE = "subclass"
latent_dim = 8  # keras.io: 128
LABEL_NOISE = 0.0  # keras.io: 0.05


def make_gan_class(Model):
    # keras_dist: class ...(keras.Model) -> class ...(keras_dist.DistributedModel) (`Model` is either)
    class GAN(Model):
        def __init__(self, discriminator, generator, latent_dim):
            super().__init__()
            self.discriminator = discriminator
            self.generator = generator
            self.latent_dim = latent_dim
            self.seed_generator = keras.random.SeedGenerator(1337)

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer
            self.loss_fn = loss_fn
            self.d_loss_metric = keras.metrics.Mean(name="d_loss")
            self.g_loss_metric = keras.metrics.Mean(name="g_loss")

        @property
        def metrics(self):
            return [self.d_loss_metric, self.g_loss_metric]

        def train_step(self, data):
            # keras.io: random_latent_vectors = keras.random.normal(shape=(batch_size, self.latent_dim), seed=...)
            real_images, latent = data
            batch_size = ops.shape(real_images)[0]
            random_latent_vectors = latent[:, 0]

            # Decode them to fake images
            generated_images = self.generator(random_latent_vectors)

            # Combine them with real images
            combined_images = ops.concatenate([generated_images, real_images], axis=0)

            # Assemble labels discriminating real from fake images
            labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
            # Add random noise to the labels - important trick!
            labels += LABEL_NOISE * tf.random.uniform(tf.shape(labels))

            # Train the discriminator
            with tf.GradientTape() as tape:
                predictions = self.discriminator(combined_images)
                d_loss = self.loss_fn(labels, predictions)
            grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
            self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))

            # Sample random points in the latent space
            random_latent_vectors = latent[:, 1]

            # Assemble labels that say "all real images"
            misleading_labels = ops.zeros((batch_size, 1))

            # Train the generator (note that we should *not* update the weights
            # of the discriminator)!
            with tf.GradientTape() as tape:
                predictions = self.discriminator(self.generator(random_latent_vectors))
                g_loss = self.loss_fn(misleading_labels, predictions)
            grads = tape.gradient(g_loss, self.generator.trainable_weights)
            self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))

            # Update metrics
            self.d_loss_metric.update_state(d_loss)
            self.g_loss_metric.update_state(g_loss)
            return {
                "d_loss": self.d_loss_metric.result(),
                "g_loss": self.g_loss_metric.result(),
            }

    return GAN


def data():
    rs = np.random.RandomState(5)
    images = rs.rand(72, 8, 8, 1).astype("float32")
    latent = rs.randn(72, 2, latent_dim).astype("float32")
    return images, latent


def build(Model, distribute):
    discriminator = keras.Sequential(
        [
            keras.Input(shape=(8, 8, 1)),
            layers.Conv2D(8, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(16, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Flatten(),
            layers.Dropout(0.0),  # keras.io: 0.2
            layers.Dense(1, activation="sigmoid"),
        ],
        name="discriminator",
    )
    generator = keras.Sequential(
        [
            keras.Input(shape=(latent_dim,)),
            layers.Dense(2 * 2 * 16),
            layers.Reshape((2, 2, 16)),
            layers.Conv2DTranspose(16, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2DTranspose(8, kernel_size=4, strides=2, padding="same"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(1, kernel_size=5, padding="same", activation="sigmoid"),
        ],
        name="generator",
    )
    GAN = make_gan_class(Model)
    gan = GAN(discriminator=discriminator, generator=generator, latent_dim=latent_dim)
    gan.compile(
        d_optimizer=keras.optimizers.Adam(learning_rate=0.0001),
        g_optimizer=keras.optimizers.Adam(learning_rate=0.0001),
        loss_fn=keras.losses.BinaryCrossentropy(),
    )
    return gan


def train(gan, data):
    images, latent = data
    dataset = tf.data.Dataset.from_tensor_slices((images, latent)).batch(32)
    history = gan.fit(dataset, epochs=1, verbose=0)
    return {
        "history": history.history,
        "predict": gan.generator.predict(latent[:10, 0], verbose=0),
    }
