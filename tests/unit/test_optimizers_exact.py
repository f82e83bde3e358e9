"""Every Keras optimizer and wrapper trains a DistributedModel exactly like plain Keras on one device.

Each test trains the same tiny model (seeded initializers) on the same batches twice: with
`keras.Model` on one device and with `keras_dist.DistributedModel` on 2 or 3 simulated CPU
replicas, then compares the weights, the optimizer's variables and its iteration count, and
checks that every replica holds the same copy of every mirrored variable. 37 examples in
batches of 8: the last batch (5 examples) splits unevenly over the replicas.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _support import sum_regression
from keras import ops

import keras_dist
from keras_dist._runtime import variables as variables_module
from keras_dist.collectives._optimizer import accumulation_saved_with_weights
from keras_dist.testing import max_weight_difference

O = keras.optimizers  # noqa: E741 (short for the table below)

needs_multi_optimizer = pytest.mark.skipif(
    not hasattr(O, "MultiOptimizer"),
    reason=f"keras.optimizers.MultiOptimizer is new in Keras 3.15 (installed: {keras.__version__})",
)

NUM_EXAMPLES, BATCH_SIZE = 37, 8


def _model(model_class, **kwargs):
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(
        3, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(seed=1), name="hidden"
    )(inputs)
    outputs = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2), name="head")(hidden)
    return model_class(inputs, outputs, **kwargs)


def _fit(model, epochs=1):
    x, y = sum_regression(NUM_EXAMPLES, 4)
    model.fit(x, y, batch_size=BATCH_SIZE, epochs=epochs, shuffle=False, verbose=0)
    return model


def _values(variables):
    return [np.asarray(v) for v in variables]


def _replica_spread(model):
    """Largest difference between any replica's copy of a mirrored variable and replica 0's."""
    strategy = model.distribute_strategy
    spread = 0.0
    for variable in [*model.weights, *model.optimizer.variables]:
        value = variable.value
        if not isinstance(value, tf.distribute.DistributedValues):
            continue
        if value.aggregation == tf.VariableAggregation.SUM:  # On-read sums: each replica's share differs.
            continue
        copies = [np.asarray(c) for c in strategy.experimental_local_results(value)]
        spread = max([spread] + [float(np.max(np.abs(c.astype("float64") - copies[0]))) for c in copies if c.size])
    return spread


def _assert_trains_like_one_device(reference, model, tolerance=1e-5):
    assert max_weight_difference(reference, model) < tolerance
    # Under gradient accumulation the pending sums live in keras-dist's per-replica sums; Keras'
    # accumulators hold them while this block runs, as when the model is saved.
    with accumulation_saved_with_weights(model.optimizer, model.distribute_strategy):
        ours = _values(model.optimizer.variables)
    theirs = _values(reference.optimizer.variables)
    assert [v.shape for v in ours] == [v.shape for v in theirs]
    differences = [float(np.max(np.abs(a.astype("float64") - b))) for a, b in zip(ours, theirs) if a.size]
    assert max(differences, default=0.0) < tolerance
    assert int(np.asarray(model.optimizer.iterations)) == int(np.asarray(reference.optimizer.iterations))
    assert _replica_spread(model) == 0.0


class CopyInitMomentum(O.Optimizer):
    """A user optimizer whose `build` assigns its slots (as ScheduleFreeAdamW does): momentum starts at the weights.

    Update: `m <- 0.5 * m + 0.5 * w - lr * g; w <- m`.
    """

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._starts = self.add_optimizer_variables(var_list, "start")
        for start, variable in zip(self._starts, var_list):
            self.assign(start, ops.copy(variable))

    def update_step(self, gradient, variable, learning_rate):
        start = self._starts[self._get_variable_index(variable)]
        lr = ops.cast(learning_rate, variable.dtype)
        self.assign(start, 0.5 * start + 0.5 * variable - lr * gradient)
        self.assign(variable, start)


class Delegating(O.Optimizer):
    """A user-written wrapper that hands the gradients to another optimizer (as Lookahead-style wrappers do)."""

    def __init__(self, inner, **kwargs):
        super().__init__(learning_rate=0.0, **kwargs)
        self.inner = inner

    def build(self, var_list):
        if self.built:
            return
        self.inner.build(var_list)
        super().build(var_list)

    def apply(self, grads, trainable_variables=None):
        self.inner.apply(grads, trainable_variables)
        self._iterations.assign_add(1)

    @property
    def variables(self):
        return self._variables + self.inner.variables


OPTIMIZERS = {
    "adam": lambda: O.Adam(0.05),
    "adamw": lambda: O.AdamW(0.05, weight_decay=0.1),
    "sgd_momentum": lambda: O.SGD(0.1, momentum=0.9, nesterov=True),
    "rmsprop": lambda: O.RMSprop(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: O.Adagrad(0.1),
    "lion": lambda: O.Lion(0.01),
    "adafactor": lambda: O.Adafactor(0.1),
    "schedule_free_adamw": lambda: O.ScheduleFreeAdamW(0.05),  # Assigns its slots in `build`.
    "copy_init_momentum": lambda: CopyInitMomentum(0.05),
    "adam_ema": lambda: O.Adam(0.05, use_ema=True),
    "adam_ema_overwrite": lambda: O.Adam(0.05, use_ema=True, ema_overwrite_frequency=2),
    "adam_accumulating": lambda: O.Adam(0.05, gradient_accumulation_steps=2),
}

# (replicas, where the optimizer is constructed, when it is built)
CASES = [(2, "outside", "eager"), (2, "inside", "lazy"), (3, "outside", "lazy")]


def _strategy(request, num_replicas):
    return request.getfixturevalue(f"mirrored_1x{num_replicas}_cpu")


def _train_both(make_optimizer, strategy, placement, build, epochs=1):
    """Returns `(one-device keras.Model, DistributedModel)` after the same training.

    The one-device optimizer is always built before `fit`: left to `fit`,
    Keras on one device builds it while tracing the first step, where an
    assign in `build` is lost (ScheduleFreeAdamW's momentum starts at zero
    instead of the weights: Keras 3.15.1). Under any strategy Keras builds it
    before the step, as a `build(...)` call does.
    """
    reference = _model(keras.Model)
    reference.compile(optimizer=make_optimizer(), loss="mse")
    reference.optimizer.build(reference.trainable_variables)
    model = _model(keras_dist.DistributedModel, strategy=strategy)
    if placement == "inside":
        with strategy.scope():
            optimizer = make_optimizer()
    else:
        optimizer = make_optimizer()
    model.compile(optimizer=optimizer, loss="mse")
    if build == "eager":
        model.optimizer.build(model.trainable_variables)  # keras.io style: no strategy scope.
    return _fit(reference, epochs), _fit(model, epochs)


@pytest.mark.parametrize("case", CASES, ids=[f"{n}replicas-{p}-{b}" for n, p, b in CASES])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_trains_like_one_device(request, name, case):
    num_replicas, placement, build = case
    reference, model = _train_both(OPTIMIZERS[name], _strategy(request, num_replicas), placement, build)
    _assert_trains_like_one_device(reference, model)


def test_optimizer_built_in_build_assign_is_on_every_replica(multi_replica_strategy):
    """shared r07: an assign in `build` reached only replica 0's copy (kernel [0.49, -0.01] after one step)."""
    reference, model = _train_both(lambda: CopyInitMomentum(0.05), multi_replica_strategy, "inside", "lazy")
    assert _replica_spread(model) == 0.0
    _assert_trains_like_one_device(reference, model)


@needs_multi_optimizer
def test_multi_optimizer_step_is_the_one_device_step(multi_replica_strategy):
    """shared r09: one SGD(0.1) step on w=1, x=1, y=0 gives 0.8 on one device (was 0.6 on 2 replicas, 0.4 on 3)."""
    inputs = keras.Input((1,))
    model = keras_dist.DistributedModel(
        inputs,
        keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")(inputs),
        strategy=multi_replica_strategy,
    )
    with multi_replica_strategy.scope():
        optimizer = O.MultiOptimizer(O.OptimizerMap(O.SGD(0.1)))
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(np.ones((6, 1), "float32"), np.zeros((6, 1), "float32"), batch_size=6, epochs=1, verbose=0)
    copies = [
        float(np.asarray(c).ravel()[0])
        for c in multi_replica_strategy.experimental_local_results(model.weights[0].value)
    ]
    np.testing.assert_allclose(copies, [0.8] * multi_replica_strategy.num_replicas_in_sync, atol=1e-6)


WRAPPERS = {
    "multi_optimizer": lambda: O.MultiOptimizer(O.OptimizerMap(O.SGD(0.1, momentum=0.9), {"head/.*": O.Adam(0.05)})),
    "multi_optimizer_clipping": lambda: O.MultiOptimizer(
        O.OptimizerMap(O.SGD(0.1, global_clipnorm=0.2), {"head/.*": O.Adam(0.05, clipnorm=0.1)})
    ),
    "multi_optimizer_ema_overwrite": lambda: O.MultiOptimizer(
        O.OptimizerMap(O.SGD(0.1), {"head/.*": O.Adam(0.05, use_ema=True, ema_overwrite_frequency=2)})
    ),
    "multi_optimizer_accumulating": lambda: O.MultiOptimizer(
        O.OptimizerMap(O.SGD(0.1), {"head/.*": O.Adam(0.05, gradient_accumulation_steps=2)})
    ),
    "loss_scale_ema_overwrite": lambda: O.LossScaleOptimizer(O.Adam(0.05, use_ema=True, ema_overwrite_frequency=2)),
    "user_wrapper": lambda: Delegating(O.SGD(0.1, momentum=0.9)),
}


@pytest.mark.parametrize("build", ["lazy", "eager"])
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=needs_multi_optimizer) if n.startswith("multi") else n for n in sorted(WRAPPERS)]
)
def test_wrapper_sums_gradients_once(mirrored_1x3_cpu, name, build):
    """Wrappers created in the scope (MultiOptimizer outside it is another matter: shared r08)."""
    reference, model = _train_both(WRAPPERS[name], mirrored_1x3_cpu, "inside", build)
    _assert_trains_like_one_device(reference, model)


def test_ema_overwrite_keeps_the_moving_averages_of_one_device(mirrored_1x2_cpu):
    """shared r10: `use_ema` with `ema_overwrite_frequency` failed in the first step (merge_call inside Cond)."""

    def optimizer():
        return O.AdamW(0.05, weight_decay=0.1, use_ema=True, ema_overwrite_frequency=3)

    reference, model = _train_both(optimizer, mirrored_1x2_cpu, "outside", "lazy", epochs=2)
    _assert_trains_like_one_device(reference, model)
    averages = _values(model.optimizer._model_variables_moving_average)
    expected = _values(reference.optimizer._model_variables_moving_average)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(averages, expected)) < 1e-5


def test_loss_scale_optimizer_dynamic_scaling_matches_one_device(multi_replica_strategy):
    """mixed_float16: a batch whose float16 gradient overflows is skipped and the scale halved, as on one device."""

    def run(model_class, **kwargs):
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(
            3, activation="tanh", dtype="mixed_float16", kernel_initializer=keras.initializers.GlorotUniform(seed=1)
        )(inputs)
        outputs = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2))(hidden)
        model = model_class(inputs, outputs, **kwargs)
        optimizer = O.LossScaleOptimizer(O.Adam(0.05), initial_scale=2.0**6, dynamic_growth_steps=2)
        model.compile(optimizer=optimizer, loss="mse")
        x, y = sum_regression(NUM_EXAMPLES, 4)
        x[10] = 7e4  # Beyond float16: the second batch's gradient is inf on every split of it.
        model.fit(x, y, batch_size=BATCH_SIZE, epochs=2, shuffle=False, verbose=0)
        return model

    reference = run(keras.Model)
    model = run(keras_dist.DistributedModel, strategy=multi_replica_strategy)
    assert np.isfinite(np.concatenate([w.ravel() for w in model.get_weights()])).all()
    assert max_weight_difference(reference, model) < 1e-3
    for name in ("dynamic_scale", "step_counter"):
        assert float(np.asarray(getattr(model.optimizer, name))) == float(
            np.asarray(getattr(reference.optimizer, name))
        )
    assert float(np.asarray(reference.optimizer.dynamic_scale)) != 2.0**6  # The scale did move.
    assert _replica_spread(model) == 0.0


def test_float16_weights_whose_gradients_times_the_examples_overflow_float16(mirrored_1x2_cpu):
    """A new-user probe: a float16 model (`dtype="float16"`) trained on one device, and was NaN on 2 replicas.

    Its largest gradient entry (about 1.8e3) times a replica's 32 examples passes float16's 65504: float16
    gradients are now multiplied by the replica's share of the examples, not by its count.
    """
    rng = np.random.RandomState(0)
    x = rng.randn(128, 8).astype("float32")
    y = (x @ rng.randn(8, 1) * 1000 + 20).astype("float32")

    def run(model_class, **kwargs):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="relu", dtype="float16")(inputs)
        model = model_class(inputs, keras.layers.Dense(1, dtype="float16")(hidden), **kwargs)
        model.compile(optimizer=O.SGD(1e-6), loss="mse")
        history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0).history
        return model, history

    reference, expected = run(keras.Model)
    model, history = run(keras_dist.DistributedModel, strategy=mirrored_1x2_cpu)
    assert np.isfinite(history["loss"]).all()
    assert max_weight_difference(reference, model) < 1e-3  # float16's rounding (its spacing near 1 is 1e-3).
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=1e-3)


def _strategy_of(request, num_replicas):
    """1: TensorFlow's default strategy (what `KERAS_DIST_CPU_REPLICAS=1` gives); else 2 or 3 mirrored CPU replicas."""
    return tf.distribute.get_strategy() if num_replicas == 1 else _strategy(request, num_replicas)


def _fit_evaluate_predict(model):
    x, y = sum_regression(NUM_EXAMPLES, 4)
    history = model.fit(x, y, batch_size=BATCH_SIZE, epochs=2, shuffle=False, verbose=0)
    evaluation = model.evaluate(x, y, batch_size=BATCH_SIZE, verbose=0, return_dict=True)
    return {"history": history, "evaluate": evaluation, "predict": model.predict(x, batch_size=BATCH_SIZE, verbose=0)}


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_schedule_free_adamw_left_to_fit_matches_one_device(request, num_replicas):
    """A new-user probe: ScheduleFreeAdamW(0.02) compiled and left to `fit` was 0.768 off one device, on 1 replica too.

    Keras on one device builds it while tracing the first step, where the
    momentum `build` assigns (the weights) is lost and stays 0: its loss rose
    (1.058, 1.094) while keras-dist's, built before the step as Keras builds
    it under any strategy, fell (0.967, 0.852). The one-device reference of
    `assert_matches_single_device` builds its optimizers outside the step.
    """

    def build_model(model_class, **kwargs):
        model = _model(model_class, **kwargs)
        model.compile(optimizer=O.ScheduleFreeAdamW(0.02), loss="mse", metrics=["mae"])
        return model

    keras_dist.testing.assert_matches_single_device(
        build_model, strategy=_strategy_of(request, num_replicas), train=_fit_evaluate_predict, atol=1e-5
    )


class OwnScheduleFreeStep(keras_dist.DistributedModel):
    """A model whose own train_step applies an optimizer kept in an attribute (first built in that step)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(3, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(1))
        self.head = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(2))
        self.own_optimizer = O.ScheduleFreeAdamW(0.02)

    def call(self, x):
        return self.head(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, self(x, training=True))
        self.own_optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": loss}


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_optimizer_first_built_in_own_step_trains_the_same_on_one_and_several_replicas(request, num_replicas):
    """ScheduleFreeAdamW applied in a train_step of one's own: 1 replica built it in the trace (momentum lost).

    Several replicas built it outside the step (`optimizer_built_in_step`),
    one replica in the trace, as Keras on one device: after 2 epochs the
    kernels' absolute sums were 1.12 on 1 replica and 14.9 on 2. Now both
    build outside the step; the reference is Keras with the optimizer built
    before `fit`.
    """
    x, y = sum_regression(NUM_EXAMPLES, 4)
    model = OwnScheduleFreeStep(strategy=_strategy_of(request, num_replicas))
    model.compile()
    model(x[:2])  # Builds the layers.
    reference = _model(keras.Model)
    reference.set_weights(model.get_weights())
    optimizer = O.ScheduleFreeAdamW(0.02)
    optimizer.build(reference.trainable_variables)
    for start in range(0, NUM_EXAMPLES, BATCH_SIZE):
        xb, yb = x[start : start + BATCH_SIZE], y[start : start + BATCH_SIZE]
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(yb, reference(xb, training=True))
        optimizer.apply(tape.gradient(loss, reference.trainable_variables), reference.trainable_variables)
    model.fit(x, y, batch_size=BATCH_SIZE, epochs=1, shuffle=False, verbose=0)
    assert max_weight_difference(reference, model) < 1e-5
    ours, theirs = _values(model.own_optimizer.variables), _values(optimizer.variables)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(ours, theirs) if a.size) < 1e-5


def _selected_optimizers(case):
    """`(optimizer, inner optimizers)` for `case`, every one created before `compile`, outside any scope."""
    adam, sgd = O.Adam(0.02), O.SGD(0.1, momentum=0.9)
    if case == "selector":
        return O.MultiOptimizer(lambda v: adam if "hidden" in v.path else sgd), (adam, sgd)
    if case == "optimizer_map":
        return O.MultiOptimizer(O.OptimizerMap(sgd, {"hidden/.*": adam})), (adam, sgd)
    return O.LossScaleOptimizer(adam), (adam,)


@needs_multi_optimizer
@pytest.mark.parametrize("case", ["selector", "optimizer_map", "loss_scale"])
def test_inner_optimizers_created_outside_the_scope_match_one_device(multi_replica_strategy, case):
    """A new-user probe: `MultiOptimizer(lambda v: adam if "hid" in v.path else sgd)`, both made before compile.

    The selector holds them until the MultiOptimizer is built, so `compile`
    did not move them onto the strategy, and `fit` failed on 2 replicas:
    'Mixing different tf.distribute.Strategy objects: MirroredStrategy ...
    is not _DefaultDistributionStrategy'. An `OptimizerMap`'s and a
    `LossScaleOptimizer`'s inner optimizers are known at construction.
    """

    def build_model(model_class, **kwargs):
        model = _model(model_class, **kwargs)
        model.compile(optimizer=_selected_optimizers(case)[0], loss="mse")
        return model

    result = keras_dist.testing.assert_matches_single_device(
        build_model, strategy=multi_replica_strategy, train=_fit_evaluate_predict, atol=1e-5
    )
    for inner in variables_module.nested_optimizers(result.model.optimizer)[1:]:
        assert inner._distribution_strategy is multi_replica_strategy
        assert all(isinstance(v.value, tf.distribute.DistributedValues) for v in inner.variables)
