"""keras_dist._runtime: the private Keras/TF internals it reaches still exist, and its patches undo themselves."""

import keras
import pytest
import tensorflow as tf

from keras_dist._runtime import backup_and_restore, distribute_dataset
from keras_dist._runtime import keras_internals as ki


@pytest.mark.parametrize("name", ki.__all__)
def test_every_internal_name_resolves_on_the_installed_keras(name):
    assert getattr(ki, name) is not None


def test_private_optimizer_state_is_where_keras_keeps_it():
    optimizer = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
    optimizer.build([keras.Variable(1.0)])
    counter = ki.raw_iterations(keras.optimizers.LossScaleOptimizer(optimizer))
    counter.assign(3)
    assert (
        int(keras.ops.convert_to_numpy(optimizer.iterations)) == 1
    )  # The public count divides by the accumulation steps.
    assert int(keras.ops.convert_to_numpy(counter)) == 3
    assert not ki.uses_learning_rate_schedule(optimizer)
    assert ki.uses_learning_rate_schedule(
        keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9))
    )


def test_model_attributes():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    assert ki.is_graph_network(model)  # Keras 3 does not set tf.keras' flag.
    strategy = tf.distribute.get_strategy()
    ki.set_distribute_strategy(model, strategy)
    assert model.distribute_strategy is strategy


def test_compile_state_is_where_keras_keeps_it():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    assert ki.compiled_metrics(model) == []
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    model.evaluate(tf.ones((2, 2)), tf.ones((2, 1)), verbose=0)  # Keras builds the compiled metrics here.
    assert [m.name for m in ki.compiled_metrics(model)] == ["mae"]
    ki.record_compile_argument(model, "jit_compile", True)
    assert ki.compile_arguments(model)["jit_compile"] is True
    model.optimizer.build(model.trainable_variables)
    assert [v.path for v in ki.trainable_variables_of(model.optimizer)] == [v.path for v in model.trainable_variables]


def test_tf_functions_behind_keras_train_function():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(keras.ops.ones((4, 2)), keras.ops.ones((4, 1)), verbose=0)
    functions = ki.tf_functions_behind(model.train_function)
    assert functions and sum(f.experimental_get_tracing_count() for f in functions) >= 1
    assert ki.tf_functions_behind(None) == []


class _Strategy:
    def experimental_distribute_dataset(self, dataset, options=None):
        return ("keras", dataset, options)


def test_distribute_dataset_hooks_nest_and_leave_no_trace():
    strategy = _Strategy()
    calls = []

    def outer(dataset, options, distribute_next):
        calls.append("outer")
        return ("outer", distribute_next(dataset, options=options))

    def inner(dataset, options, distribute_next):
        calls.append("inner")
        return ("inner", distribute_next(dataset, options=options))

    with distribute_dataset.hooking(strategy, outer):
        assert strategy.experimental_distribute_dataset(1) == ("outer", ("keras", 1, None))
        with distribute_dataset.hooking(strategy, inner):
            assert strategy.experimental_distribute_dataset(2, options="o") == ("inner", ("outer", ("keras", 2, "o")))
        assert strategy.experimental_distribute_dataset(3) == ("outer", ("keras", 3, None))
    assert "experimental_distribute_dataset" not in strategy.__dict__
    assert calls == ["outer", "inner", "outer", "outer"]
    assert distribute_dataset.keras_distribute(strategy)(4) == ("keras", 4, None)


def test_distribute_dataset_hook_keeps_an_instance_attribute_set_before():
    strategy = _Strategy()

    def users(dataset, options=None):
        return ("user", dataset)

    strategy.experimental_distribute_dataset = users
    with distribute_dataset.hooking(strategy, lambda d, o, distribute_next: ("hook", distribute_next(d))):
        assert strategy.experimental_distribute_dataset(1) == ("hook", ("user", 1))
    assert strategy.experimental_distribute_dataset is users


def test_distribute_dataset_hook_leaves_on_error():
    strategy = _Strategy()
    with pytest.raises(RuntimeError):
        with distribute_dataset.hooking(strategy, lambda d, o, n: n(d)):
            raise RuntimeError("boom")
    assert "experimental_distribute_dataset" not in strategy.__dict__


def test_backup_and_restore_internals(tmp_path):
    backup = keras.callbacks.BackupAndRestore(str(tmp_path))
    assert backup_and_restore.weights_path(backup).startswith(str(tmp_path))
    assert backup_and_restore.metadata_path(backup).endswith(".json")
    assert backup_and_restore.last_batch_seen(backup) == 0
    kept = backup_and_restore.keras_methods(backup)
    assert set(kept) == {"on_epoch_begin", "on_epoch_end", "on_train_end"}
    saved = []
    backup_and_restore.replace_methods(
        backup,
        save_model=lambda: None,
        on_epoch_begin=lambda epoch, logs=None: None,
        on_epoch_end=lambda epoch, logs=None: None,
        on_train_end=lambda logs=None: None,
        save_for_preemption=saved.append,
    )
    assert backup_and_restore.keras_methods(backup) is kept  # Keras' own, not the replacements.
    backup_and_restore.save_for_preemption(backup, 7)
    assert saved == [7]


def test_optimizer_patches_replace_methods_on_the_instance_only():
    from keras_dist._runtime import optimizer_patches

    optimizer = keras.optimizers.SGD(0.1)
    calls = []

    def apply(opt, grads, trainable_variables=None):
        calls.append("apply")

    def build(opt, *args, **kwargs):
        calls.append("build")

    assert optimizer_patches.state(optimizer) is None
    optimizer_patches.install(optimizer, options="first", apply=apply, build=build)
    optimizer_patches.install(optimizer, options="second", apply=apply, build=build)  # Idempotent.
    optimizer.apply([])
    optimizer.build([])
    assert calls == ["apply", "build"]
    assert optimizer_patches.has_installed(optimizer, "apply", apply)
    assert optimizer_patches.state(optimizer).options == "second"
    assert [k for k in vars(optimizer) if k.startswith("_keras_dist")] == ["_keras_dist_state"]
    other = keras.optimizers.SGD(0.1)  # The class keeps Keras' own methods.
    assert not optimizer_patches.has_installed(other, "apply", apply)
    assert optimizer_patches.class_method(optimizer, "apply").__func__ is keras.optimizers.SGD.apply
