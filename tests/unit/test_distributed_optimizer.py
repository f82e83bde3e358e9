"""distributed_optimizer: sum over replicas before clipping, in fit, user train_steps and custom loops; accumulation."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _support import sum_regression

import keras_dist
from keras_dist.testing import max_weight_difference

KERNEL_SHAPE = (4, 3)  # Only the first Dense kernel has this shape: its all-reduces are the gradient all-reduces.


class CountingReduction(tf.distribute.ReductionToOneDevice):
    """TF's ReductionToOneDevice, counting (at run time) the batch reductions that carry the kernel gradient."""

    def __init__(self):
        super().__init__()
        self.count = tf.Variable(0, dtype=tf.int64, trainable=False)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        reduced = super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)
        shapes = [
            tuple(tf.distribute.get_strategy().experimental_local_results(v)[0].shape)
            for v, _ in value_destination_pairs
        ]
        if KERNEL_SHAPE in shapes:
            with tf.control_dependencies(tf.nest.flatten(reduced, expand_composites=True)):
                self.count.assign_add(1)
        return reduced


def _model(model_class, optimizer, **kwargs):
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(seed=1))(
        inputs
    )
    model = model_class(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(hidden), **kwargs)
    model.compile(optimizer=optimizer, loss="mse")
    return model


@pytest.mark.parametrize("steps", [None, 2, 4])
def test_accumulation_all_reduces_gradients_once_per_k_micro_batches(steps):
    counting = CountingReduction()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=counting)
    x, y = sum_regression(64, 4)  # 8 micro-batches of 8 per epoch
    model = _model(
        keras_dist.DistributedModel, keras.optimizers.Adam(0.05, gradient_accumulation_steps=steps), strategy=strategy
    )
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    reference = _model(keras.Model, keras.optimizers.Adam(0.05, gradient_accumulation_steps=steps))
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)

    assert int(counting.count.numpy()) == 16 // (steps or 1)
    assert max_weight_difference(reference, model) < 1e-5
    assert int(np.asarray(model.optimizer.iterations)) == int(np.asarray(reference.optimizer.iterations))


def test_accumulation_with_ema_and_weight_decay_matches_single_device(mirrored_1x2_cpu):
    """Micro-batches that only accumulate still take Keras' per-apply EMA step."""

    def optimizer():
        return keras.optimizers.AdamW(
            0.05, weight_decay=0.1, use_ema=True, ema_overwrite_frequency=3, gradient_accumulation_steps=2
        )

    x, y = sum_regression(48, 4)
    model = _model(keras_dist.DistributedModel, optimizer(), strategy=mirrored_1x2_cpu)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    reference = _model(keras.Model, optimizer())
    reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(reference, model) < 1e-5
    model_ema = [v.numpy() for v in model.optimizer._model_variables_moving_average]
    reference_ema = [v.numpy() for v in reference.optimizer._model_variables_moving_average]
    assert max(float(np.abs(a - b).max()) for a, b in zip(model_ema, reference_ema)) < 1e-5


class _ClippingTrainStep:
    """A user-written train_step (the Keras guide's), calling `self.optimizer.apply` itself."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return {"loss": loss}


class UserModel(_ClippingTrainStep, keras.Model):
    pass


class UserDistributedModel(_ClippingTrainStep, keras_dist.DistributedModel):
    pass


@pytest.mark.parametrize("clipping", [{"clipnorm": 0.05}, {"global_clipnorm": 0.05}, {"clipvalue": 0.01}])
def test_user_train_step_clips_the_global_gradient(multi_replica_strategy, clipping):
    x, y = sum_regression(36, 4)
    model = _model(UserDistributedModel, keras.optimizers.SGD(0.5, **clipping), strategy=multi_replica_strategy)
    model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    reference = _model(UserModel, keras.optimizers.SGD(0.5, **clipping))
    reference.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(reference, model) < 1e-5


class ClippedByValueRMSprop(keras.optimizers.RMSprop):
    """A user's subclass that edits each gradient in `apply_gradients` before Keras' (a new-user probe, finding 1)."""

    def apply_gradients(self, grads_and_vars):
        return super().apply_gradients([(keras.ops.clip(g, -0.02, 0.02), v) for g, v in grads_and_vars])


def _classifier(model_class, **kwargs):
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="relu", kernel_initializer=keras.initializers.GlorotUniform(seed=2))
    outputs = keras.layers.Dense(3, activation="softmax", kernel_initializer=keras.initializers.GlorotUniform(seed=3))
    model = model_class(inputs, outputs(hidden(inputs)), **kwargs)
    model.compile(optimizer=ClippedByValueRMSprop(0.01), loss="sparse_categorical_crossentropy")
    return model


@pytest.mark.parametrize("num_examples", [37, 32], ids=["uneven", "even"])
def test_an_apply_gradients_override_edits_the_global_gradient(mirrored_1x2_cpu, num_examples):
    """Was each replica's own gradient under the built-in step (the sum came after, in `apply`): weights 1.3 off."""
    rs = np.random.RandomState(0)
    x, y = rs.normal(size=(num_examples, 6)).astype("float32"), rs.randint(0, 3, size=(num_examples,))
    model = _classifier(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu)
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    reference = _classifier(keras.Model)
    reference.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    assert max_weight_difference(reference, model) < 1e-5
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())


def test_an_apply_gradients_override_in_a_custom_loop_edits_the_global_gradient(mirrored_1x2_cpu):
    """`strategy.run` + `apply_gradients` of a wrapped optimizer whose class overrides it: the sum comes first there too."""
    model = _custom_loop(mirrored_1x2_cpu, lambda: ClippedByValueRMSprop(0.01), wrap=True)
    reference = _one_device_loop(lambda: ClippedByValueRMSprop(0.01))
    assert max_weight_difference(reference, model) < 1e-5


def _custom_loop(strategy, optimizer, wrap=False, compiled=False):
    """strategy.run + optimizer.apply_gradients; `compiled`: on a compiled DistributedModel's `model.optimizer`."""
    x, y = sum_regression(32, 4)
    if compiled:
        inputs = keras.Input((4,))
        model = keras_dist.DistributedModel(
            inputs, keras.layers.Dense(1, kernel_initializer="zeros")(inputs), strategy=strategy
        )
        model.compile(optimizer=optimizer(), loss="mse")
        optimizer = model.optimizer
    else:
        with strategy.scope():
            inputs = keras.Input((4,))
            model = keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(inputs))
            optimizer = optimizer()
            if wrap:
                keras_dist.distributed_optimizer(optimizer, {"bytes_per_pack": 64})
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(8))

    @tf.function
    def train_step(batch):
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.square(model(xb, training=True) - yb)) / 8.0
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))

        strategy.run(step, args=batch)

    for batch in dataset:
        train_step(batch)
    return model


def _one_device_loop(optimizer):
    x, y = sum_regression(32, 4)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="zeros")(inputs))
    optimizer = optimizer()
    for start in range(0, 32, 8):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x[start : start + 8]) - y[start : start + 8])) / 8.0
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return model


@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_custom_training_loop_with_stateful_optimizer_matches_single_device(mirrored_1x2_cpu, optimizer):
    """A custom loop (tf.function + strategy.run + optimizer.apply_gradients) with Adam or momentum, slots never built by fit: plain Keras crashed building them inside the traced step (keras-team/keras#23085)."""

    def make_optimizer():
        return keras.optimizers.Adam(0.01) if optimizer == "adam" else keras.optimizers.SGD(0.01, momentum=0.9)

    model = _custom_loop(mirrored_1x2_cpu, make_optimizer, compiled=True)
    assert max_weight_difference(_one_device_loop(make_optimizer), model) < 1e-6
    assert int(model.optimizer.iterations.numpy()) == 4


def test_raw_optimizer_in_a_custom_loop_clips_the_global_gradient(mirrored_1x2_cpu):
    """An optimizer never given to compile: plain Keras clips each replica's share; distributed_optimizer the sum."""

    def optimizer():
        return keras.optimizers.SGD(0.5, momentum=0.9, global_clipnorm=0.5)

    reference = _one_device_loop(optimizer)
    plain = _custom_loop(mirrored_1x2_cpu, optimizer, wrap=False)
    wrapped = _custom_loop(mirrored_1x2_cpu, optimizer, wrap=True)
    assert max_weight_difference(reference, wrapped) < 1e-6
    assert max_weight_difference(reference, plain) > 1e-3


def test_distributed_optimizer_refuses_other_objects():
    with pytest.raises(TypeError, match="expects a `keras.optimizers.Optimizer`. Received: str"):
        keras_dist.distributed_optimizer("adam")


def test_distributed_optimizer_keeps_the_optimizer_usable_on_one_device():
    optimizer = keras_dist.distributed_optimizer(keras.optimizers.SGD(0.1))
    variable = keras.Variable([1.0, 2.0])
    optimizer.apply([tf.constant([1.0, 1.0])], [variable])
    np.testing.assert_allclose(variable.numpy(), [0.9, 1.9])
    assert keras.optimizers.deserialize(keras.optimizers.serialize(optimizer)).get_config() == optimizer.get_config()


def test_mixed_float16_matches_single_device_while_no_step_overflows(mirrored_1x2_cpu):
    """No step overflows at loss scale 64: 2 replicas match one device to float16 rounding.

    With the default initial scale (2**15) they differ, and that is float16, not a bug: each
    replica's float16 kernel gradient sums half the batch, so it overflows later than one
    device's sum over the whole batch, and the dynamic loss scale then skips different steps
    (measured: one device skipped 3 steps, 2 replicas 2; docs/communication.md).
    """

    def build(cls, kwargs):
        inputs = keras.Input((3,))
        hidden = keras.layers.Dense(4, kernel_initializer="ones", dtype="mixed_float16")(inputs)
        model = cls(inputs, keras.layers.Dense(1, kernel_initializer="ones")(hidden), **kwargs)
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**6)
        model.compile(optimizer=optimizer, loss="mse")
        return model

    x = np.random.RandomState(0).rand(16, 3).astype("float32")
    reference, model = build(keras.Model, {}), build(keras_dist.DistributedModel, {"strategy": mirrored_1x2_cpu})
    for m in (reference, model):
        m.fit(x, x.sum(1, keepdims=True), batch_size=8, epochs=4, shuffle=False, verbose=0)
    assert max_weight_difference(reference, model) < 1e-3
    assert (
        float(np.asarray(model.optimizer.dynamic_scale)) == float(np.asarray(reference.optimizer.dynamic_scale)) == 64.0
    )


@pytest.mark.parametrize("constraint", ["non_neg", "max_norm"])
def test_accumulation_applies_constraints_on_every_micro_batch(multi_replica_strategy, constraint):
    """Keras constrains the variables at every `apply`, also on micro-batches that only accumulate."""

    def run(model_class, **kwargs):
        inputs = keras.Input((4,))
        constraint_object = keras.constraints.NonNeg() if constraint == "non_neg" else keras.constraints.MaxNorm(0.5)
        hidden = keras.layers.Dense(
            3,
            activation="tanh",
            kernel_constraint=constraint_object,
            kernel_initializer=keras.initializers.RandomNormal(seed=1),  # Violates both constraints at first.
        )(inputs)
        output = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2))(hidden)
        model = model_class(inputs, output, **kwargs)
        model.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), loss="mse")
        x, y = sum_regression(48, 4)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return model

    reference = run(keras.Model)
    model = run(keras_dist.DistributedModel, strategy=multi_replica_strategy)
    assert max_weight_difference(reference, model) < 1e-5


def test_recompiling_mid_cycle_keeps_the_pending_sums(mirrored_1x2_cpu):
    """Freezing a layer in the middle of an accumulation cycle: the head's pending gradient still counts."""

    def run(model_class, **kwargs):
        inputs = keras.Input((4,))
        base = keras.layers.Dense(3, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(seed=1))
        output = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2))(base(inputs))
        model = model_class(inputs, output, **kwargs)
        model.compile(optimizer=keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), loss="mse")
        x, y = sum_regression(24, 4)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # 3 micro-batches: 1 pending
        base.trainable = False
        model.compile(optimizer=model.optimizer, loss="mse")
        model.fit(x[:8], y[:8], batch_size=8, epochs=1, shuffle=False, verbose=0)
        return model

    reference = run(keras.Model)
    model = run(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu)
    assert max_weight_difference(reference, model) < 1e-5


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_loss_scale_optimizer_around_an_accumulating_optimizer_matches_single_device(mirrored_1x2_cpu, policy):
    def run(model_class, **kwargs):
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(
            3, activation="tanh", dtype=policy, kernel_initializer=keras.initializers.GlorotUniform(seed=1)
        )(inputs)
        output = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2))(hidden)
        model = model_class(inputs, output, **kwargs)
        inner = keras.optimizers.Adam(0.05, gradient_accumulation_steps=2)
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(inner, initial_scale=2.0**6), loss="mse")
        x, y = sum_regression(40, 4)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return model

    reference = run(keras.Model)
    model = run(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu)
    assert max_weight_difference(reference, model) < (1e-5 if policy == "float32" else 1e-3)


class _HandAccumulatedStep(keras_dist.DistributedModel):
    """The hand-written accumulation of pre-Keras-3 answers (a new-user probe): variables, then `tf.cond`."""

    def train_step(self, data):
        if not hasattr(self, "count"):
            self.count = tf.Variable(0, trainable=False)
            self.sums = [tf.Variable(tf.zeros_like(v), trainable=False) for v in self.trainable_variables]
        x, y = data
        self.count.assign_add(1)
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        for total, gradient in zip(self.sums, tape.gradient(loss, self.trainable_variables)):
            total.assign_add(gradient)

        def apply():
            self.optimizer.apply_gradients(zip([s / 2 for s in self.sums], self.trainable_variables))
            self.count.assign(0)
            for total in self.sums:
                total.assign(tf.zeros_like(total))

        tf.cond(tf.equal(self.count, 2), apply, lambda: None)
        return {}


def test_apply_gradients_inside_tf_cond_names_gradient_accumulation_steps(mirrored_1x2_cpu):
    """TensorFlow's own error talked of nested tf.functions and named neither the optimizer nor the remedy."""
    inputs = keras.Input((3,))
    model = _HandAccumulatedStep(inputs, keras.layers.Dense(1)(inputs), strategy=mirrored_1x2_cpu, name="hand")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = np.ones((8, 3), "float32"), np.ones((8, 1), "float32")
    with pytest.raises(RuntimeError, match=r"SGD.apply_gradients\(\) .* tf.cond .*gradient_accumulation_steps=k"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
