"""The inputs a user passes to `fit`/`evaluate`/`predict`: prepared before Keras adapts them,
and distributed through `keras_dist.data` when Keras hands them to the strategy.

Preparing does three things, each a no-op for inputs that do not need it:
a `DatasetCreator` becomes a per-worker distributed dataset; a
`tf.data.Dataset` of single examples is batched to the global batch size;
a Python generator's batches are copied as they are yielded (compat fix
`generator_batch_copies`).
"""

import contextlib
import inspect
import types

import keras
import numpy as np
import tensorflow as tf

from keras_dist import _compat
from keras_dist._runtime import datasets as runtime_datasets
from keras_dist._runtime import distribute_dataset as runtime_distribute_dataset
from keras_dist._runtime import iterator_release, keras_internals
from keras_dist.data import _creator, _distribute


def prepare(x, *, strategy, model, batch_size, batch_size_argument="batch_size"):
    """Returns `x` in a form Keras distributes correctly under `strategy`.

    Args:
        x: Anything `keras.Model.fit` accepts as `x` or `validation_data`, or a
            `keras_dist.data.DatasetCreator`.
        strategy: The model's `tf.distribute.Strategy`.
        model: The `keras.Model` (its input shapes tell batched from unbatched).
        batch_size: Integer global batch size the user passed, or `None`.
        batch_size_argument: String, the name of the `fit` argument that sets
            `batch_size` for this input (for the error message).

    Raises:
        ValueError: `x` is a dataset of single examples and no `batch_size` says
            how to batch them.
    """
    if isinstance(x, _creator.DatasetCreator):
        distributed = strategy.distribute_datasets_from_function(x, options=x.input_options)
        if releases_iterators_off_the_step(strategy):
            iterator_release.hold_iterators_of(distributed)
        return distributed
    if isinstance(x, tf.data.Dataset):
        return _batch_if_unbatched(x, model, batch_size, strategy.num_replicas_in_sync, batch_size_argument)
    if isinstance(x, types.GeneratorType) and _compat.is_active("generator_batch_copies"):
        return copy_batches(x)
    return x


def copy_batches(generator):
    """Yields the batches of `generator` with every NumPy array copied.

    Keras keeps the first batches it peeks at to learn the input's shapes, and
    TensorFlow may keep using an array's memory after it was yielded; a
    generator that refills one buffer (yielding views of it) would otherwise
    have batches overwritten: some examples lost, others seen twice.
    """
    for batch in generator:
        yield keras.tree.map_structure(lambda v: np.array(v, copy=True) if isinstance(v, np.ndarray) else v, batch)


def _batch_if_unbatched(dataset, model, batch_size, num_replicas, batch_size_argument):
    shapes = _input_shapes(model)
    if shapes is None:
        return dataset
    expected = [len(shape) for shape in shapes]
    element = tf.nest.flatten(dataset.element_spec)[: len(expected)]
    ranks = [spec.shape.rank for spec in element if isinstance(spec, tf.TensorSpec)]
    if len(ranks) != len(expected) or any(r is None or r != e - 1 for r, e in zip(ranks, expected)):
        return dataset
    if any(_batch_keras_expands(spec.shape, shape) for spec, shape in zip(element, shapes)):
        return dataset
    if not batch_size:
        shapes = [tuple(spec.shape) for spec in element]
        raise ValueError(
            "The dataset yields single examples, not batches: element shapes "
            f"{shapes}, model input ranks {expected} (batch first). Fix: batch it with "
            "`dataset.batch(global_batch_size)` (under "
            f"{num_replicas} replicas each gets global_batch_size / {num_replicas}), or pass "
            f"`{batch_size_argument}=` to say the global batch size."
        )
    return dataset.batch(batch_size)


def _batch_keras_expands(element_shape, input_shape):
    """Whether an element of `element_shape`, one rank short of `input_shape`, is a batch Keras expands.

    Keras' functional models take an input one rank short of an `Input`
    whose last dimension is 1 and add that dimension (`Functional._adjust_input_rank`):
    keras.io's structured data example batches one column per feature,
    `(batch,)`, for `keras.Input(shape=(1,))`. A single example of such an
    input ends in a static 1 (`(1,)`); an element that does not is a batch
    (a new-user probe: refused as "single examples", and batched again
    with `batch_size=` it failed).
    """
    return input_shape[-1] == 1 and element_shape[-1] != 1


def _input_shapes(model):
    """The model's input shapes (tuples, batch first) where it is a functional model, else `None`."""
    inputs = getattr(model, "inputs", None)
    if not inputs or not keras_internals.is_graph_network(model):
        return None
    try:
        return [tuple(i.shape) for i in inputs]
    except (TypeError, AttributeError):
        return None


def bind_inputs(model, method, args, kwargs, names):
    """Returns `method`'s arguments bound by name, with each input in `names` prepared for the strategy.

    Args:
        model: The `DistributedModel` whose `fit`/`evaluate`/`predict` runs.
        method: `keras.Model.fit`, `.evaluate` or `.predict` (its signature names the arguments).
        args: Tuple, the positional arguments of the call.
        kwargs: Dict, its keyword arguments.
        names: Tuple of argument names holding inputs (`"x"`, `"validation_data"`).

    Raises:
        ValueError: An input is a dataset of single examples and no batch size is given.
    """
    bound = inspect.signature(method).bind(model, *args, **kwargs)
    bound.apply_defaults()
    extra = bound.arguments.pop("kwargs", {})
    arguments = {**bound.arguments, **extra}
    del arguments["self"]
    for name in names:
        value = arguments.get(name)
        if value is None:
            continue
        if name == "validation_data":
            batch_size, hint = arguments.get("validation_batch_size"), "validation_batch_size"
        else:
            batch_size, hint = arguments.get("batch_size"), "batch_size"
        usage = "validation" if name == "validation_data" else method.__name__
        if isinstance(value, tuple) and name == "validation_data":
            arguments[name] = (_prepare_one(model, value[0], batch_size, usage, hint), *value[1:])
        else:
            arguments[name] = _prepare_one(model, value, batch_size, usage, hint)
    return arguments


def _prepare_one(model, x, batch_size, usage, batch_size_argument):
    strategy = model.distribute_strategy
    if isinstance(x, _creator.DatasetCreator):
        plan = _distribute.function_input_plan(strategy, usage)
        model.input_plan = plan
        _distribute.announce(plan, strategy)
    if _distribute.is_distributed(x) and strategy.num_replicas_in_sync > 1:
        # Distributed without the hook below: TensorFlow's flag when the object has it; a `DatasetCreator`'s
        # function datasets have an unknown length, so TensorFlow checks them on several workers.
        retrace_if_the_check_changed(model, usage, runtime_distribute_dataset.asks_every_step(x))
    return prepare(x, strategy=strategy, model=model, batch_size=batch_size, batch_size_argument=batch_size_argument)


@contextlib.contextmanager
def distributing_inputs(model, usages, arguments):
    """Routes Keras' `experimental_distribute_dataset` calls through `keras_dist.data` during one call.

    Keras' TensorFlow trainer hands every input pipeline it builds (training,
    validation, evaluation, prediction) to the strategy's
    `experimental_distribute_dataset`, in that order; for the duration of one
    call the model's own strategy object sends them through
    `distribute_dataset`, which chooses the auto-shard policy and records the
    input plan (a hook of `keras_dist._runtime.distribute_dataset`). Inputs
    already distributed (a `DatasetCreator`) skip it.
    """
    strategy = model.distribute_strategy
    if strategy.num_replicas_in_sync == 1:
        yield
        return
    pending = list(_inputs_keras_distributes(usages, arguments))
    original = runtime_distribute_dataset.keras_distribute(strategy)

    def distribute(dataset, options, distribute_next):
        # Not `distribute_next`: a nested call (Keras' validation `evaluate` inside `fit`) is routed
        # once, by its own hook, not again by the outer call's.
        del distribute_next
        if len(pending) > 1:
            usage, source, batch_size, hint = pending.pop(0)
        else:  # The last input (or an unforeseen one) keeps the last description.
            usage, source, batch_size, hint = pending[0] if pending else (usages[0], None, None, ())
        distributed, plan = _distribute.distribute_dataset(
            strategy,
            dataset,
            usage=usage,
            source=_distribute.describe_source(source),
            distribute=lambda d: original(owning_python_batches(d), options=options),
            auto_shard_policy=model.auto_shard_policy,
            batch_size=batch_size,
            batch_count_hint=hint,
        )
        model.input_plan = plan
        _distribute.announce(plan, strategy)
        retrace_if_the_check_changed(model, usage, runtime_distribute_dataset.asks_every_step(distributed))
        if releases_iterators_off_the_step(strategy):
            iterator_release.hold_iterators_of(distributed)
        return distributed

    with runtime_distribute_dataset.hooking(strategy, distribute):
        yield


def owning_python_batches(dataset):
    """Returns `dataset`, its batches copied if Python made them (fix `python_batches_written_in_place`).

    Only for datasets split over several replicas (the caller's case) that
    run Python (`keras.utils.PyDataset`, generators, `from_generator`,
    `py_function`): TensorFlow may then write into the user's NumPy arrays.
    Other datasets are returned as they are.
    """
    if _compat.is_active("python_batches_written_in_place") and runtime_datasets.calls_python(dataset):
        return runtime_datasets.with_own_buffers(dataset)
    return dataset


def releases_iterators_off_the_step(strategy):
    """Whether the iterators of inputs distributed under `strategy` are destroyed on keras-dist's deleting threads.

    Fix `blocking_iterator_deletion` (`keras_dist._runtime.iterator_release`),
    under `MultiWorkerMirroredStrategy` (the other workers wait in their next
    collective) and `MirroredStrategy` (the step thread waits; Python's cycle
    collector runs the deletion of a finished call's iterator on whatever thread
    it interrupts, and one over a Python generator then held it 60-100 s).
    """
    return isinstance(
        strategy, (tf.distribute.MultiWorkerMirroredStrategy, tf.distribute.MirroredStrategy)
    ) and _compat.is_active("blocking_iterator_deletion")


# The model's function each usage's iterator is given to.
_STEP_FUNCTIONS = {
    "fit": "train_function",
    "validation": "test_function",
    "evaluate": "test_function",
    "predict": "predict_function",
}


def retrace_if_the_check_changed(model, usage, asks):
    """Drops the model's step function for `usage` if it was traced for iterators that check otherwise.

    Whether TensorFlow's distributed iterator asks the other workers before
    each step whether any still has data (`asks_every_step`) is decided per
    distributed dataset, but it is not part of the iterator's `TypeSpec`: a
    `tf.function` traced with an iterator that does not ask is reused for one
    that does, and the workers then stop at different steps and wait for each
    other (a hang, or `WorkerStalledError`). So a model keeps, per step
    function, the kind of iterator it was traced for, and the function is
    rebuilt (traced again on its next call) when an input of the other kind
    comes.

    Args:
        model: The `DistributedModel`.
        usage: String, `"fit"`, `"validation"`, `"evaluate"` or `"predict"`.
        asks: Boolean, whether the new input's iterators ask before each step.
    """
    name = _STEP_FUNCTIONS.get(usage)
    if name is None:
        return
    traced_for = model.__dict__.setdefault("_keras_dist_traced_for_check", {})
    known = name in traced_for
    if (known and traced_for[name] != asks) or (not known and getattr(model, name, None) is not None):
        setattr(model, name, None)
    traced_for[name] = asks


KERAS_ARRAY_BATCH_SIZE = 32  # What Keras batches arrays by when `batch_size` is None.


def array_batch_size(x, batch_size):
    """Returns the global batch size Keras batches `x` by when it is arrays (`batch_size` or 32), else `None`.

    Args:
        x: `fit`'s `x` (arrays, a dict/list of them, a `tf.data.Dataset`, a
            `keras.utils.PyDataset`, a generator).
        batch_size: Integer or `None`, the `batch_size` passed with it.
    """
    return None if _is_dataset(x) else (batch_size or KERAS_ARRAY_BATCH_SIZE)


def _inputs_keras_distributes(usages, arguments):
    """Yields `(usage, source, batch_size, batch_count_hint)` for each input Keras will distribute, in order."""
    x = arguments.get("x")
    validation = arguments.get("validation_data")
    split = arguments.get("validation_split") or 0.0
    if validation is None and split:
        validation = x  # Keras slices the validation examples off the arrays.
    candidates = [
        (usages[0], x, arguments.get("batch_size"), split),
        (
            "validation",
            validation,
            arguments.get("validation_batch_size") or arguments.get("batch_size"),
            split if validation is x else 0.0,
        ),
    ]
    for role, (usage, source, batch_size, source_split) in enumerate(candidates[: len(usages)]):
        if isinstance(source, tuple):
            source = source[0]
        if source is None or _distribute.is_distributed(source):
            continue
        yield (
            usage,
            source,
            array_batch_size(source, batch_size),
            _batch_count_hint(source, batch_size, source_split, role),
        )


def _batch_count_hint(x, batch_size, validation_split, role):
    """Returns integers that fix how many batches Keras makes of the arrays `x`, or `()` for other inputs.

    Keras' array adapter makes `ceil(n / batch_size)` batches of the `n`
    examples it keeps after `validation_split`: the same integers on every
    worker mean the same number of batches (`_distribute.same_number_of_batches`).

    Args:
        x: `fit`'s `x` (or the validation inputs): arrays, a dict/list of them, or any other input.
        batch_size: The `batch_size` argument, or `None`.
        validation_split: Float, the fraction Keras slices off `x` (0.0 for none).
        role: Integer, 0 for the first input of the call, 1 for the validation input.

    Returns:
        A tuple of 4 integers, or `()` when `x` is not arrays.
    """
    if _is_dataset(x):
        return ()
    leaves = [leaf for leaf in keras.tree.flatten(x) if leaf is not None]
    shape = getattr(leaves[0], "shape", None) if leaves else None
    if not shape or shape[0] is None:
        return ()
    return (int(shape[0]), int(batch_size or 0), int(round(float(validation_split) * 2**30)), role)


def _is_dataset(x):
    return isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)) or hasattr(x, "__next__")
