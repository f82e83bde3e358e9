"""Dynamic models under every in-process strategy train like one device (issue 7).

Control flow in `call`, `run_eagerly=True`, mixed precision (and its loss-scale
state), collectives inside `call`, and ragged inputs. Reference: a plain
`keras.Model` with the same starting weights and batches on the default strategy.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from keras_dist.testing import max_weight_difference

TOL = 1e-5
STRATEGIES = ["default", "one_device", "mirrored_1x2_cpu", "mirrored_1x3_cpu"]


@pytest.fixture(scope="module")
def one_device():
    return tf.distribute.OneDeviceStrategy("/cpu:0")


@pytest.fixture
def strategy(request, strategy_name):
    """The strategy `strategy_name` names: `"default"` or a fixture's name."""
    if strategy_name == "default":
        return tf.distribute.get_strategy()
    return request.getfixturevalue(strategy_name)


def _data(num_examples=37):
    x = np.random.RandomState(0).rand(num_examples, 3).astype("float32")
    return x, x @ np.array([[1.0], [-2.0], [0.5]], "float32")


def _fit_pair(reference, model, x, y, *, batch_size=8, epochs=2, **compile_kwargs):
    model.set_weights(reference.get_weights())
    for m in (reference, model):
        m.compile(**{"optimizer": keras.optimizers.SGD(0.05, momentum=0.9), "loss": "mse", **compile_kwargs})
        m.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return max_weight_difference(reference, model)


# ----------------------------------------------------------- 2, 3: control flow, eager


def _control_flow_model(base):
    class ControlFlow(base):
        """Branches on a Python value, on a tensor (tf.cond, keras.ops.cond) and loops on a tensor."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.first = keras.layers.Dense(
                4, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(seed=1)
            )
            self.middle = keras.layers.Dense(4, kernel_initializer=keras.initializers.GlorotUniform(seed=3))
            self.last = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2))

        def call(self, x, training=False):
            h = self.first(x)
            if training:  # Python value: one trace per value.
                h = h * 1.5
            # A tensor condition that is the same on every replica (a weight), so one device takes the same branch.
            h = tf.cond(tf.reduce_sum(self.first.kernel) > 0.0, lambda: self.middle(h), lambda: -self.middle(h))
            h = keras.ops.cond(keras.ops.sum(self.first.bias) >= 0.0, lambda: h, lambda: 2.0 * h)
            _, h = tf.while_loop(
                lambda i, h: i < tf.shape(x)[1] - 1, lambda i, h: (i + 1, tf.tanh(h)), [tf.constant(0), h]
            )
            return self.last(h)

    return ControlFlow


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["graph", "eager"])
@pytest.mark.parametrize("strategy_name", STRATEGIES)
def test_control_flow_in_call_matches_single_device(strategy, run_eagerly):
    x, y = _data(21)  # Batches of 8, 8, 5: the last one split unevenly.
    reference = _control_flow_model(keras.Model)()
    model = _control_flow_model(keras_dist.DistributedModel)(strategy=strategy)
    for m in (reference, model):
        m(x[:1])  # Built outside any scope, before compile.
    assert _fit_pair(reference, model, x, y, epochs=1 if run_eagerly else 2, run_eagerly=run_eagerly) < TOL
    np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0), atol=TOL)


@pytest.mark.parametrize("strategy_name", ["one_device", "mirrored_1x2_cpu"])
def test_layers_built_after_compile_outside_the_scope_move_before_the_optimizer_builds(strategy):
    """Momentum slots are created next to each variable: the variables must be on the strategy first."""
    x, y = _data(16)
    model = _control_flow_model(keras_dist.DistributedModel)(strategy=strategy)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    model(x[:1])  # Builds the layers after compile, outside the strategy's scope.
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


def test_a_python_branch_on_a_tensor_fails_as_on_one_device(mirrored_1x2_cpu):
    """Keras 3 does not AutoGraph-convert `call` (also on one device): `if tensor:` needs ops.cond."""

    def build(base, **kwargs):
        class PythonIfOnTensor(base):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.dense = keras.layers.Dense(1)

            def call(self, x):
                if tf.reduce_mean(x) > 0.5:
                    return self.dense(x)
                return -self.dense(x)

        model = PythonIfOnTensor(**kwargs)
        model.compile(optimizer="sgd", loss="mse")
        return model

    x, y = _data(8)
    for model in (build(keras.Model), build(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu)):
        # keras.Model defers the build to the step; DistributedModel builds first and Keras wraps the error.
        with pytest.raises((tf.errors.OperatorNotAllowedInGraphError, RuntimeError), match="as a Python `bool`"):
            model.fit(x, y, batch_size=4, epochs=1, verbose=0)


def test_run_eagerly_runs_call_eagerly_on_every_replica(mirrored_1x2_cpu):
    """Under MirroredStrategy each replica runs `call` eagerly in its own thread: `.numpy()` and pdb work."""
    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x):
            if tf.executing_eagerly():
                replica = int(tf.distribute.get_replica_context().replica_id_in_sync_group)
                seen.append((replica, x.numpy().shape[0]))
            return x

    inputs = keras.Input((3,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(Probe()(inputs)), strategy=mirrored_1x2_cpu)
    model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    x, y = _data(8)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert sorted(seen) == [(0, 4), (1, 4)]


# ----------------------------------------------------------------- 4: mixed precision


@pytest.fixture
def global_policy():
    def set_policy(name):
        keras.mixed_precision.set_global_policy(name)

    yield set_policy
    keras.mixed_precision.set_global_policy("float32")


def _mixed_precision_model(cls, **kwargs):
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(8, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(seed=1))(
        inputs
    )
    outputs = keras.layers.Dense(1, dtype="float32", kernel_initializer=keras.initializers.GlorotUniform(seed=2))(
        hidden
    )
    return cls(inputs, outputs, **kwargs)


# One device and OneDeviceStrategy compute exactly what Keras does. Replicas each sum a share of the batch
# in float16/bfloat16 inside the kernel-gradient matmul, so the rounding differs. Measured after these
# 8 steps: 7e-5 (float16) and 3.5e-4 (bfloat16); 5e-4 and 4e-3 after 15 steps on 37 examples. The
# bounds are one unit roundoff of each type (2**-11, 2**-8): a wrongly weighted replica is off by 1e-2.
MIXED_TOL = {"mixed_float16": 2.0**-11, "mixed_bfloat16": 2.0**-8}


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("strategy_name", STRATEGIES)
def test_mixed_precision_matches_single_device(strategy, policy, global_policy):
    global_policy(policy)
    x, y = _data(29)
    reference = _mixed_precision_model(keras.Model)
    model = _mixed_precision_model(keras_dist.DistributedModel, strategy=strategy)
    difference = _fit_pair(reference, model, x, y, epochs=2)
    assert model.layers[1].compute_dtype == policy.split("_")[1]
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer) == (policy == "mixed_float16")
    assert difference < (TOL if model.distribute_strategy.num_replicas_in_sync == 1 else MIXED_TOL[policy])


def _loss_scale_state(model):
    """Returns each replica's (loss scale, step counter, iterations)."""
    optimizer, strategy = model.optimizer, model.distribute_strategy
    variables = (optimizer.dynamic_scale, optimizer.step_counter, optimizer.iterations)
    return [tuple(float(v) for v in strategy.experimental_local_results(variable.value)) for variable in variables]


def _loss_scaled_model(strategy):
    model = _mixed_precision_model(keras_dist.DistributedModel, strategy=strategy)
    inner = keras.optimizers.SGD(0.05, momentum=0.9)
    # Doubles the scale every 3 finite steps: after 10 steps scale 8 and counter 1 (mid-cycle).
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(inner, initial_scale=1.0, dynamic_growth_steps=3), loss="mse"
    )
    return model


class _InterruptAfterEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


def test_loss_scale_state_is_mirrored_saved_and_restored(mirrored_1x3_cpu, global_policy, tmp_path):
    multi_replica_strategy = mirrored_1x3_cpu
    global_policy("mixed_float16")
    num_replicas = multi_replica_strategy.num_replicas_in_sync
    x, y = _data()
    model = _loss_scaled_model(multi_replica_strategy)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)  # 10 steps
    assert _loss_scale_state(model) == [(8.0,) * num_replicas, (1.0,) * num_replicas, (10.0,) * num_replicas]

    model.save_weights(tmp_path / "m.weights.h5")
    model.save(tmp_path / "m.keras")
    restored = _loss_scaled_model(multi_replica_strategy)
    with multi_replica_strategy.scope():
        restored.optimizer.build(restored.trainable_variables)  # Keras loads optimizer state into a built optimizer.
    restored.load_weights(tmp_path / "m.weights.h5")
    assert _loss_scale_state(restored) == _loss_scale_state(model)
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert [set(values) for values in _loss_scale_state(loaded)] == [{8.0}, {1.0}, {10.0}]

    # BackupAndRestore: interrupted after 2 epochs, resumed; the third epoch continues the loss-scale cycle.
    straight = _loss_scaled_model(multi_replica_strategy)
    straight.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    interrupted = _loss_scaled_model(multi_replica_strategy)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(RuntimeError, match="interrupted"):
        interrupted.fit(
            x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=[backup, _InterruptAfterEpoch(1)]
        )
    resumed = _loss_scaled_model(multi_replica_strategy)
    resumed.fit(
        x,
        y,
        batch_size=8,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))],
    )
    assert (
        _loss_scale_state(resumed)
        == _loss_scale_state(straight)
        == [(32.0,) * num_replicas, (0.0,) * num_replicas, (15.0,) * num_replicas]
    )
    assert max_weight_difference(resumed, straight) < TOL


# ------------------------------------------------------------- 6: collectives in call


class GlobalBatchStatistics(keras.layers.Layer):
    """Centers by the global batch mean (all_reduce) and scales by the global max (all_gather)."""

    def call(self, x):
        context = tf.distribute.get_replica_context()
        total, count = context.all_reduce("SUM", [tf.reduce_sum(x, axis=0), tf.cast(tf.shape(x)[0], x.dtype)])
        largest = tf.reduce_max(tf.abs(context.all_gather(x, axis=0)))
        return (x - total / tf.maximum(count, 1.0)) / tf.maximum(largest, 1.0)


def _collective_layers():
    return [
        keras.layers.Dense(4, kernel_initializer=keras.initializers.GlorotUniform(seed=1)),
        GlobalBatchStatistics(),
        keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2)),
    ]


def _collective_model(style, cls, **kwargs):
    if style == "functional":
        inputs = hidden = keras.Input((3,))
        for layer in _collective_layers():
            hidden = layer(hidden)
        return cls(inputs, hidden, **kwargs)
    if style == "synchronized_batch_norm":
        inputs = keras.Input((3,))
        hidden = keras.layers.Dense(4, kernel_initializer=keras.initializers.GlorotUniform(seed=1))(inputs)
        hidden = keras.layers.BatchNormalization(synchronized=True)(hidden)
        return cls(
            inputs, keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2))(hidden), **kwargs
        )

    class Subclassed(cls):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.stack = _collective_layers()

        def call(self, x):
            for layer in self.stack:
                x = layer(x)
            return x

    return Subclassed(**kwargs)


@pytest.mark.parametrize(
    "style,num_replicas",
    [("functional", 2), ("subclassed", 3), ("synchronized_batch_norm", 2), ("synchronized_batch_norm", 3)],
)
def test_collective_in_call_builds_and_matches_single_device(request, style, num_replicas):
    """33 examples in batches of 8: the last batch of 1 leaves replicas empty (synchronized BN included)."""
    x, y = _data(33)
    reference = _collective_model(style, keras.Model)
    model = _collective_model(
        style, keras_dist.DistributedModel, strategy=request.getfixturevalue(f"mirrored_1x{num_replicas}_cpu")
    )
    if style == "subclassed":  # Unbuilt until fit: built from the batch spec, in a replica context.
        model.compile(optimizer="sgd", loss="mse")
        model.evaluate(x, y, batch_size=8, verbose=0)
        reference(x[:1])
    assert _fit_pair(reference, model, x, y) < TOL
    np.testing.assert_allclose(
        model.evaluate(x, y, batch_size=8, verbose=0), reference.evaluate(x, y, batch_size=8, verbose=0), rtol=TOL
    )


def test_collective_in_call_under_one_device_strategy(one_device):
    x, y = _data(13)
    reference = _collective_model("functional", keras.Model)
    model = _collective_model("functional", keras_dist.DistributedModel, strategy=one_device)
    assert _fit_pair(reference, model, x, y) < TOL


# -------------------------------------------------------------------------- ragged


def _ragged_dataset():
    rs = np.random.RandomState(0)
    sequences = [rs.randint(1, 20, size=rs.randint(2, 9)).tolist() for _ in range(29)]
    labels = np.array([[len(s) / 8.0] for s in sequences], "float32")
    return tf.data.Dataset.from_tensor_slices((tf.ragged.constant(sequences), labels)).ragged_batch(8)


class ToDense(keras.layers.Layer):
    """Pads a ragged batch to 8 tokens: the same shape on every replica and on one device."""

    def call(self, x):
        return x.to_tensor(shape=[None, 8]) if isinstance(x, tf.RaggedTensor) else x


def _ragged_model(style, cls, **kwargs):
    embedding = keras.layers.Embedding(
        20, 4, mask_zero=True, embeddings_initializer=keras.initializers.RandomUniform(seed=1)
    )
    dense = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2))
    if style == "functional":
        inputs = keras.Input((None,), dtype="int32", ragged=True)
        return cls(inputs, dense(keras.layers.GlobalAveragePooling1D()(embedding(ToDense()(inputs)))), **kwargs)

    class Subclassed(cls):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.embedding, self.pool, self.dense = embedding, keras.layers.GlobalAveragePooling1D(), dense

        def call(self, tokens):
            tokens = tokens.to_tensor()  # Each replica pads to its own longest: the mask keeps that out.
            return self.dense(self.pool(self.embedding(tokens), mask=tokens > 0))

    return Subclassed(**kwargs)


@pytest.mark.parametrize("style,num_replicas", [("functional", 2), ("subclassed", 3)])
def test_ragged_batches_train_like_one_device(request, style, num_replicas):
    reference = _ragged_model(style, keras.Model)
    model = _ragged_model(
        style, keras_dist.DistributedModel, strategy=request.getfixturevalue(f"mirrored_1x{num_replicas}_cpu")
    )
    for m in (reference, model):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        m.predict(_ragged_dataset(), verbose=0)  # Builds both.
    model.set_weights(reference.get_weights())
    for m in (reference, model):
        m.fit(_ragged_dataset(), epochs=2, verbose=0)
    assert max_weight_difference(reference, model) < TOL
    predictions = model.predict(_ragged_dataset(), verbose=0)
    assert predictions.shape == (29, 1)
    np.testing.assert_allclose(predictions, reference.predict(_ragged_dataset(), verbose=0), atol=TOL)


def _texts():
    """64 texts: in each batch of 16, the first 4 long (14 words), the rest short (3): the replicas' longest differ."""
    rs = np.random.RandomState(0)
    vocabulary = "the movie was great terrible boring fun awful plot acting good bad loved hated it very".split()
    lengths = np.where(np.arange(64) % 16 < 4, 14, 3)
    texts = np.array([" ".join(rs.choice(vocabulary, n)) for n in lengths])
    return texts, rs.randint(0, 2, (64, 1)).astype("float32")


def _batches(texts, labels=None, batch_size=16):
    """keras.io's way: a `tf.data.Dataset` of string batches (Keras takes no NumPy array of `str`)."""
    parts = texts[:, None] if labels is None else (texts[:, None], labels)
    return tf.data.Dataset.from_tensor_slices(parts).batch(batch_size)


def _text_model(cls, texts, *, per_token=False, **kwargs):
    """keras.io's text classification: `TextVectorization` without `output_sequence_length` inside the model, unmasked."""
    keras.utils.set_random_seed(6)
    vectorize = keras.layers.TextVectorization(max_tokens=50, output_mode="int")
    vectorize.adapt(texts)
    inputs = keras.Input(shape=(1,), dtype="string")
    x = keras.layers.Embedding(50, 8)(vectorize(inputs))
    if per_token:
        return cls(inputs, keras.layers.Dense(1)(x), **kwargs)
    outputs = keras.layers.Dense(1, activation="sigmoid")(keras.layers.GlobalAveragePooling1D()(x))
    return cls(inputs, outputs, **kwargs)


@pytest.mark.parametrize("strategy_name", ["mirrored_1x2_cpu", "mirrored_1x3_cpu"])
def test_a_batch_padded_in_call_is_padded_to_the_global_batchs_longest(strategy):
    """`TextVectorization` (and `to_tensor()`) pad a replica's part to the longest row of the global batch, as one device.

    Each replica padded to its own longest before, and the unmasked average counted its own padding
    (a new-user probe: 1.6e-2 off in the weights on 2 replicas).
    """
    texts, labels = _texts()
    reference = _text_model(keras.Model, texts)
    model = _text_model(keras_dist.DistributedModel, texts, strategy=strategy)
    model.set_weights(reference.get_weights())
    results = []
    for m in (reference, model):
        m.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy", metrics=["accuracy"])
        history = m.fit(_batches(texts, labels), epochs=2, verbose=0).history
        results.append((history, m.evaluate(_batches(texts, labels), verbose=0)))
    assert max_weight_difference(reference, model) < TOL
    for name in results[0][0]:
        np.testing.assert_allclose(results[1][0][name], results[0][0][name], atol=TOL, err_msg=name)
    np.testing.assert_allclose(results[1][1], results[0][1], atol=TOL)
    np.testing.assert_allclose(
        model.predict(_batches(texts), verbose=0), reference.predict(_batches(texts), verbose=0), atol=TOL
    )


def test_a_prediction_per_token_has_the_global_batchs_length_on_every_replica(mirrored_1x2_cpu):
    """One value per token: the replicas' predictions have one length, the global batch's (they could not be joined)."""
    texts, _ = _texts()
    reference = _text_model(keras.Model, texts, per_token=True)
    model = _text_model(keras_dist.DistributedModel, texts, per_token=True, strategy=mirrored_1x2_cpu)
    model.set_weights(reference.get_weights())
    expected = reference.predict(_batches(texts[:16]), verbose=0)
    assert expected.shape == (16, 14, 1)
    np.testing.assert_allclose(model.predict(_batches(texts[:16]), verbose=0), expected, atol=TOL)


class _PaddedTo(keras.layers.Layer):
    """`tokens.to_tensor(shape=...)` with the shape the test gives."""

    def __init__(self, shape, **kwargs):
        super().__init__(**kwargs)
        self.shape = shape

    def call(self, tokens):
        return tokens.to_tensor(shape=self.shape) if isinstance(tokens, tf.RaggedTensor) else tokens


@pytest.mark.parametrize(
    "shape,width", [(None, 8), ([None, None], 8), ([None, 5], 5), (tf.TensorShape([None, 6]), 6)], ids=str
)
def test_a_dimension_the_caller_fixes_stays_and_an_open_one_gets_the_global_longest(mirrored_1x2_cpu, shape, width):
    """Rows 0-3 have 2 to 5 tokens, rows 4-7 (the second replica's) up to 8: both replicas' widths are the global one."""
    lengths = [2, 3, 4, 5, 8, 1, 2, 3]
    tokens = tf.ragged.constant([[1] * n for n in lengths])
    dataset = tf.data.Dataset.from_tensor_slices(tokens).ragged_batch(8)
    inputs = keras.Input((None,), dtype="int32", ragged=True)
    model = keras_dist.DistributedModel(inputs, _PaddedTo(shape)(inputs), strategy=mirrored_1x2_cpu)
    padded = model.predict(dataset, verbose=0)
    assert padded.shape == (8, width)
    np.testing.assert_array_equal(padded.sum(axis=1), np.minimum(lengths, width))
