"""DistributedModel's three styles, variable placement, BatchNorm state and custom steps."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_dist
from keras_dist.testing import max_weight_difference

DISTRIBUTED_KINDS = {"MirroredVariable", "SyncOnReadVariable"}


def _xy(n=32, seed=0):
    rs = np.random.RandomState(seed)
    x = rs.rand(n, 4).astype("float32")
    return x, x.sum(1, keepdims=True)


def _kinds(model):
    owned = [*model.weights, *model.metrics_variables, *model.optimizer.variables]
    return {type(v.value).__name__ for v in owned}


def test_functional_use_does_not_rewire_subclassing(mirrored_1x2_cpu):
    inputs = keras.Input((4,))
    functional = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy=mirrored_1x2_cpu)

    class Sub(keras_dist.DistributedModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    sub = Sub(strategy=mirrored_1x2_cpu)
    functional_again = keras_dist.DistributedModel(inputs, keras.layers.Dense(2)(inputs), strategy=mirrored_1x2_cpu)
    assert keras_dist.DistributedModel.__bases__ == (keras.Model,)
    assert isinstance(functional, keras_dist.DistributedModel)
    assert type(functional) is type(functional_again)
    assert not isinstance(sub, keras.src.models.functional.Functional)
    sub.compile(optimizer="sgd", loss="mse")
    sub.fit(*_xy(), batch_size=8, verbose=0)
    assert _kinds(sub) <= DISTRIBUTED_KINDS


@pytest.mark.parametrize("variant", ["lazy_fit_outside", "opt_outside", "compile_outside", "model_outside"])
def test_variables_distributed_wherever_created(variant, mirrored_1x2_cpu):
    """Plain Keras fails with "Mixing different tf.distribute.Strategy objects" or "Need to be inside strategy.scope()" when the optimizer, `compile` or the model is outside the scope (keras-team/keras#20045, #17187): all end up mirrored."""
    x, y = _xy()
    strategy = mirrored_1x2_cpu
    if variant == "lazy_fit_outside":
        with strategy.scope():
            model = keras_dist.distribute(keras.Sequential([keras.layers.Dense(8), keras.layers.Dense(1)]))
            model.compile(optimizer="adam", loss="mse")
    elif variant == "opt_outside":
        optimizer = keras.optimizers.Adam()
        inputs = keras.Input((4,))
        model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy=strategy)
        model.compile(optimizer=optimizer, loss="mse")
    elif variant == "compile_outside":
        inputs = keras.Input((4,))
        model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy=strategy)
        model.compile(optimizer="adam", loss="mse")
    else:
        plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        plain.compile(optimizer="adam", loss="mse")
        plain.fit(x, y, batch_size=8, verbose=0)  # trained, optimizer built
        before = plain.get_weights()
        model = keras_dist.distribute(plain, strategy=strategy)
        assert max(np.abs(a - b).max() for a, b in zip(before, model.get_weights())) == 0
        assert model.optimizer is plain.optimizer
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert model.distribute_strategy is strategy
    assert _kinds(model) <= DISTRIBUTED_KINDS


def test_layers_built_before_wrapping_keep_their_objects(mirrored_1x2_cpu):
    dense = keras.layers.Dense(3)
    inputs = keras.Input((4,))
    outputs = dense(inputs)
    kernel = dense.kernel
    model = keras_dist.DistributedModel(inputs, outputs, strategy=mirrored_1x2_cpu)
    assert model.layers[-1] is dense and dense.kernel is kernel
    assert type(kernel.value).__name__ == "MirroredVariable"


def test_batchnorm_moving_statistics_identical_on_every_replica(mirrored_1x2_cpu, tmp_path):
    """Plain Keras under MirroredStrategy lets each replica write its own BatchNormalization moving mean/variance, so the copies diverge and `predict` depends on the replica (keras-team/keras#18667): they must not."""
    rs = np.random.RandomState(0)
    x = np.concatenate([rs.randn(4, 3), rs.randn(4, 3) + 10]).astype("float32")
    y = rs.randn(8, 1).astype("float32")
    inputs = keras.Input((3,))
    bn = keras.layers.BatchNormalization(momentum=0.0)
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(bn(inputs)), strategy=mirrored_1x2_cpu)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)

    for variable in (bn.moving_mean, bn.moving_variance):
        copies = [v.numpy() for v in mirrored_1x2_cpu.experimental_local_results(variable.value)]
        np.testing.assert_array_equal(copies[0], copies[1])
    # momentum=0: the moving mean is the mean of the two replicas' batch means = global mean.
    np.testing.assert_allclose(bn.moving_mean.numpy(), x.mean(0), rtol=1e-5)
    probe = np.repeat(x[:1], 8, axis=0)  # 4 identical rows per replica
    predictions = model.predict(probe, batch_size=8, verbose=0)
    assert np.ptp(predictions) < 1e-6
    path = str(tmp_path / "bn.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(
        loaded.evaluate(x, y, batch_size=8, verbose=0), model.evaluate(x, y, batch_size=8, verbose=0), rtol=1e-5
    )


class ReplicaIdModel(keras_dist.DistributedModel):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        replica_id = tf.distribute.get_replica_context().replica_id_in_sync_group
        return {"replica_id": tf.cast(replica_id, "float32")}


@pytest.mark.parametrize("method,expected", [("auto", 0.5), ("mean", 0.5), ("sum", 1.0), ("first", 0.0)])
def test_distribute_reduction_method_is_honoured(method, expected, mirrored_1x2_cpu):
    """A `train_step` returning the replica id (keras-team/keras#15509): in plain Keras 3 reading `distribute_reduction_method` raised AttributeError and setting it was ignored; it reads as "auto" and setting it changes the reduction."""
    model = ReplicaIdModel(strategy=mirrored_1x2_cpu)
    assert model.distribute_reduction_method == "auto"
    model.compile(optimizer="sgd", loss="mse")
    model.distribute_reduction_method = method
    history = model.fit(*_xy(), batch_size=8, epochs=1, verbose=0)
    assert history.history["replica_id"][-1] == pytest.approx(expected)


def test_distribute_reduction_method_rejects_unknown_value(mirrored_1x2_cpu):
    model = ReplicaIdModel(strategy=mirrored_1x2_cpu)
    with pytest.raises(ValueError, match="must be one of .*Received: distribute_reduction_method='max'"):
        model.distribute_reduction_method = "max"


class GuideStepModel(keras_dist.DistributedModel):
    """The TF custom-training guide's train_step: loss / global batch size, summed."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1, kernel_initializer="zeros")

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(self(x, training=True) - y), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=8)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        return {"guide_loss": loss}


def test_custom_train_step_with_sum_reduction_matches_single_device(mirrored_1x2_cpu):
    x, y = _xy()
    reference = GuideStepModel(strategy="one_device")
    model = GuideStepModel(strategy=mirrored_1x2_cpu)
    for m in (reference, model):
        m.compile(optimizer="sgd")
    model.distribute_reduction_method = "sum"
    model.custom_step_losses = "global"  # The step divides by the global batch itself (TensorFlow's guide).
    history_ref = reference.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False).history
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False).history
    assert max_weight_difference(reference, model) < 1e-6
    np.testing.assert_allclose(history["guide_loss"], history_ref["guide_loss"], rtol=1e-5)


def test_super_train_step_in_subclass_keeps_fixes(mirrored_1x2_cpu):
    class Counting(keras_dist.DistributedModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(1, kernel_initializer="zeros")

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            return super().train_step(data)

    x, y = _xy(7)
    reference = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, kernel_initializer="zeros")])
    model = Counting(strategy=mirrored_1x2_cpu)
    for m in (reference, model):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    reference.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < 1e-5


def test_distribute_rejects_non_models_and_custom_steps():
    with pytest.raises(TypeError, match="expects a `keras.Model`. Received: model of type Dense"):
        keras_dist.distribute(keras.layers.Dense(1))

    class CustomStep(keras.Model):
        def train_step(self, data):
            return {}

    with pytest.raises(ValueError, match=r"cannot carry over overridden \['train_step'\] of CustomStep"):
        keras_dist.distribute(CustomStep())


def test_distribute_moves_a_distributed_model_to_another_strategy(mirrored_1x2_cpu, mirrored_1x3_cpu):
    inputs = keras.Input((4,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy=mirrored_1x2_cpu)
    weights = model.get_weights()
    same = keras_dist.distribute(model, strategy=mirrored_1x3_cpu)
    assert same is model and model.distribute_strategy is mirrored_1x3_cpu
    assert len(mirrored_1x3_cpu.experimental_local_results(model.weights[0].value)) == 3
    assert max(np.abs(a - b).max() for a, b in zip(weights, model.get_weights())) == 0


def test_model_inside_another_strategys_scope_is_refused(mirrored_1x2_cpu, mirrored_1x3_cpu):
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1)(inputs)
    with mirrored_1x2_cpu.scope():
        assert keras_dist.DistributedModel(inputs, outputs).distribute_strategy is mirrored_1x2_cpu
        with pytest.raises(ValueError, match="must be created under its own strategy's scope or under none"):
            keras_dist.DistributedModel(inputs, outputs, strategy=mirrored_1x3_cpu)


def test_loss_scale_optimizer_built_outside_scope_is_distributed(mirrored_1x2_cpu):
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01))
    inputs = keras.Input((4,))
    model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs), strategy=mirrored_1x2_cpu)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(*_xy(), batch_size=8, verbose=0)
    kinds = {type(v.value).__name__ for v in [*optimizer.variables, *optimizer.inner_optimizer.variables]}
    assert kinds == {"MirroredVariable"}
    assert int(optimizer.inner_optimizer.iterations.numpy()) == 4


def test_subclass_whose_metrics_property_reads_attributes_set_after_init(mirrored_1x2_cpu):
    """The Keras guide's low-level pattern: `metrics` returns trackers created after `super().__init__()`."""

    class GuideModel(keras_dist.DistributedModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(1)
            self.loss_tracker = keras.metrics.Mean(name="loss")

        @property
        def metrics(self):
            return [self.loss_tracker]

        def call(self, x):
            return self.dense(x)

    model = GuideModel(strategy=mirrored_1x2_cpu)
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((8, 2), "float32")
    model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)
    assert any(v is model.loss_tracker.variables[0] for v in model.metrics_variables)


@pytest.mark.parametrize("wrap_frozen", [False, True], ids=["freeze_after_wrapping", "frozen_before_distribute"])
def test_freeze_fit_unfreeze_fit_matches_single_device(mirrored_1x2_cpu, wrap_frozen):
    """Fine-tuning: a frozen layer's variables are re-created for the strategy; unfrozen, they must train again."""
    x = np.random.RandomState(0).rand(32, 4).astype("float32")
    y = x.sum(1, keepdims=True)

    def run(distributed):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((4,))
        base = keras.layers.Dense(3, activation="tanh", name="base")
        model = keras.Model(inputs, keras.layers.Dense(1, name="head")(base(inputs)))
        base.trainable = False
        if distributed:
            model = (
                keras_dist.distribute(model, strategy=mirrored_1x2_cpu)
                if wrap_frozen
                else keras_dist.distribute(keras.Model(inputs, model.outputs), strategy=mirrored_1x2_cpu)
            )
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        base.trainable = True
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        return model

    reference, model = run(False), run(True)
    assert np.abs(model.get_layer("base").kernel.numpy() - reference.get_layer("base").kernel.numpy()).max() < 1e-5
    assert max_weight_difference(reference, model) < 1e-5


def test_stateful_rnn_under_several_replicas_is_refused_by_name(mirrored_1x3_cpu):
    """A new-user probe: `LSTM(stateful=True)` with a batch of 4 on 3 replicas failed in TensorFlow's
    `BroadcastGradientArgs` (`Incompatible shapes: [0,16] vs. [4,16]`), naming neither the layer nor the cause."""
    inputs = keras.Input(batch_shape=(4, 5, 2))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.LSTM(4, stateful=True, name="counter_lstm")(inputs)))
    expected = r"'counter_lstm' \(LSTM\) is stateful.*3 replicas.*one_device"
    with pytest.raises(ValueError, match=expected):
        keras_dist.distribute(model, strategy=mirrored_1x3_cpu)
    with mirrored_1x3_cpu.scope(), pytest.raises(ValueError, match=expected):
        inputs = keras.Input(batch_shape=(4, 5, 2))
        lstm = keras.layers.LSTM(4, stateful=True, name="counter_lstm")
        keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(lstm(inputs)))


def test_stateful_rnn_on_one_replica_still_trains():
    """The check is for several replicas only: on one device a stateful RNN trains as in Keras."""
    x = np.zeros((8, 5, 2), "float32")
    inputs = keras.Input(batch_shape=(4, 5, 2))
    model = keras_dist.DistributedModel(
        inputs, keras.layers.Dense(1)(keras.layers.LSTM(4, stateful=True)(inputs)), strategy="one_device"
    )
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, x[:, 0, :1], batch_size=4, verbose=0)
