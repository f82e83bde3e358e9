"""Model styles from keras.io, each trained with DistributedModel and compared with plain Keras on one device.

Subclasses whose constructor takes parts positionally (`VAE(encoder, decoder)`,
`GAN(discriminator, generator)`), a subclass that passes `(inputs, outputs)`
on to `super().__init__`, a GAN without `call()` that keeps two optimizers of
its own, and wrapper optimizers (`MultiOptimizer`) created outside any scope.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from _support import sum_regression

import keras_dist
from keras_dist.testing import max_weight_difference

Functional = keras.src.models.functional.Functional


def _two_parts(base):
    class TwoParts(base):
        """keras.io's VAE(encoder, decoder) / Distiller(student, teacher) constructor."""

        def __init__(self, first, second, **kwargs):
            super().__init__(**kwargs)
            self.first, self.second = first, second

        def call(self, x):
            return self.second(self.first(x))

    return TwoParts


def _fit_pair(make, strategy, *, batch_size=8, epochs=2):
    """Fits `make(keras.Model, {})` on one device and `make(DistributedModel, {"strategy": ...})` from the same weights."""
    x, y = sum_regression(16, 3)
    keras.utils.set_random_seed(7)
    reference = make(keras.Model, {})
    keras.utils.set_random_seed(7)
    model = make(keras_dist.DistributedModel, {"strategy": strategy})
    for m in (reference, model):
        m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    for m in (reference, model):
        m(x[:1])  # Builds a subclass's layers, to copy the weights.
    model.set_weights(reference.get_weights())
    logs = [
        m.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0).history for m in (reference, model)
    ]
    return reference, model, logs


@pytest.mark.parametrize("style", ["positional", "keywords"])
def test_subclass_with_two_parts(mirrored_1x2_cpu, style):
    def make(base, kwargs):
        first, second = keras.layers.Dense(4), keras.layers.Dense(1)
        cls = _two_parts(base)
        return cls(first, second, **kwargs) if style == "positional" else cls(first=first, second=second, **kwargs)

    reference, model, (expected, got) = _fit_pair(make, mirrored_1x2_cpu)
    assert not isinstance(model, Functional)
    assert model.distribute_strategy is mirrored_1x2_cpu
    assert max_weight_difference(reference, model) < 1e-5
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5)


def test_subclass_passing_inputs_and_outputs_to_super(mirrored_1x2_cpu):
    """keras.io's "subclass a functional model": `__init__` builds the graph and calls `super().__init__(inputs, outputs)`."""

    def make(base, kwargs):
        class Regressor(base):
            def __init__(self, units, **kwargs):
                inputs = keras.Input((3,))
                outputs = keras.layers.Dense(1)(keras.layers.Dense(units, activation="relu")(inputs))
                super().__init__(inputs, outputs, **kwargs)
                self.units = units

        return Regressor(4, name="regressor", **kwargs)

    reference, model, (expected, got) = _fit_pair(make, mirrored_1x2_cpu)
    assert isinstance(model, Functional) and type(model).__name__ == "Regressor"
    assert model.units == 4 and model.name == "regressor"
    assert max_weight_difference(reference, model) < 1e-5
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5)
    # Only the instance became functional: the classes stay usable for subclassing.
    assert not issubclass(keras_dist.DistributedModel, Functional)
    assert not isinstance(
        _two_parts(keras_dist.DistributedModel)(keras.layers.Dense(1), keras.layers.Dense(1)), Functional
    )


def test_subclass_without_init_stays_functional_from_its_arguments(mirrored_1x2_cpu):
    class Plain(keras_dist.DistributedModel):
        pass

    inputs = keras.Input((3,))
    model = Plain(inputs, keras.layers.Dense(1)(inputs), strategy=mirrored_1x2_cpu)
    assert isinstance(model, Functional) and isinstance(model, Plain)
    assert not issubclass(Plain, Functional)


# ------------------------------------------------------------------ the keras.io GAN
def _gan_class(base):
    class GAN(base):
        """keras.io's GAN (no `call()`, its own `compile`, two optimizers, `Mean` trackers).

        The latent vectors come with the data (keras.io draws them with
        `keras.random.normal`), so that one device and N replicas see the same numbers.
        """

        def __init__(self, discriminator, generator, latent_dim):
            super().__init__()
            self.discriminator, self.generator, self.latent_dim = discriminator, generator, latent_dim
            self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
            self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

        @property
        def metrics(self):
            return [self.d_loss_tracker, self.g_loss_tracker]

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

        def train_step(self, data):
            real, latent = data
            batch_size = tf.shape(real)[0]
            generated = self.generator(latent)
            combined = tf.concat([generated, real], axis=0)
            labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
            with tf.GradientTape() as tape:
                d_loss = self.loss_fn(labels, self.discriminator(combined))
            grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
            self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
            misleading = tf.zeros((batch_size, 1))
            with tf.GradientTape() as tape:
                g_loss = self.loss_fn(misleading, self.discriminator(self.generator(latent)))
            grads = tape.gradient(g_loss, self.generator.trainable_weights)
            self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
            self.d_loss_tracker.update_state(d_loss)
            self.g_loss_tracker.update_state(g_loss)
            return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}

    return GAN


def _gan(base, kwargs, *, latent_dim=2, optimizers=None):
    discriminator = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4), keras.layers.LeakyReLU(0.2), keras.layers.Dense(1)],
        name="discriminator",
    )
    generator = keras.Sequential([keras.Input((latent_dim,)), keras.layers.Dense(3)], name="generator")
    gan = _gan_class(base)(discriminator, generator, latent_dim=latent_dim, **kwargs)
    d_optimizer, g_optimizer = optimizers() if optimizers else (keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1))
    gan.compile(
        d_optimizer=d_optimizer, g_optimizer=g_optimizer, loss_fn=keras.losses.BinaryCrossentropy(from_logits=True)
    )
    return gan


def _gan_data(num_examples=16, latent_dim=2):
    rs = np.random.RandomState(3)
    return rs.rand(num_examples, 3).astype("float32"), rs.randn(num_examples, latent_dim).astype("float32")


def _fit_gan(strategy, **gan_kwargs):
    """Returns (reference, model, reference logs, model logs): the same GAN on one device and under `strategy`."""
    real, latent = _gan_data()
    reference = _gan(keras.Model, {}, **gan_kwargs)
    model = _gan(_with_strategy(strategy), {}, **gan_kwargs)
    model.set_weights(reference.get_weights())
    dataset = tf.data.Dataset.from_tensor_slices((real, latent)).batch(8)
    logs = [m.fit(dataset, epochs=2, verbose=0).history for m in (reference, model)]
    return reference, model, *logs


def _with_strategy(strategy):
    """A DistributedModel base class whose `super().__init__()` (keras.io passes no arguments) uses `strategy`."""

    class OnStrategy(keras_dist.DistributedModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, strategy=strategy, **kwargs)

    return OnStrategy


@pytest.mark.parametrize(
    "optimizers",
    [
        lambda: (keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1)),
        lambda: (keras.optimizers.SGD(0.1, global_clipnorm=0.05), keras.optimizers.SGD(0.1, clipnorm=0.01)),
    ],
    ids=["sgd", "sgd_clipped"],
)
def test_gan_matches_one_device(mirrored_1x2_cpu, optimizers):
    reference, model, expected, got = _fit_gan(mirrored_1x2_cpu, optimizers=optimizers)
    assert not isinstance(model, Functional)
    for optimizer in (model.d_optimizer, model.g_optimizer):
        assert optimizer._distribution_strategy is mirrored_1x2_cpu
        assert int(optimizer.iterations.numpy()) == 4
        assert all(isinstance(v.value, tf.distribute.DistributedValues) for v in optimizer.variables)
    assert max_weight_difference(reference, model) < 1e-5
    assert set(got) == set(expected) == {"d_loss", "g_loss"}


def test_gan_logged_losses_match_one_device(mirrored_1x2_cpu):
    _, _, expected, got = _fit_gan(mirrored_1x2_cpu)
    for name in ("d_loss", "g_loss"):
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5)


@pytest.mark.parametrize("all_reduce", ["reduction_to_one_device", "collective"])
def test_gan_with_adam_in_attributes_matches_one_device(mirrored_1x2_cpu, mirrored_1x2_cpu_collective, all_reduce):
    """Adam's slots are created in the first step, on one device inside it, here outside the step function."""
    strategy = mirrored_1x2_cpu if all_reduce == "reduction_to_one_device" else mirrored_1x2_cpu_collective
    reference, model, _, _ = _fit_gan(
        strategy, optimizers=lambda: (keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.02))
    )
    assert max_weight_difference(reference, model) < 1e-5
    for ref_opt, opt in ((reference.d_optimizer, model.d_optimizer), (reference.g_optimizer, model.g_optimizer)):
        # The paths Keras gives the slots when it builds in the first step (unique-name suffixes aside).
        names = [[re.sub(r"_\d+", "", v.path) for v in o.variables] for o in (opt, ref_opt)]
        assert names[0] == names[1]
        for a, b in zip(ref_opt.variables, opt.variables, strict=True):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("all_reduce", ["reduction_to_one_device", "collective"])
def test_model_without_call_with_unbuilt_parts_matches_one_device(
    mirrored_1x2_cpu, mirrored_1x2_cpu_collective, all_reduce
):
    """No `call()` and parts without `keras.Input`: built in the first step, as on one device (and Adam with them)."""
    strategy = mirrored_1x2_cpu if all_reduce == "reduction_to_one_device" else mirrored_1x2_cpu_collective

    def make(base):
        class NoCall(base):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.part = keras.Sequential([keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])

            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    loss = keras.losses.MeanSquaredError()(y, self.part(x))
                self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
                return {"loss": loss}

        model = NoCall()
        model.compile(optimizer=keras.optimizers.Adam(0.01))
        return model

    x, y = sum_regression(16, 3)
    keras.utils.set_random_seed(5)
    reference = make(keras.Model)
    keras.utils.set_random_seed(5)
    model = make(_with_strategy(strategy))
    for m in (reference, model):
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert all(
        isinstance(v.value, tf.distribute.DistributedValues) for v in [*model.weights, *model.optimizer.variables]
    )
    assert [re.sub(r"_\d+", "", v.path) for v in model.weights] == [
        re.sub(r"_\d+", "", v.path) for v in reference.weights
    ]
    assert max_weight_difference(reference, model) < 1e-5


# ------------------------------------------------------------------ wrapper optimizers
needs_multi_optimizer = pytest.mark.skipif(
    not hasattr(keras.optimizers, "MultiOptimizer"),
    reason=f"keras.optimizers.MultiOptimizer is new in Keras 3.15 (installed: {keras.__version__})",
)


def _multi_optimizer():
    o = keras.optimizers
    return o.MultiOptimizer(o.OptimizerMap(o.SGD(0.1), {"body/.*": o.Adam(0.01)}))


def _body_head(cls, kwargs):
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(1, name="head")(keras.layers.Dense(4, name="body")(inputs))
    return cls(inputs, outputs, **kwargs)


@needs_multi_optimizer
def test_multi_optimizer_created_outside_the_scope_is_placed(mirrored_1x2_cpu):
    model = _body_head(keras_dist.DistributedModel, {"strategy": mirrored_1x2_cpu})
    optimizer = _multi_optimizer()
    model.compile(optimizer=optimizer, loss="mse")
    x, y = sum_regression(16, 3)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert [o._distribution_strategy for o in (optimizer, *optimizer.optimizers)] == [mirrored_1x2_cpu] * 3
    assert all(isinstance(v.value, tf.distribute.DistributedValues) for v in optimizer.variables)
    assert [int(o.iterations.numpy()) for o in (optimizer, *optimizer.optimizers)] == [2, 2, 2]


@needs_multi_optimizer
def test_multi_optimizer_built_outside_the_scope_is_placed(mirrored_1x2_cpu):
    """Built before compile (slots, dispatch table keyed by the old variables): moved and re-indexed."""
    model = _body_head(keras_dist.DistributedModel, {"strategy": mirrored_1x2_cpu})
    reference = _body_head(keras.Model, {})
    reference.set_weights(model.get_weights())
    optimizer = _multi_optimizer()
    optimizer.build(model.trainable_variables)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = sum_regression(16, 3)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert all(isinstance(v.value, tf.distribute.DistributedValues) for v in optimizer.variables)
    assert [int(o.iterations.numpy()) for o in (optimizer, *optimizer.optimizers)] == [2, 2, 2]


@needs_multi_optimizer
def test_multi_optimizer_matches_one_device(mirrored_1x2_cpu):
    reference = _body_head(keras.Model, {})
    model = _body_head(keras_dist.DistributedModel, {"strategy": mirrored_1x2_cpu})
    model.set_weights(reference.get_weights())
    x, y = sum_regression(16, 3)
    for m in (reference, model):
        m.compile(optimizer=_multi_optimizer(), loss="mse")
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(reference, model) < 1e-5
