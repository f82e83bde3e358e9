"""jit_compile=True under a multi-replica strategy crashes in Keras (XLA compiles the step for one device and reaches a variable on another, keras-team/keras#19005); keras-dist compiles each replica's pass."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _support import sum_regression

import keras_dist
from keras_dist import _compat

pytestmark = pytest.mark.compat


def _model(strategy, hidden_layer=None):
    """A DistributedModel on `strategy`, or a plain `keras.Model` when `strategy` is None."""
    inputs = keras.Input((8,))
    hidden = (hidden_layer or keras.layers.Dense(16, activation="relu"))(inputs)
    outputs = keras.layers.Dense(1)(hidden)
    if strategy is None:
        return keras.Model(inputs, outputs)
    return keras_dist.DistributedModel(inputs, outputs, strategy=strategy)


NUM_EXAMPLES = 58  # Batches of 16, the last of 10: uneven over 3 replicas (4, 3, 3).


def _trained(strategy, jit_compile, epochs=2):
    keras.utils.set_random_seed(0)
    model = _model(strategy)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"], jit_compile=jit_compile)
    history = model.fit(*sum_regression(NUM_EXAMPLES, 8), batch_size=16, epochs=epochs, verbose=0, shuffle=False)
    return model, history.history


def test_without_fix_the_first_step_crashes(mirrored_1x2_cpu):
    with _compat.disabled("jit_compile_mirrored"):
        model = _model(mirrored_1x2_cpu)
        model.compile(optimizer="adam", loss="mse", jit_compile=True)
        with pytest.raises(Exception):  # noqa: B017 (TF raises several types here, by version)
            model.fit(*sum_regression(NUM_EXAMPLES, 8), batch_size=16, verbose=0)


@pytest.mark.parametrize("strategy_fixture", ["mirrored_1x2_cpu", "mirrored_1x3_cpu"])
def test_with_fix_each_replica_is_compiled_and_trains_like_one_device(request, strategy_fixture):
    strategy = request.getfixturevalue(strategy_fixture)
    expected, expected_history = _trained(None, jit_compile=False)
    model, history = _trained(strategy, jit_compile=True)
    assert model.__dict__["_keras_dist_forward_backward"] is not None  # The XLA path, not a silent fallback.
    for a, b in zip(model.get_weights(), expected.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    np.testing.assert_allclose(history["loss"], expected_history["loss"], rtol=1e-5)
    np.testing.assert_allclose(history["mae"], expected_history["mae"], rtol=1e-5)


class _NotCompilable(keras.layers.Layer):
    """Identity through `tf.numpy_function`, which XLA cannot compile."""

    def call(self, x):
        y = tf.numpy_function(lambda a: a, [x], tf.float32, stateful=False)
        return tf.reshape(y, tf.shape(x))


def test_with_fix_xla_really_compiles_the_replica_pass(mirrored_1x2_cpu):
    """An op XLA cannot compile fails with jit_compile=True, and trains without: XLA is really used."""
    model = _model(mirrored_1x2_cpu, hidden_layer=_NotCompilable())
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    with pytest.raises(Exception, match="(?i)xla|compil|unsupported"):
        model.fit(*sum_regression(NUM_EXAMPLES, 8), batch_size=16, verbose=0)
    model.compile(optimizer="sgd", loss="mse", jit_compile=False)
    model.fit(*sum_regression(NUM_EXAMPLES, 8), batch_size=16, verbose=0)


def test_auto_and_run_eagerly_do_not_compile(mirrored_1x2_cpu):
    model = _model(mirrored_1x2_cpu)
    model.compile(optimizer="sgd", loss="mse")
    assert model.jit_compile is False
    model.fit(*sum_regression(NUM_EXAMPLES, 8), batch_size=16, verbose=0)
    assert model.__dict__["_keras_dist_forward_backward"] is None
    model.compile(optimizer="sgd", loss="mse", jit_compile=True, run_eagerly=True)
    model.fit(*sum_regression(NUM_EXAMPLES, 8), batch_size=16, verbose=0)
    assert model.__dict__["_keras_dist_forward_backward"] is None


def test_an_overriding_train_step_is_refused_with_the_fix(mirrored_1x2_cpu):
    class OwnStep(keras_dist.DistributedModel):
        def train_step(self, data):
            return super().train_step(data)

    inputs = keras.Input((8,))
    model = OwnStep(inputs, keras.layers.Dense(1)(inputs), strategy=mirrored_1x2_cpu)
    with pytest.raises(ValueError, match=r"OwnStep.train_step.*Fix: pass `jit_compile=False`"):
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)


def _cnn(strategy, dropout):
    inputs = keras.Input((6, 6, 3))
    hidden = keras.layers.Conv2D(4, 3)(inputs)
    hidden = keras.layers.BatchNormalization()(hidden)
    hidden = keras.layers.Activation("relu")(hidden)
    if dropout:
        hidden = keras.layers.Dropout(0.25, seed=7)(hidden)
    outputs = keras.layers.Dense(5)(keras.layers.GlobalAveragePooling2D()(hidden))
    return keras_dist.DistributedModel(inputs, outputs, strategy=strategy)


@pytest.mark.parametrize("dropout", [False, True])
def test_with_fix_layer_state_updates_match_the_uncompiled_step(mirrored_1x2_cpu, dropout):
    """BatchNormalization's moving statistics and Dropout's seed state are assigned outside XLA, as without it.

    With Dropout only the seed states are compared: XLA draws other random
    numbers than TensorFlow's kernels from the same seed (plain Keras on one
    device too), so the masks, and then the weights, differ.
    """
    x = np.random.RandomState(1).rand(40, 6, 6, 3).astype("float32")
    y = np.arange(40) % 5
    trained = {}
    for jit_compile in (False, True):
        keras.utils.set_random_seed(0)
        model = _cnn(mirrored_1x2_cpu, dropout)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit_compile,
        )
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
        trained[jit_compile] = model
    moving_mean = next(v for v in trained[True].variables if v.path.endswith("moving_mean"))
    assert np.abs(moving_mean.numpy()).max() > 0  # Updated at all.
    for v in trained[True].weights:  # Mirrored: every replica holds the same value (seed states differ by design).
        for component in v.value.values[1:]:
            np.testing.assert_array_equal(component.numpy(), v.value.values[0].numpy(), err_msg=v.path)
    if dropout:
        seed_states = [
            [v.value.values[i].numpy() for i in range(2)]
            for m in trained.values()
            for v in m.variables
            if "seed_generator_state" in v.path
        ]
        assert len(seed_states) == 2
        np.testing.assert_array_equal(seed_states[0], seed_states[1])
        return
    for a, b in zip(trained[True].get_weights(), trained[False].get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


def _regularized_two_outputs(strategy):
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(4, kernel_regularizer=keras.regularizers.L2(0.1), bias_regularizer="l1")(inputs)
    outputs = {"a": keras.layers.Dense(1, name="a")(hidden), "b": keras.layers.Dense(1, name="b")(hidden)}
    return keras_dist.DistributedModel(inputs, outputs, strategy=strategy)


def test_with_fix_regularizers_and_several_outputs_match_the_uncompiled_step(mirrored_1x2_cpu, tmp_path):
    """Weight regularizers read under the StatelessScope, per-output loss trackers assigned after it; saved as compiled."""
    x, y = sum_regression(40, 8)
    trained = {}
    for jit_compile in (False, True):
        keras.utils.set_random_seed(0)
        model = _regularized_two_outputs(mirrored_1x2_cpu)
        model.compile(optimizer="sgd", loss={"a": "mse", "b": "mae"}, jit_compile=jit_compile)
        trained[jit_compile] = (
            model,
            model.fit(x, {"a": y, "b": y}, batch_size=8, epochs=2, verbose=0, shuffle=False).history,
        )
    (plain, plain_history), (compiled, compiled_history) = trained[False], trained[True]
    for a, b in zip(compiled.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    for key in plain_history:
        np.testing.assert_allclose(compiled_history[key], plain_history[key], rtol=1e-5, err_msg=key)
    compiled.save(tmp_path / "model.keras")
    with mirrored_1x2_cpu.scope():
        loaded = keras.models.load_model(tmp_path / "model.keras")
    assert loaded.get_compile_config()["jit_compile"] is True
    assert loaded.__dict__["_keras_dist_replica_jit_compile"] is True


class _GlobalCenter(keras.layers.Layer):
    def call(self, x):
        context = tf.distribute.get_replica_context()
        return (
            x if context is None else x - context.all_reduce("sum", tf.reduce_mean(x, 0)) / context.num_replicas_in_sync
        )


class _ReadsAfterUpdate(keras.layers.Layer):
    def build(self, shape):
        self.running_mean = self.add_weight(shape=(shape[-1],), initializer="zeros", trainable=False)

    def call(self, x, training=False):
        if training:
            self.running_mean.assign(0.9 * self.running_mean + 0.1 * tf.reduce_mean(x, 0))
        return x - self.running_mean


@pytest.mark.parametrize(
    "layer, match",
    [
        (_GlobalCenter, "a collective cannot run inside it.*Fix: pass `jit_compile=False`"),
        (lambda: keras.layers.BatchNormalization(synchronized=True), "a collective cannot run inside it"),
        (
            _ReadsAfterUpdate,
            r"read \['_*reads_after_update/variable(_\d+)?'\] after assigning it.*aggregation is 'mean'",
        ),
    ],
)
def test_with_fix_what_xla_per_replica_cannot_do_is_refused_when_traced(mirrored_1x2_cpu, layer, match):
    """Without these refusals: TensorFlow's raw merge_call error, or (reads after an update) silently other numbers."""
    inputs = keras.Input((8,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(layer()(inputs)), strategy=mirrored_1x2_cpu)
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    with pytest.raises(ValueError, match=f"(?s){match}"):
        model.fit(*sum_regression(NUM_EXAMPLES, 8), batch_size=16, verbose=0)
