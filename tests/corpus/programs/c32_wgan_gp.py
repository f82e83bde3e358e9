"""keras.io "WGAN-GP overriding `Model.train_step`" (generative/wgan_gp), scaled down.

One-line change: `class WGAN(keras.Model)` -> `class WGAN(keras_dist.DistributedModel)`; the
discriminator and generator stay plain `keras.Sequential`s.
Changed for the comparison: the latent vectors and the interpolation weights, which keras.io draws
with `tf.random.normal` / `tf.random.uniform` in the step (each replica would draw its own), come
with each example in the data (`RANDOM_FROM_DATA`); `call` added so that `predict` has an output.
Covers: a `compile` of its own with two Adam optimizers and loss functions, 3 discriminator steps
per generator step, the gradient penalty's inner tape with respect to the interpolated images
(an input's gradient: before keras-dist left input gradients alone, it came back times the
replicas on the uneven last batch, d_loss 1.07 against 2.10), raw `{"d_loss", "g_loss"}` logs.
101 examples at batch 16 (last batch 5), 2 epochs.
"""

import keras
import numpy as np
import tensorflow as tf

CHANGE = "subclass"
RANDOM_FROM_DATA = True  # keras.io: tf.random.normal / tf.random.uniform inside train_step
LATENT_DIM = 6  # keras.io: 128
D_STEPS = 3


def make_wgan_class(Model):
    # keras_dist: class WGAN(keras.Model) -> class WGAN(keras_dist.DistributedModel) (`Model` is either)
    class WGAN(Model):
        def __init__(self, discriminator, generator, latent_dim, discriminator_extra_steps=3, gp_weight=10.0):
            super().__init__()
            self.discriminator = discriminator
            self.generator = generator
            self.latent_dim = latent_dim
            self.d_steps = discriminator_extra_steps
            self.gp_weight = gp_weight

        def call(self, inputs):
            return self.discriminator(self.generator(inputs["z"][:, : self.latent_dim]))

        def compile(self, d_optimizer, g_optimizer, d_loss_fn, g_loss_fn):
            super().compile()
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer
            self.d_loss_fn = d_loss_fn
            self.g_loss_fn = g_loss_fn

        def gradient_penalty(self, batch_size, real_images, fake_images, alpha):
            """Calculates the gradient penalty on an interpolated image, added to the discriminator loss."""
            alpha = tf.reshape(alpha, [batch_size, 1, 1, 1])
            diff = fake_images - real_images
            interpolated = real_images + alpha * diff

            with tf.GradientTape() as gp_tape:
                gp_tape.watch(interpolated)
                # 1. Get the discriminator output for this interpolated image.
                pred = self.discriminator(interpolated, training=True)

            # 2. Calculate the gradients w.r.t to this interpolated image.
            grads = gp_tape.gradient(pred, [interpolated])[0]
            # 3. Calculate the norm of the gradients.
            norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1, 2, 3]))
            gp = tf.reduce_mean((norm - 1.0) ** 2)
            return gp

        def train_step(self, data):
            real_images, latents, alphas = data["img"], data["z"], data["alpha"]
            batch_size = tf.shape(real_images)[0]

            for i in range(self.d_steps):
                random_latent_vectors = latents[:, i * self.latent_dim : (i + 1) * self.latent_dim]
                with tf.GradientTape() as tape:
                    fake_images = self.generator(random_latent_vectors, training=True)
                    fake_logits = self.discriminator(fake_images, training=True)
                    real_logits = self.discriminator(real_images, training=True)
                    d_cost = self.d_loss_fn(real_img=real_logits, fake_img=fake_logits)
                    gp = self.gradient_penalty(batch_size, real_images, fake_images, alphas[:, i])
                    d_loss = d_cost + gp * self.gp_weight

                d_gradient = tape.gradient(d_loss, self.discriminator.trainable_variables)
                self.d_optimizer.apply_gradients(zip(d_gradient, self.discriminator.trainable_variables))

            random_latent_vectors = latents[:, self.d_steps * self.latent_dim :]
            with tf.GradientTape() as tape:
                generated_images = self.generator(random_latent_vectors, training=True)
                gen_img_logits = self.discriminator(generated_images, training=True)
                g_loss = self.g_loss_fn(gen_img_logits)

            gen_gradient = tape.gradient(g_loss, self.generator.trainable_variables)
            self.g_optimizer.apply_gradients(zip(gen_gradient, self.generator.trainable_variables))
            return {"d_loss": d_loss, "g_loss": g_loss}

    return WGAN


def discriminator_loss(real_img, fake_img):
    real_loss = tf.reduce_mean(real_img)
    fake_loss = tf.reduce_mean(fake_img)
    return fake_loss - real_loss


def generator_loss(fake_img):
    return -tf.reduce_mean(fake_img)


def data():
    rs = np.random.RandomState(32)
    images = rs.rand(101, 4, 4, 1).astype("float32") * 2 - 1  # keras.io: Fashion-MNIST, 28x28 in [-1, 1]
    latents = rs.randn(101, (D_STEPS + 1) * LATENT_DIM).astype("float32")
    alphas = rs.rand(101, D_STEPS).astype("float32")
    return {"img": images, "z": latents, "alpha": alphas}


def build(Model, distribute):
    WGAN = make_wgan_class(Model)
    d_model = keras.Sequential(
        [
            keras.Input((4, 4, 1)),
            keras.layers.Conv2D(4, 3, padding="same"),
            keras.layers.LeakyReLU(0.2),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )
    g_model = keras.Sequential(
        [
            keras.Input((LATENT_DIM,)),
            keras.layers.Dense(16),
            keras.layers.LeakyReLU(0.2),
            keras.layers.Reshape((4, 4, 1)),
            keras.layers.Conv2D(1, 3, padding="same", activation="tanh"),
        ]
    )
    wgan = WGAN(discriminator=d_model, generator=g_model, latent_dim=LATENT_DIM, discriminator_extra_steps=D_STEPS)
    wgan.compile(
        d_optimizer=keras.optimizers.Adam(learning_rate=0.0002, beta_1=0.5, beta_2=0.9),
        g_optimizer=keras.optimizers.Adam(learning_rate=0.0002, beta_1=0.5, beta_2=0.9),
        g_loss_fn=generator_loss,
        d_loss_fn=discriminator_loss,
    )
    wgan({k: v[:1] for k, v in data().items()})
    return wgan


def train(model, data):
    history = model.fit(data, batch_size=16, epochs=2, verbose=0)
    return {"history": history.history, "predict": model.predict({k: v[:16] for k, v in data.items()}, verbose=0)}
