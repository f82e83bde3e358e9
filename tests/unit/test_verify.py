"""`keras_dist.verify`: the user's own model trained on one device and under its strategy, compared and put back.

Each model is written as keras.io writes it (functional, a `train_step` of its own with `Mean` trackers,
the GAN with two optimizers in attributes); the failing ones have a real cause that `verify` must name
(unsynchronized BatchNormalization, Dropout, a loss scaled for the global batch, a metric that keeps
the last batch's value), and the fix it suggests must make the check pass.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

import keras_dist
from keras_dist.testing import assert_matches_single_device

GLOBAL_BATCH = 16


def _data(num_examples=48, features=6, classes=3, seed=0):
    rs = np.random.RandomState(seed)
    return rs.rand(num_examples, features).astype("float32"), rs.randint(0, classes, num_examples).astype("int32")


def _classifier(strategy, *, optimizer=None, middle=None, metrics=("accuracy",), hidden_bias=True):
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu", use_bias=hidden_bias, name="hidden")(inputs)
    for layer in middle or ():
        h = layer(h)
    outputs = keras.layers.Dense(3, name="logits")(h)
    model = keras_dist.DistributedModel(inputs, outputs, strategy=strategy)
    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=list(metrics),
    )
    return model


def _state(model):
    """Every number the model, its optimizer and metrics hold, per device copy, and the step functions."""
    from keras_dist._runtime import snapshots

    values = {}
    owned = [*model.variables, *model.metrics_variables, *model.optimizer.variables]
    for v in {id(v): v for v in owned}.values():
        for j, component in enumerate(snapshots.local_components(v.value)):
            values[(id(v), v.path, j)] = np.array(component.numpy())
    functions = (model.train_function, model.test_function, model.predict_function)
    return values, functions, model.distribute_strategy, model.optimizer.built, model.stop_training


def _assert_same_state(before, after, *, built_by_verify=()):
    """`built_by_verify`: variables `verify` may add, as `fit` builds them (compile metrics' state), at 0."""
    values_before, *rest_before = before
    values_after, *rest_after = after
    added = set(values_after) - set(values_before)
    assert set(values_before) <= set(values_after)
    assert {path for _, path, _ in added} <= set(built_by_verify), added
    assert all(not values_after[key].any() for key in added)
    for key, value in values_before.items():
        np.testing.assert_array_equal(values_after[key], value, err_msg=key)
    for a, b in zip(rest_before, rest_after):
        assert a is b or a == b, (a, b)


# ------------------------------------------------------------------ models that match one device


def test_functional_model_with_adam_passes(mirrored_1x2_cpu):
    x, y = _data()
    model = _classifier(mirrored_1x2_cpu)
    report = keras_dist.verify(model, x, y, batch_size=GLOBAL_BATCH)
    assert report.passed, str(report)
    assert report.likely_cause is None and report.explanation is None
    assert report.num_replicas == 2 and report.num_workers == 1 and report.strategy == "MirroredStrategy"
    assert report.global_batch_sizes == (16, 16, 16)
    assert "CPU:0" in report.reference_device
    paths = list(report.weight_differences)
    assert paths[:4] == ["hidden/kernel", "hidden/bias", "logits/kernel", "logits/bias"]
    # The optimizer's name depends on how many were made before in the process (adam, adam_51, ...).
    assert any(p.endswith("/iteration") for p in paths) and any(p.endswith("/hidden_kernel_momentum") for p in paths)
    assert report.max_weight_difference < 1e-5
    assert len(report.reference_logs) == len(report.logs) == 3
    assert set(report.logs[0]) == {"loss", "accuracy"}
    # Each step is its own epoch: three different losses, and every step really trained.
    assert len({round(step["loss"], 6) for step in report.reference_logs}) == 3
    text = str(report)
    assert "PASSED" in text and "atol=1e-05, rtol=1e-05" in text and "hidden/kernel" in text


def test_a_generator_of_batches_and_a_one_device_model_pass(mirrored_1x2_cpu):
    x, y = _data()
    generator = ((x[i : i + 16], y[i : i + 16]) for i in range(0, 48, 16))
    report = keras_dist.verify(_classifier(mirrored_1x2_cpu), generator, steps=2)
    assert report.passed and report.global_batch_sizes == (16, 16), str(report)
    assert next(generator)[0].shape == (16, 6)  # Two batches taken, the third left.
    one_device = keras_dist.verify(_classifier("one_device"), x, y, batch_size=GLOBAL_BATCH)
    assert one_device.passed and one_device.num_replicas == 1, str(one_device)


def test_keras_io_custom_train_step_on_an_uneven_split_passes(mirrored_1x3_cpu):
    """keras.io's "customizing what happens in fit": its own loss tracker and MAE metric; 16 = 6 + 5 + 5."""

    class CustomModel(keras_dist.DistributedModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = ops.mean(ops.square(y - y_pred))
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(gradients, self.trainable_variables)
            self.loss_tracker.update_state(loss)
            self.mae_metric.update_state(y, y_pred)
            return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

        @property
        def metrics(self):
            return [self.loss_tracker, self.mae_metric]

    inputs = keras.Input((6,))
    model = CustomModel(inputs, keras.layers.Dense(1)(inputs), strategy=mirrored_1x3_cpu)
    model.compile(optimizer=keras.optimizers.Adam(1e-2))
    x, _ = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, x.sum(1, keepdims=True))).batch(GLOBAL_BATCH)
    report = keras_dist.verify(model, dataset)
    assert report.passed, str(report)
    assert set(report.logs[0]) == {"loss", "mae"}
    assert report.num_replicas == 3


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1),
        lambda: keras.optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=2),
    ],
    ids=["sgd_momentum", "adamw", "sgd_accumulating"],
)
def test_other_optimizers_with_sample_weights_pass(mirrored_1x2_cpu, optimizer):
    x, y = _data()
    weights = np.random.RandomState(1).rand(len(x)).astype("float32")
    model = _classifier(mirrored_1x2_cpu, optimizer=optimizer())
    model.fit(x[:16], y[:16], batch_size=GLOBAL_BATCH, verbose=0)  # Mid-cycle when accumulating: 1 of 2.
    before = _state(model)
    report = keras_dist.verify(model, x, y, sample_weight=weights, batch_size=GLOBAL_BATCH, steps=2)
    assert report.passed, str(report)
    assert len(report.logs) == 2
    _assert_same_state(before, _state(model))
    slots = [p for p in report.weight_differences if "momentum" in p or "velocity" in p]
    assert slots, list(report.weight_differences)


def test_gan_with_two_optimizers_in_attributes_passes_and_they_stay_unbuilt(mirrored_1x2_cpu):
    """keras.io's GAN: no `call`, `d_optimizer`/`g_optimizer` built in the first step; not built before `verify`."""
    from tests.unit.test_model_styles import _gan, _gan_data, _with_strategy

    model = _gan(_with_strategy(mirrored_1x2_cpu), {})
    real, latent = _gan_data()
    report = keras_dist.verify(model, tf.data.Dataset.from_tensor_slices((real, latent)).batch(8), steps=2)
    assert report.passed, str(report)
    assert any(p.startswith(model.d_optimizer.name) for p in report.weight_differences)
    assert set(report.logs[0]) == {"d_loss", "g_loss"}
    assert not model.d_optimizer.built and not model.g_optimizer.built
    assert model.train_function is None


def _images_only_gan(strategy):
    """keras.io's DCGAN (`train_step(self, real_images)`, a dataset of images only, no labels).

    keras.io draws the latent vectors with `keras.random.normal`; here they are the first two
    pixels of each image, so that one device and 2 replicas see the same numbers.
    """

    class GAN(keras_dist.DistributedModel):
        def __init__(self, discriminator, generator):
            super().__init__(strategy=strategy)
            self.discriminator, self.generator = discriminator, generator
            self.d_loss_metric = keras.metrics.Mean(name="d_loss")
            self.g_loss_metric = keras.metrics.Mean(name="g_loss")

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

        @property
        def metrics(self):
            return [self.d_loss_metric, self.g_loss_metric]

        def train_step(self, real_images):
            batch_size = ops.shape(real_images)[0]
            latent = real_images[:, :2] * 2.0 - 1.0  # keras.io: keras.random.normal((batch_size, latent_dim), ...)
            generated_images = self.generator(latent)
            combined_images = ops.concatenate([generated_images, real_images], axis=0)
            labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
            with tf.GradientTape() as tape:
                d_loss = self.loss_fn(labels, self.discriminator(combined_images))
            grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
            self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
            misleading_labels = ops.zeros((batch_size, 1))
            with tf.GradientTape() as tape:
                g_loss = self.loss_fn(misleading_labels, self.discriminator(self.generator(latent)))
            grads = tape.gradient(g_loss, self.generator.trainable_weights)
            self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
            self.d_loss_metric.update_state(d_loss)
            self.g_loss_metric.update_state(g_loss)
            return {"d_loss": self.d_loss_metric.result(), "g_loss": self.g_loss_metric.result()}

    discriminator = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(4), keras.layers.LeakyReLU(0.2), keras.layers.Dense(1)],
        name="discriminator",
    )
    generator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(6, activation="tanh")], name="generator")
    gan = GAN(discriminator, generator)
    gan.compile(
        d_optimizer=keras.optimizers.Adam(3e-3),
        g_optimizer=keras.optimizers.Adam(3e-3),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    return gan


def test_keras_io_dcgan_on_images_only_passes_after_fit(mirrored_1x2_cpu):
    """`fit` hands `train_step` the bare images; `verify` must too (not a 1-tuple), from a dataset or arrays."""
    images, _ = _data()
    model = _images_only_gan(mirrored_1x2_cpu)
    dataset = tf.data.Dataset.from_tensor_slices(images).batch(GLOBAL_BATCH)
    model.fit(dataset, epochs=1, verbose=0)
    report = keras_dist.verify(model, dataset, steps=2)
    assert report.passed, str(report)
    assert set(report.logs[0]) == {"d_loss", "g_loss"}
    assert keras_dist.verify(model, images, batch_size=GLOBAL_BATCH, steps=2).passed


def _structure(data):
    """What `train_step` received, as a nest of names: `"tensor"`, `("tuple", (...))`, `{"a": ...}`."""
    if isinstance(data, dict):
        return {key: _structure(value) for key, value in data.items()}
    if isinstance(data, (tuple, list)):
        return type(data).__name__, tuple(_structure(d) for d in data)
    return "tensor"


_SEEN = []  # Not an attribute of the model: `verify` puts those back as they were.


class RecordingModel(keras_dist.DistributedModel):
    """Records the structure of every batch `train_step` is traced with (in `_SEEN`); trains on its own loss."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dense = keras.layers.Dense(4)

    def call(self, x):
        return self.dense(x["a"] + x["b"] if isinstance(x, dict) else x)

    def train_step(self, data):
        _SEEN.append(repr(_structure(data)))
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            error = ops.square(self(x, training=True) - (0.0 if y is None else y))
            loss = ops.mean(error if sample_weight is None else error * ops.expand_dims(sample_weight, -1))
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return {"l": loss}


class _Batches(keras.utils.PyDataset):
    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, index):
        return self.batches[index]


def _data_forms():
    """`(name, arguments of fit and verify)` for every form of data `fit` accepts (a fresh generator each call)."""
    rs = np.random.RandomState(5)
    x, y, w = rs.rand(48, 4).astype("float32"), rs.rand(48, 4).astype("float32"), rs.rand(48).astype("float32")
    d = {"a": x, "b": y}
    slices, b = tf.data.Dataset.from_tensor_slices, GLOBAL_BATCH
    return {
        "arrays_x": lambda: ((x,), {"batch_size": b}),
        "arrays_x_y": lambda: ((x, y), {"batch_size": b}),
        "arrays_x_y_weights": lambda: ((x, y), {"batch_size": b, "sample_weight": w}),
        "arrays_dict_x_y": lambda: ((d, y), {"batch_size": b}),
        "arrays_dict_x": lambda: ((d,), {"batch_size": b}),
        "dataset_of_tensors": lambda: ((slices(x).batch(b),), {}),
        "dataset_of_1_tuples": lambda: ((slices((x,)).batch(b),), {}),
        "dataset_x_y": lambda: ((slices((x, y)).batch(b),), {}),
        "dataset_x_y_weights": lambda: ((slices((x, y, w)).batch(b),), {}),
        "dataset_of_dicts": lambda: ((slices(d).batch(b),), {}),
        "dataset_dict_x_y": lambda: ((slices((d, y)).batch(b),), {}),
        "generator_of_1_tuples": lambda: ((((x[i : i + b],) for i in range(0, 48, b)),), {}),
        "generator_x_y": lambda: ((((x[i : i + b], y[i : i + b]) for i in range(0, 48, b)),), {}),
        "py_dataset_of_arrays": lambda: ((_Batches([x[i : i + b] for i in range(0, 48, b)]),), {}),
        "py_dataset_of_lists": lambda: ((_Batches([[x[i : i + b], y[i : i + b]] for i in range(0, 48, b)]),), {}),
    }


@pytest.mark.parametrize("form", list(_data_forms()))
def test_train_step_gets_what_fit_gives_it_for_every_form_of_data(mirrored_1x2_cpu, form):
    """Keras hands `train_step` a bare `x` for arrays and a dataset of tensors, `(x,)` for a dataset of
    1-tuples and a PyDataset of arrays, dicts as they are: `verify` hands it the same, in both runs."""
    make = _data_forms()[form]
    model = RecordingModel(strategy=mirrored_1x2_cpu)
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    args, kwargs = make()
    _SEEN.clear()
    model.fit(*args, **kwargs, epochs=1, verbose=0, shuffle=False)
    from_fit = set(_SEEN)
    assert len(from_fit) == 1, from_fit
    _SEEN.clear()
    args, kwargs = make()
    report = keras_dist.verify(model, *args, steps=2, **kwargs)
    assert set(_SEEN) == from_fit, form
    assert report.passed, str(report)
    assert report.global_batch_sizes == (16, 16)


# ------------------------------------------------------------------ models that do not, and why


def test_unsynchronized_batch_normalization_is_found_and_synchronized_passes(mirrored_1x2_cpu):
    x, y = _data()
    model = _classifier(mirrored_1x2_cpu, middle=[keras.layers.BatchNormalization(name="norm")])
    report = keras_dist.verify(model, x, y, batch_size=GLOBAL_BATCH)
    assert not report.passed
    assert report.likely_cause == "unsynchronized_batch_normalization", str(report)
    assert "['norm']" in report.explanation and "synchronized=True" in report.explanation
    assert "8 examples" in report.explanation and "global batch of 16" in report.explanation
    assert "norm/moving_variance" in report.over_tolerance
    assert "step 1: loss" in report.logs_over_tolerance  # The first forward pass already differs.
    text = str(report)
    assert "DIFFERS" in text and "likely cause: unsynchronized_batch_normalization" in text

    synchronized = [keras.layers.BatchNormalization(synchronized=True, name="norm")]
    fixed = _classifier(mirrored_1x2_cpu, middle=synchronized, hidden_bias=False)
    fixed_report = keras_dist.verify(fixed, x, y, batch_size=GLOBAL_BATCH)
    assert fixed_report.passed, str(fixed_report)


def test_a_bias_before_batch_normalization_under_adam_is_found(mirrored_1x2_cpu):
    """Its gradient is rounding noise, which Adam scales up to full steps: weights differ, every log agrees."""
    x, y = _data()
    synchronized = [keras.layers.BatchNormalization(synchronized=True, name="norm")]
    model = _classifier(mirrored_1x2_cpu, middle=synchronized)
    report = keras_dist.verify(model, x, y, batch_size=GLOBAL_BATCH)
    assert not report.passed and not report.logs_over_tolerance
    assert report.likely_cause == "zero_gradient_noise", str(report)
    assert report.over_tolerance[0] == "hidden/bias"
    assert set(report.over_tolerance) <= {"hidden/bias", "norm/moving_mean"}  # The mean follows the bias.
    assert "use_bias=False" in report.explanation and "Adam" in report.explanation


def test_dropout_is_found_and_passes_with_random_layers_off(mirrored_1x2_cpu):
    x, y = _data()
    dropout = keras.layers.Dropout(0.5, name="drop")
    model = _classifier(mirrored_1x2_cpu, middle=[dropout])
    report = keras_dist.verify(model, x, y, batch_size=GLOBAL_BATCH)
    assert not report.passed
    assert report.likely_cause == "random_layers", str(report)
    assert "['drop']" in report.explanation and "random_layers='off'" in report.explanation

    off = keras_dist.verify(model, x, y, batch_size=GLOBAL_BATCH, random_layers="off")
    assert off.passed, str(off)
    assert off.random_layers == "off" and "random layers off" in str(off)
    assert dropout.rate == 0.5


def _guide_model(strategy, *, log_mean=False, rows_by_hand=False):
    """TensorFlow's custom-training guide in a `train_step`: `compute_average_loss(..., global_batch_size=16)`.

    `rows_by_hand`: the same scaling written as `ops.mean(per_example) * rows / 16`, a form keras-dist does not
    read as a sum over the batch (`compute_average_loss`'s `reduce_sum / 16` counts once per replica by default).
    """

    class GuideModel(keras_dist.DistributedModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                per_example = keras.losses.sparse_categorical_crossentropy(y, self(x, training=True), from_logits=True)
                if rows_by_hand:
                    rows = ops.cast(ops.shape(per_example)[0], "float32")
                    loss = ops.mean(per_example) * rows / GLOBAL_BATCH
                else:
                    loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
            self.loss_tracker.update_state(ops.mean(per_example) if log_mean else loss)
            return {"loss": self.loss_tracker.result()}

        @property
        def metrics(self):
            return [self.loss_tracker]

    inputs = keras.Input((6,))
    model = GuideModel(inputs, keras.layers.Dense(3)(inputs), strategy=strategy)
    model.compile(optimizer=keras.optimizers.SGD(0.5))
    return model


def test_a_loss_written_for_global_batch_scaling_is_found(mirrored_1x2_cpu):
    x, y = _data()
    assert keras_dist.verify(_guide_model(mirrored_1x2_cpu), x, y, batch_size=GLOBAL_BATCH).passed  # Read as a sum.
    model = _guide_model(mirrored_1x2_cpu, rows_by_hand=True)
    report = keras_dist.verify(model, x, y, batch_size=GLOBAL_BATCH)
    assert not report.passed and report.over_tolerance  # Gradients halved: the weights differ.
    assert report.likely_cause == "global_batch_loss", str(report)
    assert "custom_step_losses = 'global'" in report.explanation and "off by the 2 replicas" in report.explanation
    assert report.logs[0]["loss"] / report.reference_logs[0]["loss"] == pytest.approx(0.5, rel=1e-4)

    model.custom_step_losses = "global"  # The fix the report names: the gradients now match, the log does not.
    half_fixed = keras_dist.verify(model, x, y, batch_size=GLOBAL_BATCH)
    assert not half_fixed.passed and not half_fixed.over_tolerance
    assert half_fixed.likely_cause == "global_batch_loss", str(half_fixed)
    assert "log the mean over the step's own examples" in half_fixed.explanation

    fixed = _guide_model(mirrored_1x2_cpu, log_mean=True)
    fixed.custom_step_losses = "global"
    assert keras_dist.verify(fixed, x, y, batch_size=GLOBAL_BATCH).passed


def test_a_metric_that_keeps_the_last_batch_value_is_found(mirrored_1x2_cpu):
    class LargestError(keras.metrics.Metric):
        """The batch's largest error, overwritten every batch (not accumulated)."""

        def __init__(self, name="largest_error"):
            super().__init__(name=name)
            self.value = self.add_variable(shape=(), initializer="zeros", name="value")

        def update_state(self, y_true, y_pred, sample_weight=None):
            self.value.assign(ops.max(ops.abs(ops.cast(y_true, "float32") - ops.max(y_pred, axis=-1))))

        def result(self):
            return self.value

    x, y = _data()
    model = _classifier(mirrored_1x2_cpu, metrics=[LargestError()])
    report = keras_dist.verify(model, x, y, batch_size=GLOBAL_BATCH)
    assert not report.passed and not report.over_tolerance
    assert report.likely_cause == "batch_level_metric", str(report)
    assert "largest_error" in report.explanation
    assert all(entry.endswith("largest_error") for entry in report.logs_over_tolerance)


@pytest.mark.parametrize("onednn", ["1", "0"])
def test_tiny_differences_name_onednn_only_when_it_is_on(mirrored_1x3_cpu, monkeypatch, onednn):
    """With no tolerance at all, float rounding between 16 examples and 6 + 5 + 5 is over it.

    The session runs with oneDNN off (TensorFlow reads the setting once, at start): here `verify` is
    told it is on or off, as TensorFlow would tell it.
    """
    from keras_dist._runtime import devices

    assert devices.onednn_enabled() == (os.environ["TF_ENABLE_ONEDNN_OPTS"] == "1")  # Set before TensorFlow started.
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", onednn)
    monkeypatch.setattr(devices, "onednn_enabled", lambda: onednn == "1")
    x, y = _data()
    model = _classifier(mirrored_1x3_cpu)
    report = keras_dist.verify(model, x, y, batch_size=GLOBAL_BATCH, atol=0.0, rtol=0.0)
    assert not report.passed and report.max_weight_difference < 1e-5
    assert report.likely_cause == ("onednn" if onednn == "1" else "unknown"), str(report)
    if onednn == "1":
        assert "TF_ENABLE_ONEDNN_OPTS=0" in report.explanation


# ------------------------------------------------------------------ the model is left as it was


@pytest.mark.parametrize("trained_before", [True, False], ids=["trained_before", "never_trained"])
def test_leaves_the_model_as_it_was_and_a_later_fit_gives_the_same_numbers(mirrored_1x2_cpu, trained_before):
    """Dropout too: each replica's seed state (decorrelated per replica) must come back."""
    x, y = _data()

    def build():
        keras.utils.set_random_seed(7)
        return _classifier(
            mirrored_1x2_cpu,
            optimizer=keras.optimizers.Adam(1e-2),
            middle=[keras.layers.Dropout(0.3), keras.layers.BatchNormalization()],
        )

    checked, untouched = build(), build()
    for model in (checked, untouched):
        if trained_before:
            model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    before = _state(checked)
    keras_dist.verify(checked, x, y, batch_size=GLOBAL_BATCH)
    keras_dist.verify(checked, x, y, batch_size=8, random_layers="off", steps=2)
    compile_metrics = () if trained_before else ("accuracy/total", "accuracy/count")
    _assert_same_state(before, _state(checked), built_by_verify=compile_metrics)
    assert checked.optimizer.built == trained_before
    assert int(checked.optimizer.iterations.numpy()) == (3 if trained_before else 0)

    histories = [m.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0).history for m in (checked, untouched)]
    assert histories[0] == histories[1]
    for a, b in zip(checked.get_weights(), untouched.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(checked.optimizer.variables, untouched.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


# ------------------------------------------------------------------ the testing helper, arguments


def test_assert_matches_single_device_takes_a_built_model(mirrored_1x2_cpu):
    x, y = _data()
    report = assert_matches_single_device(_classifier(mirrored_1x2_cpu), x, y, batch_size=GLOBAL_BATCH)
    assert report.passed
    model = _classifier(mirrored_1x2_cpu, middle=[keras.layers.BatchNormalization(name="norm")])
    with pytest.raises(AssertionError, match="likely cause: unsynchronized_batch_normalization"):
        assert_matches_single_device(model, x, y, batch_size=GLOBAL_BATCH)
    with pytest.raises(ValueError, match="train"):
        assert_matches_single_device(model, train=lambda m: None)


def test_arguments_are_checked(mirrored_1x2_cpu):
    x, y = _data()
    inputs = keras.Input((6,))
    plain = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    with pytest.raises(TypeError, match="keras_dist.distribute"):
        keras_dist.verify(plain, x, y)
    uncompiled = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy=mirrored_1x2_cpu)
    with pytest.raises(ValueError, match="compile"):
        keras_dist.verify(uncompiled, x, y)
    model = _classifier(mirrored_1x2_cpu)
    with pytest.raises(ValueError, match="steps"):
        keras_dist.verify(model, x, y, steps=0)
    with pytest.raises(ValueError, match="random_layers"):
        keras_dist.verify(model, x, y, random_layers="none")
    with pytest.raises(ValueError, match="needs data"):
        keras_dist.verify(model)
    with pytest.raises(ValueError, match="single examples"):
        keras_dist.verify(model, tf.data.Dataset.from_tensor_slices((x, y)))


def test_the_report_copies_and_pickles(mirrored_1x2_cpu):
    import copy
    import dataclasses
    import pickle

    x, y = _data()
    report = keras_dist.verify(_classifier(mirrored_1x2_cpu), x, y, batch_size=GLOBAL_BATCH, steps=1)
    assert pickle.loads(pickle.dumps(report)) == report == copy.deepcopy(report)
    assert dataclasses.asdict(report)["weight_differences"] == dict(report.weight_differences)
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.passed = False
    assert set(keras_dist.VerifyReport.CAUSES) >= {"unsynchronized_batch_normalization", "random_layers", "onednn"}
