"""Variational AutoEncoder (keras.io/examples/generative/vae), on 8x8 images.

One-line change: `class VAE(keras.Model)` -> `class VAE(keras_dist.DistributedModel)`; the
encoder and decoder stay plain `keras.Model`s, built before the VAE, and the VAE is built
with two positional arguments, `VAE(encoder, decoder)`, as keras.io does.
For the comparison the sampling noise is scaled by 0.0 (`z = z_mean`): keras.io draws
`epsilon` with `keras.random.normal`, which each replica draws for its own examples.
Covers: a custom `train_step` with its own losses (`ops.mean` over the batch), its own
`Mean` trackers and `metrics` property, `tape.gradient` + `optimizer.apply_gradients`, a
model with no `call()`, `fit(x)` without targets, `encoder.predict`/`decoder.predict` on the
plain sub-models afterwards; 70 images at batch 32 (last batch 6).
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops

CHANGE = "subclass"
latent_dim = 2
NOISE_SCALE = 0.0  # keras.io: 1.0 (z = z_mean + exp(0.5 * z_log_var) * epsilon)


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator) * NOISE_SCALE
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def make_vae_class(Model):
    # keras_dist: class ...(keras.Model) -> class ...(keras_dist.DistributedModel) (`Model` is either)
    class VAE(Model):
        def __init__(self, encoder, decoder, **kwargs):
            super().__init__(**kwargs)
            self.encoder = encoder
            self.decoder = decoder
            self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
            self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
            self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

        @property
        def metrics(self):
            return [
                self.total_loss_tracker,
                self.reconstruction_loss_tracker,
                self.kl_loss_tracker,
            ]

        def train_step(self, data):
            with tf.GradientTape() as tape:
                z_mean, z_log_var, z = self.encoder(data)
                reconstruction = self.decoder(z)
                reconstruction_loss = ops.mean(
                    ops.sum(
                        keras.losses.binary_crossentropy(data, reconstruction),
                        axis=(1, 2),
                    )
                )
                kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
                kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
                total_loss = reconstruction_loss + kl_loss
            grads = tape.gradient(total_loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            self.total_loss_tracker.update_state(total_loss)
            self.reconstruction_loss_tracker.update_state(reconstruction_loss)
            self.kl_loss_tracker.update_state(kl_loss)
            return {
                "loss": self.total_loss_tracker.result(),
                "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result(),
            }

    return VAE


def data():
    rs = np.random.RandomState(4)
    return rs.rand(70, 8, 8, 1).astype("float32")


def build(Model, distribute):
    encoder_inputs = keras.Input(shape=(8, 8, 1))
    x = layers.Conv2D(8, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
    x = layers.Conv2D(16, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Flatten()(x)
    x = layers.Dense(16, activation="relu")(x)
    z_mean = layers.Dense(latent_dim, name="z_mean")(x)
    z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")

    latent_inputs = keras.Input(shape=(latent_dim,))
    x = layers.Dense(2 * 2 * 16, activation="relu")(latent_inputs)
    x = layers.Reshape((2, 2, 16))(x)
    x = layers.Conv2DTranspose(16, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Conv2DTranspose(8, 3, activation="relu", strides=2, padding="same")(x)
    decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")

    VAE = make_vae_class(Model)
    vae = VAE(encoder, decoder)
    vae.compile(optimizer=keras.optimizers.Adam())
    return vae


def train(vae, data):
    history = vae.fit(data, epochs=1, batch_size=32, verbose=0)
    z_mean, _, _ = vae.encoder.predict(data, batch_size=32, verbose=0)
    grid = np.linspace(-1, 1, 5).astype("float32")
    z_sample = np.stack(np.meshgrid(grid, grid), -1).reshape(-1, latent_dim)
    return {
        "history": history.history,
        "predict": {"z_mean": z_mean, "decoded": vae.decoder.predict(z_sample, verbose=0)},
    }
