"""Layer 1: `DistributedModel`, a `keras.Model` that trains under a `tf.distribute.Strategy`.

What happens on each worker: every worker builds the same model, resolves the
same kind of strategy, and runs Keras' own `fit`/`evaluate`/`predict`. keras-dist
only (1) creates or re-creates every variable under the strategy's scope and
(2) replaces the few hooks where Keras 3 computes the wrong numbers under a
strategy (see `keras_dist._compat.keras_fixes`).
"""

import contextlib
import os
import warnings

import keras
import tensorflow as tf

from keras_dist import _compat, collectives, errors
from keras_dist._runtime import build_context, empty_batch, step_state, steps, variables
from keras_dist._runtime import keras_internals as ki
from keras_dist._runtime import layers as runtime_layers
from keras_dist.callbacks import _adapt as callbacks_adapt
from keras_dist.callbacks import _coordination as callbacks_coordination
from keras_dist.callbacks import _resume as callbacks_resume
from keras_dist.collectives import _all_reduce as collectives_all_reduce
from keras_dist.collectives import _optimizer as collectives_optimizer
from keras_dist.data import _distribute as data_distribute
from keras_dist.data import _inputs as data_inputs
from keras_dist.data import _sharding as data_sharding
from keras_dist.strategy import _cluster, _peer_errors, _plan, _resolve

_REDUCTION_METHODS = ("auto", "mean", "sum", "first")
_CUSTOM_STEP_LOSSES = ("mean", "global")
_OWN_ARGUMENTS = ("strategy", "communication", "auto_shard_policy")  # DistributedModel's, not keras.Model's.
_FUNCTIONAL_CLASSES = {}
# What TensorFlow raises when a peer crashed, stopped answering or missed a collective.
_PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.AbortedError)


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
            or `communication` asks for NCCL on a machine without GPUs.
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

    def __new__(cls, *args, **kwargs):
        for name in _OWN_ARGUMENTS:
            kwargs.pop(name, None)
        # The constructor's arguments are `DistributedModel.__init__`'s only when the class keeps that
        # `__init__`; a subclass's own `__init__(encoder, decoder)` decides what reaches ours (see `__init__`).
        if (
            cls.__init__ is DistributedModel.__init__
            and ki.functional_init_arguments(args, kwargs)
            and not issubclass(cls, ki.Functional)
        ):
            return super().__new__(_functional_class(cls), *args, **kwargs)
        return super().__new__(cls, *args, **kwargs)

    def __init__(self, *args, strategy="auto", communication=None, auto_shard_policy="auto", **kwargs):
        auto_shard_policy = data_sharding.validate_auto_shard_policy(auto_shard_policy)
        communication = collectives.CommunicationOptions.from_value(communication)
        _require_gpus_for_nccl(communication)
        resolved = _resolve.resolve_strategy(strategy)
        if tf.distribute.has_strategy() and tf.distribute.get_strategy() is not resolved:
            raise ValueError(
                "A DistributedModel must be created under its own strategy's scope or under "
                f"none. Received: strategy={type(resolved).__name__} inside the scope of "
                f"another {type(tf.distribute.get_strategy()).__name__}. Fix: leave "
                '`strategy="auto"` to use the enclosing scope\'s strategy, or create the '
                "model outside `with strategy.scope():`."
            )
        with resolved.scope():
            if ki.functional_init_arguments(args, kwargs):
                if not isinstance(self, ki.Functional):
                    # A subclass's own __init__ passed (inputs, outputs) on. keras.Model.__init__ would
                    # rewrite this class's bases for good; this instance alone becomes functional instead.
                    self.__class__ = _functional_class(type(self))
                ki.Functional.__init__(self, *args, **kwargs)
            else:
                keras.Model.__init__(self, *args, **kwargs)
        self._distribute_strategy = resolved
        self._distribute_reduction_method = None
        self.auto_shard_policy = auto_shard_policy
        self.communication = communication
        self.input_plan = None
        _plan.announce(resolved, communication=communication.describe())
        self._distribute_state()

    # ----------------------------------------------------------------- state
    @property
    def distribute_reduction_method(self):
        """String: how step outputs are combined across replicas (`"auto"` by default)."""
        return getattr(self, "_distribute_reduction_method", None) or "auto"

    @distribute_reduction_method.setter
    def distribute_reduction_method(self, value):
        if value is not None and value not in _REDUCTION_METHODS:
            raise ValueError(
                f"`distribute_reduction_method` must be one of {_REDUCTION_METHODS}. "
                f"Received: distribute_reduction_method={value!r}."
            )
        self._distribute_reduction_method = value
        self.train_function = self.test_function = None

    def _distribute_state(self):
        """Re-homes every variable this model owns onto its strategy (cheap when nothing moved)."""
        strategy = self._distribute_strategy
        if _compat.is_active("empty_batch_convolution") and variables.is_multi_replica(strategy):
            empty_batch.install(lambda: _compat.is_active("empty_batch_convolution"))
        if _compat.is_active("empty_replica_batch_norm") and variables.is_multi_replica(strategy):
            guarded = [
                runtime_layers.guard_empty_batch_moments(bn) for bn in runtime_layers.batch_normalization_layers(self)
            ]
            if any(guarded):
                self.train_function = None
        if _compat.is_active("mirrored_layer_state") and variables.is_multi_replica(strategy):
            for v in self.weights:
                if not v.trainable and v.aggregation == "none" and "float" in v.dtype:
                    variables.set_aggregation(v, "mean")
        try:
            metrics_variables = self.metrics_variables
        except AttributeError:  # A `metrics` property reading attributes set after __init__.
            metrics_variables = []
        owned = {id(v): v for v in [*self.variables, *self.weights, *metrics_variables]}
        moved = sum(variables.rehome(v, strategy) for v in owned.values())
        self._decorrelate_seeds(owned.values())
        optimizers = self._owned_optimizers()
        multi_replica = variables.is_multi_replica(strategy)
        for optimizer in optimizers:
            if _compat.is_active("optimizer_strategy"):
                moved += variables.rehome_optimizer(optimizer, strategy)
            if (
                multi_replica
                and _compat.is_active("optimizer_built_in_step")
                and variables.build_outside_step(optimizer)
            ):
                self.train_function = None
        if moved:
            for optimizer in optimizers:
                variables.reindex_optimizer(optimizer)
            self.train_function = self.test_function = self.predict_function = None

    def _owned_optimizers(self):
        """The compiled optimizer and those kept in the model's attributes (a GAN's `d_optimizer`, `g_optimizer`).

        An optimizer in an attribute, which `compile` did not set up, is made
        to sum its gradients over the replicas before it applies them, as the
        compiled one (`keras_dist.distributed_optimizer`, with `communication`).
        """
        compiled = getattr(self, "optimizer", None)
        found = variables.optimizers_in(vars(self).values())
        for optimizer in found:
            if optimizer is not compiled and not collectives_optimizer.is_distributed_optimizer(optimizer):
                collectives_optimizer.distributed_optimizer(optimizer, self.communication)
        if compiled is not None and all(o is not compiled for o in found):
            found.insert(0, compiled)
        return found

    def _decorrelate_seeds(self, candidates):
        strategy = self._distribute_strategy
        if not (_compat.is_active("replica_seed_state") and variables.is_multi_replica(strategy)):
            return
        done = self.__dict__.setdefault("_keras_dist_seeded", {})
        for v in candidates:
            if v.name == variables.SEED_STATE_NAME and done.get(id(v)) is not v.value:
                variables.decorrelate_seed_state(v, strategy)
                done[id(v)] = v.value

    # --------------------------------------------------------------- compile
    def compile(self, *args, **kwargs):
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
            Under a multi-worker strategy `steps_per_execution` > 1 is
            replaced by 1 with a `KerasDistWarning` (see docs/compat.md).
        """
        strategy = self._distribute_strategy
        jit_compile = kwargs.get("jit_compile", "auto")
        replica_jit_compile = False
        if _compat.is_active("jit_compile_mirrored") and variables.is_multi_replica(strategy):
            replica_jit_compile = self._replica_jit_compile(jit_compile, kwargs.get("run_eagerly", False))
            kwargs["jit_compile"] = False  # Keras would compile the step across every replica at once.
        steps_per_execution = kwargs.get("steps_per_execution", 1)
        if (
            steps_per_execution != 1
            and variables.is_multi_worker(strategy)
            and _compat.is_active("multi_worker_steps_per_execution")
        ):
            warnings.warn(
                "`steps_per_execution` > 1 is not supported under MultiWorkerMirroredStrategy yet "
                "(TensorFlow fails on collectives inside Keras' multi-step loop); using 1. "
                f"Received: steps_per_execution={steps_per_execution}. The results are the same; "
                "pass steps_per_execution=1 to silence this warning.",
                errors.KerasDistWarning,
                stacklevel=2,
            )
            kwargs["steps_per_execution"] = 1
        with strategy.scope():
            super().compile(*args, **kwargs)
        self.__dict__["_keras_dist_replica_jit_compile"] = replica_jit_compile
        if replica_jit_compile:  # Saved with the model, so that a loaded one compiles each replica's pass again.
            self._compile_config.config["jit_compile"] = True
        if self.optimizer is not None:
            collectives_optimizer.distributed_optimizer(self.optimizer, self.communication)
        self._distribute_state()

    def _replica_jit_compile(self, jit_compile, run_eagerly):
        """Resolves `compile(jit_compile=...)` under a multi-replica strategy: compile each replica's pass with XLA?"""
        if jit_compile is not True or run_eagerly:
            return False  # "auto": Keras itself picks no XLA under tf.distribute; run_eagerly wins, as in Keras.
        if type(self).train_step is not DistributedModel.train_step:
            raise ValueError(
                "`jit_compile=True` under a multi-replica strategy needs DistributedModel's own "
                f"`train_step`: keras-dist compiles each replica's forward and backward pass with XLA and "
                f"runs the gradient all-reduce outside it, and cannot split an overriding `train_step` "
                f"({type(self).__qualname__}.train_step) that way. Received: jit_compile=True, "
                f"num_replicas_in_sync={self._distribute_strategy.num_replicas_in_sync}. Fix: pass "
                "`jit_compile=False`, or compile your own forward and backward pass inside `train_step` "
                "with `tf.function(jit_compile=True)` and call `self.optimizer.apply` outside it."
            )
        if not ki.model_supports_jit(self):
            warnings.warn(
                "Model doesn't support `jit_compile=True` (a layer has `supports_jit=False`). "
                "Proceeding with `jit_compile=False`.",
                stacklevel=3,
            )
            return False
        return True

    def compile_from_config(self, config):
        """Compiles from a saved compile config (what `keras.models.load_model` calls)."""
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            with self._distribute_strategy.scope():
                self.optimizer.build(self.trainable_variables)

    # ----------------------------------------------------- fit / evaluate / predict
    def fit(self, *args, **kwargs):
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
        arguments = data_inputs.bind_inputs(self, keras.Model.fit, args, kwargs, ("x", "validation_data"))
        backups = callbacks_resume.backups_in(arguments.get("callbacks"))
        resume_point = callbacks_resume.ResumePoint(0)
        if backups and not data_distribute.is_distributed(arguments.get("x")):
            # A DatasetCreator's input is built per worker by the user: it resumes at the epoch.
            resume_point = callbacks_resume.ResumePoint(callbacks_resume.steps_done_in_epoch(backups[0]))
        arguments["callbacks"] = callbacks_adapt.adapt_callbacks(
            arguments.get("callbacks"), self, self._agreement(), resume_point=resume_point
        )
        agree_on_stop = arguments["callbacks"][-1]
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._naming_lost_workers())
            stack.enter_context(data_inputs.distributing_inputs(self, ["fit", "validation"], arguments))
            stack.enter_context(
                callbacks_resume.skipping_resumed_steps(
                    self,
                    resume_point,
                    callbacks_resume.epoch_length_is_known(arguments.get("x"), arguments.get("steps_per_epoch")),
                )
            )
            if backups:
                stack.enter_context(callbacks_resume.catching_sigterm())
            history = super().fit(**self._chief_only_verbosity(arguments))
        if agree_on_stop.preempted:
            print(
                f"keras-dist: SIGTERM: every worker saved a backup in {backups[0].backup_dir!r} and stopped; "
                f"exiting with status {callbacks_resume.RESTART_EXIT_STATUS} (run the same command again to resume).",
                flush=True,
            )
            raise SystemExit(callbacks_resume.RESTART_EXIT_STATUS)
        return history

    # ------------------------------------------------------------ saving
    def save(self, filepath, *args, **kwargs):
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
        with collectives_optimizer.accumulation_saved_with_weights(
            getattr(self, "optimizer", None), self._distribute_strategy
        ):
            if _asks_before_overwriting(filepath, args, kwargs):  # Keras' interactive prompt, on the real path.
                return super().save(filepath, *args, **kwargs)
            return self._agreement().chief_writes(
                lambda path: super(DistributedModel, self).save(path, *args, **kwargs),
                filepath,
                atomic=kwargs.get("zipped") is not False,  # zipped=False writes a directory: not renamed atomically.
            )

    def save_weights(self, filepath, *args, **kwargs):
        """Saves the weights, as `keras.Model.save_weights`, atomically and on the chief only (see `save`)."""
        with collectives_optimizer.accumulation_saved_with_weights(
            getattr(self, "optimizer", None), self._distribute_strategy
        ):
            if _asks_before_overwriting(filepath, args, kwargs):
                return super().save_weights(filepath, *args, **kwargs)
            return self._agreement().chief_writes(
                lambda path: super(DistributedModel, self).save_weights(path, *args, **kwargs),
                filepath,
                extensions=(".weights.h5", ".weights.json"),
            )

    def load_weights(self, filepath, *args, **kwargs):
        """Loads weights, as `keras.Model.load_weights`; a partial gradient-accumulation cycle saved with them continues."""
        result = super().load_weights(filepath, *args, **kwargs)
        collectives_optimizer.accumulation_loaded_with_weights(
            getattr(self, "optimizer", None), self._distribute_strategy
        )
        return result

    def _agreement(self):
        agreement = self.__dict__.get("_keras_dist_agreement")
        if agreement is None or agreement.strategy is not self._distribute_strategy:
            agreement = callbacks_coordination.WorkerAgreement(self._distribute_strategy)
            self.__dict__["_keras_dist_agreement"] = agreement
        return agreement

    def evaluate(self, *args, **kwargs):
        """Evaluates the model, exactly as `keras.Model.evaluate` (see `fit` for errors)."""
        arguments = data_inputs.bind_inputs(self, keras.Model.evaluate, args, kwargs, ("x",))
        with self._naming_lost_workers(), data_inputs.distributing_inputs(self, ["evaluate"], arguments):
            return super().evaluate(**self._chief_only_verbosity(arguments))

    def predict(self, *args, **kwargs):
        """Predicts, exactly as `keras.Model.predict`: every worker gets all rows in input order."""
        arguments = data_inputs.bind_inputs(self, keras.Model.predict, args, kwargs, ("x",))
        with self._naming_lost_workers(), data_inputs.distributing_inputs(self, ["predict"], arguments):
            return super().predict(**self._chief_only_verbosity(arguments))

    def _chief_only_verbosity(self, kwargs):
        if variables.is_multi_worker(self._distribute_strategy) and not _plan.is_chief(self._distribute_strategy):
            kwargs = {**kwargs, "verbose": 0}
        return kwargs

    @contextlib.contextmanager
    def _naming_lost_workers(self):
        if not variables.is_multi_worker(self._distribute_strategy):
            yield
            return
        try:
            yield
        except (tf.errors.InvalidArgumentError, tf.errors.InternalError) as e:  # Mismatched collectives raise either.
            info = _cluster.cluster_from_environment()
            if collectives_all_reduce.GRADIENT_STRUCTURE_MISMATCH in e.message:
                raise RuntimeError(_peer_errors.gradient_structure_message(info, e.message)) from e
            mismatched = "collective" in e.message.lower() and (
                isinstance(e, tf.errors.InvalidArgumentError)
                or "expected type" in e.message
                or "mismatch" in e.message.lower()
            )
            if not mismatched:
                raise
            raise RuntimeError(_peer_errors.out_of_step_message(info, e.message)) from e
        except _PEER_ERRORS as e:
            during = "collective" if isinstance(e, tf.errors.DeadlineExceededError) else "training"
            raise _peer_errors.worker_unavailable_error(
                _cluster.cluster_from_environment(),
                e.message,
                during=during,
                timeouts=_resolve.timeouts_from_environment(),
            ) from e

    # ------------------------------------------------------------ the steps
    def train_step(self, data):
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
        strategy = self._distribute_strategy
        if strategy.num_replicas_in_sync == 1 or not _compat.is_active("example_weighted_loss"):
            return super().train_step(data)
        return steps.train_step(
            self,
            data,
            options=self.communication.to_tensorflow(),
            forward_backward=self.__dict__.get("_keras_dist_forward_backward"),
            ride_along=collectives_optimizer.weighs_examples_in_all_reduce(getattr(self, "optimizer", None)),
            summed_metrics=_SummedMetrics(self),
        )

    def test_step(self, data):
        """Keras' `test_step`, with the logged loss the global batch's (each loss term by its own divisor)."""
        if self._distribute_strategy.num_replicas_in_sync == 1 or not _compat.is_active("example_weighted_loss"):
            return super().test_step(data)
        return steps.test_step(self, data, options=self.communication.to_tensorflow())

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """Keras' `compute_loss`; inside a `train_step` of your own, made exact for the global batch.

        Called from a `train_step`/`test_step` you wrote (keras.io's
        "customizing what happens in fit"), it returns this replica's loss
        such that the gradients `apply_gradients` sums, and a
        `keras.metrics.Mean` tracker of it, are those of the global batch's
        loss: with masks, `"sum"` reductions or sample-weight means, each
        term counts by its own divisor (one small all-reduce). Elsewhere it
        is Keras' own.
        """
        step = step_state.current()
        if step is None or not step.user_step:
            return super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)
        return steps.user_step_loss(
            self,
            lambda: super(DistributedModel, self).compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
            ),
            step,
            self.communication.to_tensorflow(),
        )

    @property
    def custom_step_losses(self):
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
    def custom_step_losses(self, value):
        if value not in _CUSTOM_STEP_LOSSES:
            raise ValueError(
                f"`custom_step_losses` must be one of {_CUSTOM_STEP_LOSSES}. Received: custom_step_losses={value!r}. "
                "Fix: 'mean' for a train_step that computes its replica's mean loss (keras.io), 'global' for one "
                "that scales its loss for the global batch (tf.nn.compute_average_loss)."
            )
        self.__dict__["_keras_dist_custom_step_losses"] = value
        self.train_function = self.test_function = None

    def _user_step(self, step):
        """`step` (a train or test step of the user's own) run as exact for the global batch (see `custom_step_losses`)."""
        if (
            self._distribute_strategy.num_replicas_in_sync == 1
            or self.custom_step_losses == "global"
            or not _compat.is_active("custom_step_example_weighting")
        ):
            return step

        def run(data):
            with steps.user_step(self, data, options=self.communication.to_tensorflow()):
                return self._with_global_metric_results(step(data))

        return run

    def _with_global_metric_results(self, logs):
        """`logs` a step of yours returned, each value named after one of `self.metrics` replaced by its global result.

        keras.io returns `{m.name: m.result() for m in self.metrics}`: on a
        replica `m.result()` reads that replica's state only, and Keras averages
        the replicas' results, which an uneven split makes differ from one
        device's. The metrics' state summed over the replicas (one all-reduce)
        gives one device's results; other values are left as they are.
        """
        if not isinstance(logs, dict) or not _compat.is_active("cross_replica_metrics"):
            return logs
        names = {m.name for m in self.metrics}
        if not any(key in names for key in logs):
            return logs
        results = tf.distribute.get_replica_context().merge_call(self._metrics_result_from_summed_state)
        merged = dict(logs)
        for key, value in logs.items():
            if key not in names:
                continue
            if isinstance(value, dict):  # A metrics container (`compile_metrics`): one result per metric it holds.
                merged[key] = {name: results.get(name, part) for name, part in value.items()}
            elif key in results:
                merged[key] = results[key]
        return merged

    def get_metrics_result(self):
        """Returns the metric results, computed from state summed over all replicas."""
        context = tf.distribute.get_replica_context()
        if (
            context is None
            or self._distribute_strategy.num_replicas_in_sync == 1
            or not _compat.is_active("cross_replica_metrics")
        ):
            return super().get_metrics_result()
        return context.merge_call(self._metrics_result_from_summed_state)

    def _metrics_result_from_summed_state(self, strategy):
        """Metric results from state summed over all replicas, in one all-reduce (cross-replica context).

        Reading each sync-on-read metric variable would sum it with its own
        all-reduce (two per `Mean` metric, one collective each per step under
        several workers); `batch_reduce_to` sums them all in one packed
        collective, and Keras computes the results from those sums.
        """
        summed = [
            v
            for metric in self.metrics
            for v in metric.variables
            if isinstance(v.value, tf.distribute.DistributedValues)
            and v.value.aggregation == tf.VariableAggregation.SUM
        ]
        if not summed:
            return super().get_metrics_result()
        reduced = strategy.extended.batch_reduce_to(
            tf.distribute.ReduceOp.SUM, [(v.value, v.value) for v in summed], options=self.communication.to_tensorflow()
        )
        with keras.StatelessScope(
            state_mapping=[(v, strategy.experimental_local_results(r)[0]) for v, r in zip(summed, reduced)]
        ):
            return super().get_metrics_result()

    def _reduce_in_replica_context(self, outputs, step_name):
        """Applies `distribute_reduction_method` so every replica returns the reduced value.

        Only to the outputs of a step you wrote (`step_name` overridden): they
        may differ between replicas. keras-dist's own steps return values
        already equal on every replica (the metrics of the global batch),
        which a "sum" would multiply by the replicas.
        """
        method = self.distribute_reduction_method
        num_replicas = self._distribute_strategy.num_replicas_in_sync
        if (
            method == "auto"
            or num_replicas == 1
            or not _compat.is_active("distribute_reduction_method")
            or self._returns_synchronized_outputs(step_name)
        ):
            return outputs
        context = tf.distribute.get_replica_context()

        def reduce(value):
            if not isinstance(value, (tf.Tensor, tf.Variable)):
                return value
            value = tf.identity(value)  # On this replica's device: a result made in cross-replica context has none.
            if method == "first":
                is_first = tf.equal(context.replica_id_in_sync_group, 0)
                value = tf.where(is_first, value, tf.zeros_like(value))
            return context.all_reduce("MEAN" if method == "mean" else "SUM", value)

        return tf.nest.map_structure(reduce, outputs)

    def _returns_synchronized_outputs(self, step_name):
        """Whether `step_name` returns the same values on every replica: keras-dist's or Keras' own step, metrics summed over replicas.

        An overriding step may return per-replica values (e.g. a loss tensor);
        those keep Keras' mean over the replicas.
        """
        own = {"train_step": DistributedModel.train_step, "test_step": DistributedModel.test_step}[step_name]
        return getattr(type(self), step_name) is own and _compat.is_active("cross_replica_metrics")

    def _needs_replica_axis(self):
        return _compat.is_active("multi_worker_output_reduction") and variables.is_multi_worker(
            self._distribute_strategy
        )

    def make_train_function(self, force=False):
        self._distribute_state()
        if getattr(self, "optimizer", None) is not None:
            collectives_optimizer.prepare_gradient_accumulation(
                self.optimizer, self._distribute_strategy, self.trainable_weights
            )
        if self.train_function is None or force:
            self.__dict__["_keras_dist_forward_backward"] = (
                steps.compiled_forward_backward(self) if self.__dict__.get("_keras_dist_replica_jit_compile") else None
            )
            train_step = self.train_step
            if type(self).train_step is not DistributedModel.train_step:
                train_step = self._user_step(train_step)
            self.train_function = steps.make_step_function(
                self,
                lambda data: self._reduce_in_replica_context(train_step(data), "train_step"),
                add_replica_axis=self._needs_replica_axis(),
                synchronized_outputs=self._returns_synchronized_outputs("train_step"),
            )
        return self.train_function

    def make_test_function(self, force=False):
        self._distribute_state()
        if self.test_function is None or force:
            test_step = self.test_step
            if type(self).test_step is not DistributedModel.test_step:
                test_step = self._user_step(test_step)
            self.test_function = steps.make_step_function(
                self,
                lambda data: self._reduce_in_replica_context(test_step(data), "test_step"),
                add_replica_axis=self._needs_replica_axis(),
                synchronized_outputs=self._returns_synchronized_outputs("test_step"),
            )
        return self.test_function

    def make_predict_function(self, force=False):
        self._distribute_state()
        return super().make_predict_function(force=force)

    def predict_on_batch(self, x):
        """Returns predictions for one batch, split across the replicas like `predict`.

        Keras 3 hands the undivided batch to every replica and concatenates the
        results, returning `num_replicas_in_sync` times too many rows.
        """
        if self._distribute_strategy.num_replicas_in_sync == 1 or not _compat.is_active("predict_on_batch_split"):
            return super().predict_on_batch(x)
        batch_size = int(keras.tree.flatten(x)[0].shape[0])
        return self.predict(x, batch_size=max(batch_size, 1), verbose=0)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        self._distribute_state()  # Layers built after compile (outside the scope) move before the optimizer builds.
        if not steps.has_own_call(self) and _compat.is_active("build_without_call"):
            with self._distribute_strategy.scope():
                steps.build_without_call(self)
        elif not _compat.is_active("symbolic_build_from_spec"):
            steps.maybe_symbolic_build(self, iterator=iterator, data_batch=data_batch)
        else:
            if iterator is not None:
                data_batch = ki.dataset_element_spec(iterator)
            with self._build_context():
                steps.symbolic_build_from_spec(
                    self, data_batch, composite_inputs=_compat.is_active("ragged_symbolic_build")
                )
        self._distribute_state()

    def _build_context(self):
        """The strategy's scope, in a replica context for layers that call collectives (`build_in_replica_context`)."""
        strategy = self._distribute_strategy
        if _compat.is_active("build_in_replica_context"):
            return build_context.symbolic_replica_context(strategy, optimizer=getattr(self, "optimizer", None))
        return strategy.scope()


class _SummedMetrics:
    """The metric state `DistributedModel.train_step` sums in the gradient all-reduce (see `steps.train_step`)."""

    def __init__(self, model):
        self.model = model

    def variables(self):
        """The metric variables (float32, sync-on-read, summed), or `None` when the metrics cannot ride along.

        Not when the model overrides `compute_metrics` or `get_metrics_result`
        (they may read other state), nor with variables aggregated otherwise,
        nor when a compiled metric is not one of Keras' own classes: the
        metrics are then updated before `apply`, and a metric of one's own
        may read the weights (it would see them before the step).
        """
        model = self.model
        compiled = model._compile_metrics.metrics if model._compile_metrics is not None else []
        if (
            type(model).compute_metrics is not keras.Model.compute_metrics
            or type(model).get_metrics_result is not DistributedModel.get_metrics_result
            or not _compat.is_active("cross_replica_metrics")
            or not all(type(m).__module__.startswith("keras.") for m in compiled)
        ):
            return None
        variables = list({id(v): v for metric in model.metrics for v in metric.variables}.values())
        if not variables or not all(
            isinstance(v.value, tf.distribute.DistributedValues)
            and v.value.aggregation == tf.VariableAggregation.SUM
            and v.dtype == "float32"
            for v in variables
        ):
            return None
        return variables

    def results(self, variables, sums):
        """Keras' metric results computed from `sums` (float32 tensors, one per variable)."""
        with keras.StatelessScope(state_mapping=list(zip(variables, sums))):
            return keras.Model.get_metrics_result(self.model)


def _asks_before_overwriting(filepath, args, kwargs):
    overwrite = args[0] if args else kwargs.get("overwrite", True)
    return not overwrite and tf.io.gfile.exists(os.fspath(filepath))


def _require_gpus_for_nccl(communication):
    if communication.implementation == "nccl" and not tf.config.list_physical_devices("GPU"):
        raise ValueError(
            "CommunicationOptions(implementation='nccl') needs GPUs: NCCL all-reduces between GPUs "
            "only, and this machine has none. Received: implementation='nccl' with 0 GPUs. Fix: use "
            "implementation='ring' (CPUs, between hosts) or 'auto' (NCCL when there are GPUs)."
        )


def _functional_class(cls):
    """Returns `cls` with `Functional` mixed in, made once per class.

    Keras turns a `Model` subclass into a functional one by rewriting the
    class's `__bases__` in place, for every later use too; a separate class per
    style keeps `DistributedModel` usable for subclassing after it was used
    functionally. Saved files name the original class.
    """
    if cls not in _FUNCTIONAL_CLASSES:
        functional_cls = type(
            cls.__name__,
            (cls, ki.Functional),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__},
        )
        registered = keras.saving.get_registered_name(cls)
        if registered != cls.__name__:
            package, name = registered.split(">", 1)
            keras.saving.register_keras_serializable(package, name)(functional_cls)
            keras.saving.register_keras_serializable(package, name)(cls)
        _FUNCTIONAL_CLASSES[cls] = functional_cls
    return _FUNCTIONAL_CLASSES[cls]
