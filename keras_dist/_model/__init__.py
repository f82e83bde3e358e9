"""Layer 1: `DistributedModel`, a `keras.Model` that trains under a `tf.distribute.Strategy`.

What happens on each worker: every worker builds the same model, resolves the
same kind of strategy, and runs Keras' own `fit`/`evaluate`/`predict`. keras-dist
only (1) creates or re-creates every variable under the strategy's scope and
(2) replaces the few hooks where Keras 3 computes the wrong numbers under a
strategy (see `keras_dist._compat.keras_fixes`).

This module is the facade: each method of `DistributedModel` hands its work to
the module of this package named after the job, passing Keras' own method
(`super().fit`, ...) where the work ends in it:

- `construction`: the constructor's checks, the functional style's class;
- `placement`: every variable under the strategy's scope, seeds, the build;
- `xla`: `compile(jit_compile=True)` as XLA per replica;
- `step_functions`: the train/test functions, step output reduction;
- `step`: which train/test step runs, and what keras-dist's own is handed;
- `user_step`: a step the user wrote, made exact for the global batch;
- `metrics`: metric results from state summed over the replicas;
- `coupling`: a compiled loss or metric that couples a batch's examples, named once;
- `fit`: fit/evaluate/predict (callbacks, resume, SIGTERM, chief-only output);
- `workers`: agreement between workers, chief-only output, lost workers named;
- `saving`: save/save_weights/load_weights on the chief, atomically.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from keras_dist import _compat, collectives
from keras_dist._model import (
    construction,
    coupling,
    metrics,
    monitoring,
    placement,
    saving,
    step,
    step_functions,
    user_step,
    workers,
    xla,
)
from keras_dist._model import fit as fitting
from keras_dist._runtime import keras_internals as ki
from keras_dist._runtime import ragged_padding, step_state
from keras_dist.collectives import _optimizer as collectives_optimizer
from keras_dist.collectives._options import CommunicationValue
from keras_dist.data import _sharding as data_sharding
from keras_dist.strategy import _plan


@keras.saving.register_keras_serializable(package="keras_dist")
class DistributedModel(keras.Model):
    """A `keras.Model` whose `compile`/`fit`/`evaluate`/`predict` run under a strategy.

    Use it wherever you would use `keras.Model`: functionally
    (`DistributedModel(inputs, outputs)`), by subclassing
    (`class MyModel(keras_dist.DistributedModel)`), or wrap a model that
    exists with `keras_dist.distribute(model)`.

    Every variable the model owns lives under the strategy's scope: layer
    weights (also of layers built before the model existed), optimizer
    variables (also of an optimizer constructed outside any scope), metric and
    loss-scale variables.

    Args:
        *args: Keras `Model` arguments (`inputs, outputs` for the functional style).
        strategy: A `tf.distribute.Strategy`, or one of `"auto"`, `"mirrored"`,
            `"multi_worker"`, `"tpu"`, `"one_device"`. Defaults to `"auto"`:
            a TPU when one is reachable; `MultiWorkerMirroredStrategy` when
            `TF_CONFIG` lists more than one task; `MirroredStrategy` over 2+
            GPUs (NCCL) or over simulated CPU replicas
            (`keras_dist.simulate_cpu_replicas`); otherwise one device.
        communication: A `keras_dist.CommunicationOptions` (or a
            `tf.distribute.experimental.CommunicationOptions`, or a dict of
            its fields): how gradients are all-reduced (implementation,
            `bytes_per_pack`, `timeout_seconds`, `compression`). Defaults to
            TensorFlow's choices without compression. Shown in the plan.
        auto_shard_policy: String, how inputs are split across workers:
            `"auto"` (the default: FILE when the input reads at least one file
            per worker, DATA otherwise, or the policy set in a dataset's
            `tf.data.Options`), `"file"`, `"data"` or `"off"`. See
            `keras_dist.data`.
        **kwargs: Keras `Model` keyword arguments (`name`, `trainable`, ...).

    Raises:
        ValueError: `strategy` is an unknown name or an unsupported strategy
            (e.g. `ParameterServerStrategy`), `auto_shard_policy` is unknown,
            `communication` asks for NCCL on a machine without GPUs, or a
            layer is stateful (`LSTM(stateful=True)`) under several replicas.
        TypeError: `strategy` is neither a name nor a `tf.distribute.Strategy`,
            or `communication` is not one of the accepted types.

    Distributed behavior:
        Numerics: for any dataset and batch size, N replicas give the same
        weights as one device on the same global batches (float32, about
        1e-6): each replica's loss is weighted by its share of the global
        batch, and metrics are computed from state summed over replicas.
        `evaluate` counts every example once; `predict` returns rows in input
        order. Non-trainable float layer state (BatchNormalization moving
        statistics) is mean-aggregated, so every replica holds the same copy.
        `distribute_reduction_method` ("auto", "mean", "sum", "first") says how
        the values a custom `train_step`/`test_step` returns are combined.
        Inputs: the batch of any input (`batch_size`, or a dataset's batch) is
        the global batch, split over the replicas so that they differ by at
        most one example; every example is used once per epoch (a last
        partial batch too, unless the dataset drops it with
        `drop_remainder=True`). The first `fit`/`evaluate`/`predict` of each
        input prints its `keras_dist.data.InputPlan` on the chief; the latest
        is `model.input_plan`.

    Example:
    >>> import keras, keras_dist
    >>> inputs = keras.Input((4,))
    >>> model = keras_dist.DistributedModel(inputs, keras.layers.Dense(1)(inputs))
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> model.distribute_strategy.num_replicas_in_sync >= 1
    True
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> DistributedModel:
        for name in construction.OWN_ARGUMENTS:
            kwargs.pop(name, None)
        # The constructor's arguments are `DistributedModel.__init__`'s only when the class keeps that
        # `__init__`; a subclass's own `__init__(encoder, decoder)` decides what reaches ours (see `__init__`).
        if (
            cls.__init__ is DistributedModel.__init__
            and ki.functional_init_arguments(args, kwargs)
            and not issubclass(cls, ki.Functional)
        ):
            return super().__new__(construction.functional_class(cls), *args, **kwargs)
        return super().__new__(cls, *args, **kwargs)

    def __init__(
        self,
        *args: Any,
        strategy: str | tf.distribute.Strategy = "auto",
        communication: CommunicationValue = None,
        auto_shard_policy: str | tf.data.experimental.AutoShardPolicy = "auto",
        **kwargs: Any,
    ) -> None:
        auto_shard_policy = data_sharding.validate_auto_shard_policy(auto_shard_policy)
        communication = collectives.CommunicationOptions.from_value(communication)
        construction.require_gpus_for_nccl(communication)
        resolved = construction.resolve_strategy(strategy)
        with resolved.scope():
            construction.init_keras_model(self, args, kwargs)
        self._distribute_strategy = resolved
        self._distribute_reduction_method: str | None = None
        self.auto_shard_policy = auto_shard_policy
        self.communication = communication
        self.input_plan = None
        _plan.announce(resolved, communication=communication.describe(resolved))
        self._distribute_state()

    def _overrides(self, name):
        """Whether this model's class has its own `name` method (a `train_step` of the user's, ...)."""
        return getattr(type(self), name) is not getattr(DistributedModel, name)

    # ----------------------------------------------------------------- state
    @property
    def distribute_reduction_method(self) -> str:
        """String: how step outputs are combined across replicas (`"auto"` by default)."""
        return getattr(self, "_distribute_reduction_method", None) or "auto"

    @distribute_reduction_method.setter
    def distribute_reduction_method(self, value: str | None) -> None:
        if value is not None and value not in step_functions.REDUCTION_METHODS:
            raise ValueError(
                f"`distribute_reduction_method` must be one of {step_functions.REDUCTION_METHODS}. "
                f"Received: distribute_reduction_method={value!r}."
            )
        self._distribute_reduction_method = value
        self.train_function = self.test_function = None

    def _distribute_state(self):
        """Re-homes every variable this model owns onto its strategy (cheap when nothing moved).

        Called by the train, test and predict functions' factories: ragged
        batches made dense in their replicas are padded as one device pads
        (`ragged_padding`).
        """
        placement.distribute_state(self)
        ragged_padding.installed(self._distribute_strategy)

    # --------------------------------------------------------------- compile
    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Configures the model for training, exactly as `keras.Model.compile`.

        Everything `compile` creates (optimizer, loss and metric state) is
        created under the strategy's scope; an optimizer constructed elsewhere
        is moved onto it.

        `jit_compile=True` under a multi-replica strategy compiles each
        replica's forward and backward pass with XLA; the gradient all-reduce
        and the optimizer update run outside XLA (Keras alone would compile the
        whole step across every replica, which fails). `"auto"` resolves to
        `False` there, as Keras resolves it under any `tf.distribute` strategy.

        Raises:
            ValueError: `jit_compile=True` under a multi-replica strategy with
                a `train_step` that overrides `DistributedModel`'s: keras-dist
                cannot split a user's step into what XLA can compile and the
                collectives it cannot.

        Distributed behavior:
            Under a multi-worker strategy, or a `MirroredStrategy` whose
            all-reduce is `CollectiveAllReduce`, `steps_per_execution` > 1 is
            replaced by 1 with a `KerasDistWarning` (see docs/compat.md).
        """
        replica_jit_compile = xla.take_jit_compile(self, kwargs, overrides_train_step=self._overrides("train_step"))
        step_functions.limit_steps_per_execution(self, kwargs)
        with self._distribute_strategy.scope():
            super().compile(*args, **kwargs)
        xla.remember(self, replica_jit_compile)
        if self.optimizer is not None:
            collectives_optimizer.distributed_optimizer(self.optimizer, self.communication)
        self._distribute_state()

    def compile_from_config(self, config: dict[str, Any]) -> None:
        """Compiles from a saved compile config (what `keras.models.load_model` calls)."""
        saving.compile_from_config(self, config)

    # ----------------------------------------------------- fit / evaluate / predict
    def fit(self, *args: Any, **kwargs: Any) -> keras.callbacks.History:
        """Trains the model, exactly as `keras.Model.fit`.

        `x` and `validation_data` may also be a `keras_dist.data.DatasetCreator`.

        Raises:
            keras_dist.errors.WorkerUnavailableError: Under multi-worker
                training, another worker crashed or stopped answering; the
                message names it.
            ValueError: `x` is a `tf.data.Dataset` of single examples and no
                `batch_size` says how to batch them.
            SystemExit: Status 75 after SIGTERM, once the backup is saved
                (only with a `BackupAndRestore` among the callbacks).

        Distributed behavior:
            Collective: every worker must call `fit` with the same arguments.
            Progress is printed on the chief only (`verbose=0` elsewhere).
            Standard Keras callbacks are made safe on several workers:
            `ModelCheckpoint` and `BackupAndRestore` write through `save` /
            `save_weights` (chief only, atomically), `CSVLogger` and
            `TensorBoard` run on the chief only, and a `stop_training` set on
            any worker stops all of them at the same batch or epoch boundary
            (docs/callbacks.md). With a `BackupAndRestore`, a backup taken
            mid-epoch resumes at the step after it, and SIGTERM makes every
            worker save one backup at the same step and exit the process
            with status 75 ("restart me").
        """
        return fitting.fit(self, super().fit, args, kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """Evaluates the model, exactly as `keras.Model.evaluate` (see `fit` for errors)."""
        return fitting.evaluate(self, super().evaluate, args, kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """Predicts, exactly as `keras.Model.predict`: every worker gets all rows in input order."""
        return fitting.predict(self, super().predict, args, kwargs)

    def predict_on_batch(self, x: Any) -> Any:
        """Returns predictions for one batch, split across the replicas like `predict`.

        Keras 3 hands the undivided batch to every replica and concatenates the
        results, returning `num_replicas_in_sync` times too many rows.
        """
        if self._distribute_strategy.num_replicas_in_sync == 1 or not _compat.is_active("predict_on_batch_split"):
            return super().predict_on_batch(x)
        return fitting.predict_on_batch(self, x)

    # ------------------------------------------------------------ saving
    def save(self, filepath: str, *args: Any, **kwargs: Any) -> None:
        """Saves the model, as `keras.Model.save`, atomically and on the chief only.

        The file is written under a temporary name in the same directory and
        renamed to `filepath` (a crash mid-write leaves the previous file, never
        a half one). Under several workers only the chief writes; every worker
        returns once the file is complete.

        Raises:
            RuntimeError: On a non-chief worker, when the chief failed to
                write; on the chief, when the other workers did not call
                `save` within `KERAS_DIST_WRITE_TIMEOUT` seconds. On the
                chief, whatever `keras.Model.save` raises.

        Distributed behavior:
            Collective under several workers: every worker must call it
            (callbacks such as `ModelCheckpoint` do).
        """
        return saving.save(self, super().save, filepath, args, kwargs)

    def save_weights(self, filepath: str, *args: Any, **kwargs: Any) -> None:
        """Saves the weights, as `keras.Model.save_weights`, atomically and on the chief only (see `save`)."""
        return saving.save_weights(self, super().save_weights, filepath, args, kwargs)

    def load_weights(self, filepath: str, *args: Any, **kwargs: Any) -> None:
        """Loads weights, as `keras.Model.load_weights`; a partial gradient-accumulation cycle saved with them continues."""
        return saving.load_weights(self, super().load_weights, filepath, args, kwargs)

    def _agreement(self):
        return workers.agreement(self)

    # ------------------------------------------------------------ the steps
    def train_step(self, data: Any) -> dict[str, Any]:
        """Keras' `train_step`, with each replica's loss counted as in the global batch's loss.

        Every way of writing a compiled loss gives the gradient and the
        logged value of the global batch's loss: each loss term counts by
        its own divisor (examples; unmasked tokens; sample weights' sum; none
        for `"sum"`), see `keras_dist._runtime.steps.train_step`. The
        optimizer `compile` sets up sums the gradients over the replicas
        (with `communication`'s packing, timeout and compression) before it
        applies them (`keras_dist.distributed_optimizer`), so gradient
        clipping acts on the global gradient. With `compile(jit_compile=True)`
        under a multi-replica strategy the forward and backward pass is
        compiled with XLA per replica (see `compile`).
        """
        if step.uses_keras_step(self):
            return super().train_step(data)
        return step.train_step(self, data, overrides_metrics_result=self._overrides("get_metrics_result"))

    def test_step(self, data: Any) -> dict[str, Any]:
        """Keras' `test_step`, with the logged loss the global batch's (each loss term by its own divisor)."""
        if step.uses_keras_step(self):
            return super().test_step(data)
        return step.test_step(self, data)

    def compute_loss(
        self, x: Any = None, y: Any = None, y_pred: Any = None, sample_weight: Any = None, training: bool = True
    ) -> Any:
        """Keras' `compute_loss`; inside a `train_step` of your own, made exact for the global batch.

        Called from a `train_step`/`test_step` you wrote (keras.io's
        "customizing what happens in fit"), it returns this replica's loss
        such that the gradients `apply_gradients` sums, and a
        `keras.metrics.Mean` tracker of it, are those of the global batch's
        loss: with masks, `"sum"` reductions or sample-weight means, each
        term counts by its own divisor (one small all-reduce). Elsewhere it
        is Keras' own.
        """
        current = step_state.current()
        if current is None or not current.user_step:
            return super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)
        return user_step.compute_loss(
            self,
            lambda: super(DistributedModel, self).compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
            ),
            current,
        )

    @property
    def custom_step_losses(self) -> str:
        """String, what the losses of a `train_step`/`test_step` you wrote are: `"mean"` (the default) or `"global"`.

        `"mean"`: as keras.io writes them, each replica's step computes the
        mean loss of its own examples (`ops.mean`, `self.compute_loss`, a
        `keras.losses.Loss`); keras-dist weights each replica's gradients by
        its share of the global batch's examples, and scalar
        `keras.metrics.Mean` trackers log the global batch's values.
        `"global"`: as TensorFlow's distributed training guide writes them,
        the step scales its own loss for the global batch
        (`tf.nn.compute_average_loss(per_example, global_batch_size=...)`);
        gradients are summed as they are and Keras' own loss scaling stays.
        """
        return self.__dict__.get("_keras_dist_custom_step_losses", "mean")

    @custom_step_losses.setter
    def custom_step_losses(self, value: str) -> None:
        user_step.check_custom_step_losses(value)
        self.__dict__["_keras_dist_custom_step_losses"] = value
        self.train_function = self.test_function = None

    def get_metrics_result(self) -> dict[str, Any]:
        """Returns the metric results, computed from state summed over all replicas."""
        return metrics.get_metrics_result(self, super().get_metrics_result)

    def _metrics_result_from_summed_state(self, strategy):
        """Metric results from state summed over all replicas, in one all-reduce (see `metrics.result_from_summed_state`)."""
        return metrics.result_from_summed_state(self, strategy, super().get_metrics_result)

    # ------------------------------------------------------ step functions, build
    def make_train_function(self, force: bool = False) -> Any:
        self._distribute_state()
        coupling.check_once(self, own_step=not self._overrides("train_step"))
        if getattr(self, "optimizer", None) is not None:
            collectives_optimizer.prepare_gradient_accumulation(
                self.optimizer, self._distribute_strategy, self.trainable_weights
            )
        if self.train_function is None or force or not monitoring.train_function_is_current(self):
            xla.rebuild_forward_backward(self)
            self.train_function = step_functions.make(
                self,
                self.train_step,
                user_written=self._overrides("train_step"),
                marks=monitoring.step_marks_of(self),
            )
            monitoring.train_function_built(self)
        self.train_function = monitoring.tracked_function(self.train_function, "train")
        return self.train_function

    def make_test_function(self, force: bool = False) -> Any:
        self._distribute_state()
        coupling.check_once(self, own_step=not self._overrides("test_step"))
        if self.test_function is None or force:
            self.test_function = step_functions.make(self, self.test_step, user_written=self._overrides("test_step"))
        self.test_function = monitoring.tracked_function(self.test_function, "test")
        return self.test_function

    def make_predict_function(self, force: bool = False) -> Any:
        self._distribute_state()
        super().make_predict_function(force=force)  # Sets self.predict_function (and returns it, or None).
        if self._distribute_strategy.num_replicas_in_sync > 1:
            step_functions.trace_predict_for_any_batch(self)
        return monitoring.track_predict_function(self)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        placement.build(self, iterator=iterator, data_batch=data_batch)
