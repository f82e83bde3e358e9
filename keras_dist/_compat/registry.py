"""The registry of Keras 3 (TensorFlow backend) bugs that keras-dist works around.

Each `Fix` names the versions on which its bug was reproduced and its remedy
verified (`verified`: a closed range, grown only as more versions are checked,
issue 20). `keras_dist._compat.keras_fixes` switches them on and off.
"""

import dataclasses

from keras_dist._compat import versions


@dataclasses.dataclass(frozen=True)
class Fix:
    """One workaround for an upstream bug.

    Args:
        name: String, the fix's identifier (also `tests/compat/test_<name>.py`).
        package: String, `"keras"` or `"tensorflow"`: whose version gates it.
        verified: String `SpecifierSet`, the versions of `package` on which the
            bug was reproduced and the remedy verified (closed: `">=3.10,<3.16"`,
            from the oldest to the newest minor in `checked_on`). The fix is off
            on any other version unless forced.
        upstream: String, the upstream issue or pull request.
        symptom: One sentence on what breaks for users without the fix.
        remedy: One sentence on what keras-dist does instead.
        remove_when: When to delete the fix.
        checked_on: Tuple of version strings of `package` on which its
            `tests/compat/test_<name>.py` ran (issue 20): the without-the-fix
            test reproduced the bug and the with-the-fix tests passed. Releases,
            then nightly builds the fix works on (those do not widen `verified`).
        notes: String, what the runs found beyond that (a version without the
            bug, a test that cannot run on a version), or empty.
        fixed_in: String, the first version of `package` whose release fixed
            the bug (checked: its without-the-fix test finds no bug there), or
            empty. From it on the fix is off because it is not needed, and
            `import keras_dist` does not warn about it.
    """

    name: str
    package: str
    verified: str
    upstream: str
    symptom: str
    remedy: str
    remove_when: str
    checked_on: tuple = ()
    notes: str = ""
    fixed_in: str = ""

    def fixed_upstream(self):
        """Returns whether the installed `package` is at or after `fixed_in` (then the fix is not needed)."""
        return bool(self.fixed_in) and versions.in_range(self.package, f">={self.fixed_in}")

    def applies_to_installed(self):
        """Returns whether the installed `package` version is in `verified` (pre-releases included: `versions.in_range`)."""
        return versions.in_range(self.package, self.verified)


_OPEN = "no upstream fix as of Keras 3.15.1; remove when a fixed release is the minimum supported"
_OPEN_TF = "no upstream fix as of TensorFlow 2.21.0; remove when a fixed release is the minimum supported"

FIXES = {
    fix.name: fix
    for fix in [
        Fix(
            name="example_weighted_loss",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/issues/15509 (also tensorflow/tensorflow#45594)",
            symptom="Under a strategy Keras divides each replica's loss by num_replicas_in_sync: an uneven split "
            "(the last batch), a masked loss (each replica's own token mean), a 'sum' or sample-weight-mean "
            "reduction and a loss function returning one number (not divided at all: 2x on 2 replicas) give "
            "another gradient and logged loss than the global batch's; per-output loss trackers average the "
            "replicas' values.",
            remedy="Each replica computes its loss as one device would; each loss term counts by its own "
            "divisor's share (examples, unmasked tokens, sample weights, or 1 for sums), in the gradient "
            "all-reduce when all are example means, else after one small all-reduce of the divisors.",
            checked_on=("3.10.0", "3.13.2", "3.15.1", "3.16.0.dev2026102704"),
            remove_when=_OPEN,
        ),
        Fix(
            name="custom_step_example_weighting",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://keras.io/guides/custom_train_step_in_tensorflow/ (written for one device; no upstream report found)",
            symptom="A train_step written for one device (keras.io: its own ops.mean loss or self.compute_loss, "
            "apply_gradients, Mean loss trackers) takes num_replicas_in_sync times the one-device step, "
            "and logs the loss divided by num_replicas_in_sync when it uses compute_loss.",
            remedy="While a user's train_step/test_step runs, Keras' loss scaling is off, each replica's "
            "gradients count by its share of the global batch's examples, compute_loss counts each term by "
            "its divisor, scalar Mean tracker updates and returned scalars count by their share (of the examples, "
            "of a ratio's denominator, once for a sum over the batch), tape.gradient of one "
            "value per example (a sum's gradient) counts once per replica, and tape.gradient with respect to "
            "trainable variables returns the global batch's gradient (clipping by hand, SAM, hand updates).",
            checked_on=("3.10.0", "3.13.2", "3.15.1", "3.16.0.dev2026102704"),
            remove_when=_OPEN,
        ),
        Fix(
            name="symbolic_build_from_spec",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/issues/20585 (also tensorflow/tensorflow#58809)",
            symptom="fit/evaluate build the model by taking a batch from the user's distributed "
            "iterator and reducing it across replicas, which fails when the first batch is smaller "
            "than the number of replicas or is split unevenly.",
            remedy="The model is built from the dataset's element spec; no batch is taken.",
            checked_on=("3.10.0", "3.13.2", "3.15.1", "3.16.0.dev2026102704"),
            remove_when=_OPEN,
        ),
        Fix(
            name="build_in_replica_context",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/blob/v3.15.1/keras/src/backend/tensorflow/trainer.py (_maybe_symbolic_build under strategy.scope(); no upstream report found)",
            symptom="fit/evaluate/predict build the model by tracing call under strategy.scope() (cross-replica "
            "context), so a layer that calls a collective in call (tf.distribute.get_replica_context().all_reduce, "
            "a cross-replica statistic) fails before training: 'Unable to automatically build the model' "
            "('NoneType' object has no attribute 'all_reduce').",
            remedy="The symbolic build traces call in a replica context of the model's strategy (replica 0) whose "
            "collectives only keep shapes; the steps then run the real collectives inside strategy.run.",
            checked_on=("3.10.0", "3.13.2", "3.15.1", "3.16.0.dev2026102704"),
            remove_when=_OPEN,
        ),
        Fix(
            name="ragged_symbolic_build",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/blob/v3.15.1/keras/src/trainers/trainer.py (_symbolic_build: to_symbolic_input makes every spec a dense KerasTensor; no upstream report found)",
            symptom="Under a strategy, fit/evaluate/predict on ragged batches (ragged_batch) build the model by "
            "calling it on a dense placeholder, so a call that handles the tf.RaggedTensor it will get "
            "(x.to_tensor(), x.row_lengths()) fails: 'Unable to automatically build the model'.",
            remedy="When the inputs have ragged or sparse parts, call is traced on placeholders of that type; "
            "metric, loss and optimizer state are built as Keras builds them.",
            checked_on=("3.10.0", "3.13.2", "3.15.1", "3.16.0.dev2026102704"),
            remove_when=_OPEN,
        ),
        Fix(
            name="symbolic_build_without_targets",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/blob/v3.15.1/keras/src/trainers/trainer.py (_symbolic_build: compute_loss with the batch's y, None without targets; one device defers; no upstream report found)",
            symptom="Under a strategy, fit on inputs only (no y) of a model compiled with a loss whose own "
            "train_step computes its own loss fails before training: 'None values not supported.' (on one "
            "device Keras builds the compiled loss only when compute_loss is called).",
            remedy="Without targets in the batches the pre-build builds the model and optimizer, not the "
            "compiled loss and metrics: they build when first called, as on one device.",
            checked_on=("3.10.0", "3.13.2", "3.15.1"),
            remove_when=_OPEN,
        ),
        Fix(
            name="build_for_own_step",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/blob/v3.15.1/keras/src/backend/tensorflow/trainer.py (_maybe_symbolic_build: only under a strategy; one device builds in the first step; no upstream report found)",
            symptom="Under a strategy, fit builds the model by calling it on the batch's inputs, so a train_step "
            "of one's own that makes the model's inputs itself (keras.io MixUp, a dict of features combined, "
            "then super().train_step) fails before training: 'Missing data for input' or 'Unable to "
            "automatically build the model' (on one device Keras builds the model in the first step).",
            remedy="When that call fails and the model writes its own train/test/predict step, the model is built "
            "as one device builds it: layers not built yet and the compiled loss and metrics in the first step "
            "(layers once, outside the step function), the optimizer now when every layer is built.",
            checked_on=("3.10.0", "3.13.2", "3.15.1"),
            remove_when=_OPEN,
        ),
        Fix(
            name="build_without_call",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/blob/v3.15.1/keras/src/backend/tensorflow/trainer.py (_maybe_symbolic_build: only under a strategy; one device defers; no upstream report found)",
            symptom="Under a strategy, fit/evaluate build the model by calling it, so a model without `call()` "
            "that trains only through its own train_step (the keras.io GAN) fails before training: 'Unable to "
            "automatically build the model' (on one device Keras does not build it).",
            remedy="A model that keeps keras.Model's `call()` is not traced: its compiled optimizer is built under "
            "the strategy's scope, as Keras builds it; layers not built yet build in the first step, as on one "
            "device, but once and outside the step function (merge_call, init_scope), as optimizers do with "
            "`optimizer_built_in_step`.",
            checked_on=("3.10.0", "3.13.2", "3.15.1", "3.16.0.dev2026102704"),
            remove_when=_OPEN,
        ),
        Fix(
            name="optimizer_built_in_step",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/blob/v3.15.1/keras/src/optimizers/base_optimizer.py (apply builds the optimizer lazily; no upstream report found)",
            symptom="Under a multi-replica strategy, an optimizer first applied inside a train_step (a GAN's "
            "`d_optimizer`, set in its own compile) creates its variables inside the step function, and the "
            "first step fails: 'You must feed a value for placeholder tensor .../cond/Placeholder'.",
            remedy="The model's optimizers (compiled, or kept in its attributes) build themselves, when first "
            "applied in a replica context, once in cross-replica context and eagerly (merge_call, init_scope), "
            "on the variables of that first apply; on one replica eagerly too (init_scope), where Keras' "
            "build in the trace lost what `build` assigns (ScheduleFreeAdamW's momentum).",
            checked_on=("3.10.0", "3.13.2", "3.15.1"),
            notes="keras-nightly 3.16.0.dev2026102704 does not reproduce the bug (the first step no longer fails with its message): the fix is off there; if Keras 3.16 is released so, the range ends at 3.16.",
            remove_when=_OPEN,
        ),
        Fix(
            name="cross_replica_metrics",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/issues/18667",
            symptom="Metric results are computed per replica from local state and then averaged, "
            "so uneven batches give logged metrics that differ from single-device values.",
            remedy="Metric results are computed in cross-replica context from the summed "
            "on-read state (as tf.keras did), identical on every replica; inside a train_step/test_step of the "
            "user's, metric.result() itself reads the state summed over the replicas (one all-reduce).",
            checked_on=("3.10.0", "3.13.2", "3.15.1", "3.16.0.dev2026102704"),
            remove_when=_OPEN,
        ),
        Fix(
            name="mirrored_layer_state",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/issues/18667 (also keras-team/keras#14372)",
            symptom="Non-trainable layer state (BatchNormalization moving mean/variance) is mirrored "
            "with aggregation NONE, so every replica keeps its own diverging copy.",
            remedy="Floating-point non-trainable layer weights with aggregation 'none' are "
            "re-created with aggregation 'mean', so all copies stay identical; inside a keras-dist step "
            "each replica's assigned value counts by its examples, as one device's batch would.",
            checked_on=("3.10.0", "3.13.2", "3.15.1", "3.16.0.dev2026102704"),
            remove_when=_OPEN,
        ),
        Fix(
            name="replica_layer_losses",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/blob/v3.15.1/keras/src/layers/layer.py (add_loss, _get_own_losses, _clear_losses: one Layer._losses list; no upstream report found)",
            symptom="Under a one-process multi-replica strategy every replica's call appends its add_loss values "
            "(activity regularizers, a layer's own add_loss) to the same Layer._losses list and clears it at its "
            "outermost call: a replica that reads model.losses after another replica's call ran in between (one "
            "waiting in a collective of the forward pass, as synchronized BatchNormalization's) reads that "
            "replica's values, and its loss and gradients differ from one device's.",
            remedy="Inside a keras-dist step on several replicas, add_loss, the layer's own losses and their "
            "clearing use one list per replica, dropped at the end of the step.",
            checked_on=("3.10.0", "3.13.2", "3.15.1", "3.16.0.dev2026102704"),
            remove_when=_OPEN,
        ),
        Fix(
            name="distribute_reduction_method",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/pull/16664 (tf.keras); keras-team/keras#15509",
            symptom="Reading `model.distribute_reduction_method` raises AttributeError, and setting "
            "it has no effect: step outputs are always averaged over replicas.",
            remedy="The attribute defaults to 'auto' and 'sum', 'mean', 'first' are applied to "
            "what train_step/test_step return.",
            checked_on=("3.10.0", "3.13.2", "3.15.1", "3.16.0.dev2026102704"),
            remove_when=_OPEN,
        ),
        Fix(
            name="optimizer_strategy",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/issues/17187 (also keras-team/keras#20045)",
            symptom="An optimizer constructed outside strategy.scope() keeps the default strategy "
            "and fails with 'Mixing different tf.distribute.Strategy objects'.",
            remedy="compile() moves the optimizer and its variables onto the model's strategy; a "
            "MultiOptimizer's selector-held optimizers are moved as it builds.",
            checked_on=("3.10.0", "3.13.2", "3.15.1", "3.16.0.dev2026102704"),
            remove_when=_OPEN,
        ),
        Fix(
            name="jit_compile_mirrored",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/issues/19005 (also keras-team/keras#18145)",
            symptom="compile(jit_compile=True) under a multi-replica strategy crashes in the first "
            "step: Keras compiles the whole step, every replica and the all-reduce, as one XLA cluster.",
            remedy="XLA compiles each replica's forward and backward pass; the all-reduce, optimizer "
            "update, metrics and layer state updates run outside it (an overriding train_step is refused).",
            checked_on=("3.10.0", "3.13.2", "3.15.1", "3.16.0.dev2026102704"),
            remove_when=_OPEN,
        ),
        Fix(
            name="replica_seed_state",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/issues/18667 (seed state mirrored like any variable)",
            symptom="A SeedGenerator's state is mirrored identically, so every replica draws the same "
            "random numbers: Dropout drops the same units on every replica's different examples.",
            remedy="Each replica's copy of a seed generator state gets the replica id added to its "
            "seed (replica 0 keeps the user's seed).",
            checked_on=("3.10.0", "3.13.2", "3.15.1", "3.16.0.dev2026102704"),
            remove_when=_OPEN,
        ),
        Fix(
            name="predict_on_batch_split",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/blob/v3.15.1/keras/src/backend/tensorflow/trainer.py (predict_on_batch; no upstream report found)",
            symptom="predict_on_batch under a multi-replica strategy runs the whole batch on every "
            "replica and concatenates, returning num_replicas_in_sync times too many rows.",
            remedy="predict_on_batch runs predict with the batch as one global batch, split across "
            "the replicas, returning exactly the input's rows in order.",
            checked_on=("3.10.0", "3.13.2", "3.15.1", "3.16.0.dev2026102704"),
            remove_when=_OPEN,
        ),
        Fix(
            name="generator_batch_copies",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/blob/v3.15.1/keras/src/trainers/data_adapters/generator_data_adapter.py (peek_and_restore; no upstream report found)",
            symptom="A Python generator that yields views of a buffer it refills loses and repeats "
            "examples: Keras keeps the first batches it peeks at (to learn shapes) by reference, and "
            "later batches overwrite them before they are used.",
            remedy="fit/evaluate/predict copy each NumPy array a generator yields, as it is yielded.",
            checked_on=("3.10.0", "3.13.2", "3.15.1", "3.16.0.dev2026102704"),
            remove_when=_OPEN,
        ),
        Fix(
            name="empty_replica_batch_norm",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/blob/v3.15.1/keras/src/layers/normalization/batch_normalization.py (_moments of an empty batch; tensorflow/tensorflow#58809)",
            symptom="When a partial global batch leaves a replica without examples, BatchNormalization "
            "computes the moments of an empty batch (NaN), and the moving statistics, gamma and beta "
            "become NaN for good.",
            remedy="On an empty batch each BatchNormalization layer of the model uses its moving "
            "statistics as the batch moments, so that replica leaves them unchanged (a synchronized=True "
            "layer needs no guard: its moments are the global batch's).",
            checked_on=("3.10.0", "3.13.2", "3.15.1", "3.16.0.dev2026102704"),
            remove_when=_OPEN,
        ),
        Fix(
            name="sum_gradients_before_apply",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/blob/v3.15.1/keras/src/optimizers/base_optimizer.py (apply: _clip_gradients before _backend_update_step's all-reduce)",
            symptom="Under a multi-replica strategy the optimizer decides on each replica's share of the "
            "gradient before the gradients are summed: clipnorm, clipvalue and global_clipnorm clip "
            "each share (N replicas train to different weights than one device), and LossScaleOptimizer "
            "checks only the first replica's share for inf/NaN (an overflow on another replica is "
            "summed into the weights, which become inf/NaN, and the loss scale is not lowered).",
            remedy="keras_dist.distributed_optimizer (applied by DistributedModel.compile) makes the "
            "optimizer's apply sum the gradients over replicas (with the CommunicationOptions) first; "
            "Keras' apply then checks and clips the global gradient and does not sum again.",
            checked_on=("3.10.0", "3.13.2", "3.15.1", "3.16.0.dev2026102704"),
            remove_when=_OPEN,
        ),
        Fix(
            name="exhausted_input_iteration_count",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/blob/v3.15.1/keras/src/backend/tensorflow/trainer.py (one_step_on_iterator: the epoch's last call fails in get_next)",
            symptom="When an epoch ends because the input ran out (a dataset of unknown length, e.g. after filter), "
            "Keras calls the train function once more; it fails for lack of data, but TensorFlow has already run "
            "the optimizer's iteration increment, which does not depend on the data: optimizer.iterations counts "
            "one step too many per epoch (2 epochs of 8 batches: 18), shifting Adam's bias correction.",
            remedy="DistributedModel.fit counts the steps each epoch ran (steps_per_execution=1) and, at the end of an "
            "epoch that ran fewer steps than it expects, before any other callback, sets the counter back to at most what it read after the epoch's first "
            "step that moved it, plus that step's increments for each step after it (a step may apply the optimizer "
            "more than once; a LossScaleOptimizer skips steps without moving it).",
            checked_on=("3.10.0", "3.13.2", "3.15.1"),
            notes="keras-nightly 3.16.0.dev2026102704 does not reproduce the bug (the counter is right: 16 for 2 epochs of 8 batches): the fix is off there; if Keras 3.16 is released so, the range ends at 3.16.",
            remove_when=_OPEN,
        ),
        Fix(
            name="gradient_accumulation_under_strategy",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/issues/17429 (also keras-team/tf-keras#107)",
            symptom="With an optimizer's gradient_accumulation_steps under a multi-replica strategy, "
            "the first step fails ('Exception encountered when calling Cond.call()'): optimizer.apply "
            "chooses between updating and accumulating with ops.cond, and both branches call merge_call.",
            remedy="Each replica adds its gradients to its own sync-on-read running sums; one merge_call "
            "(outside any conditional) runs, in cross-replica context, a cond that on every k-th "
            "micro-batch all-reduces the sums and calls Keras' apply (updating every replica's copy) "
            "and otherwise only counts the step; a LossScaleOptimizer-wrapped optimizer sums each "
            "micro-batch, then applies once in cross-replica context.",
            checked_on=("3.10.0", "3.13.2", "3.15.1"),
            notes="keras-nightly 3.16.0.dev2026102704 does not reproduce the bug (the first step no longer fails): the fix is off there; if Keras 3.16 is released so, the range ends at 3.16.",
            remove_when=_OPEN,
        ),
        Fix(
            name="ema_overwrite_under_strategy",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/blob/v3.15.1/keras/src/optimizers/base_optimizer.py (_backend_apply_gradients: ops.cond around _overwrite_model_variables_with_average_value; no upstream report found)",
            symptom="An optimizer with use_ema=True and ema_overwrite_frequency under a multi-replica strategy fails "
            "in the first step ('merge_call called while defining a new graph', in Cond.call()): apply overwrites "
            "the weights with their moving averages inside ops.cond, and that overwrite calls merge_call.",
            remedy="The optimizer's apply (on gradients already summed over replicas) runs once in cross-replica "
            "context, where the conditional overwrite updates every replica's copy without merge_call.",
            checked_on=("3.10.0", "3.13.2", "3.15.1"),
            notes="keras-nightly 3.16.0.dev2026102704 does not reproduce the bug (the first step no longer fails): the fix is off there; if Keras 3.16 is released so, the range ends at 3.16.",
            remove_when=_OPEN,
        ),
        Fix(
            name="multi_worker_output_reduction",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/issues/20585 (follow-up: scalar step outputs reduced with axis=0)",
            symptom="Under MultiWorkerMirroredStrategy, fit/evaluate reduce every step output with "
            "strategy.reduce('MEAN', value, axis=0), which fails on scalar metrics ('Invalid reduction "
            "dimension 0 for input with 0 dimensions') and averages away axis 0 of other outputs.",
            remedy="Under a multi-worker strategy each replica's step outputs get a leading replica "
            "axis of size 1, so Keras' axis-0 mean is exactly the mean over replicas.",
            checked_on=("3.10.0", "3.13.2", "3.15.1", "3.16.0.dev2026102704"),
            remove_when=_OPEN,
        ),
        Fix(
            name="summed_activity_regularization",
            package="keras",
            verified=">=3.10,<3.14",
            upstream="https://github.com/keras-team/keras/issues/22018 (fixed in Keras 3.14 by keras-team/keras#22021)",
            symptom="Keras before 3.14 adds each activity regularizer's value as it is, a sum over the batch: one "
            "device's loss holds the global batch's sum, while keras-dist counted every replica's part of the "
            "loss by its share of the examples, so a model with an activity_regularizer trained to other weights "
            "than one device (1.5e-2 on 2 replicas with Keras 3.13.2).",
            remedy="On those Keras versions each replica's activity regularization losses (those Layer.__call__ "
            "adds) count once, as sums, in its part of the global batch's loss; from Keras 3.14 they are a mean "
            "over examples, counted by the example share like the rest of the loss.",
            checked_on=("3.10.0", "3.13.2"),
            notes="Keras 3.14 divides by the batch size: on 3.15.1 and keras-nightly 3.16.0.dev2026102704 the bug is absent (the without-the-fix test is skipped) and the with-the-fix test passes with the fix off.",
            remove_when="Keras 3.14 divides by the batch size: remove when 3.14 is the minimum supported",
            fixed_in="3.14",
        ),
        Fix(
            name="sparse_embedding_read",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/blob/v3.15.1/keras/src/layers/core/embedding.py (call: ops.take of the whole table; not reported upstream)",
            symptom="Keras' Embedding reads its whole table (ReadVariableOp, then GatherV2) in every step, and once the "
            "optimizer has applied a sparse gradient to it TensorFlow copies the table on each such read: a 1M x 64 "
            "table trains at a fifth of a 10K one's step rate on one device and a tenth on 2 replicas (tf.keras 2 "
            "read only the rows it looked up).",
            remedy="Each Embedding layer of a DistributedModel reads only the rows it looks up (sparse_read, "
            "ResourceGather, of the replica's copy of the table), with Keras' casts and negative-id wrap: the same "
            "values and IndexedSlices gradients; symbolic calls, ragged or sparse ids, LoRA and quantized tables "
            "run Keras' own call.",
            checked_on=("3.10.0", "3.13.2", "3.15.1"),
            remove_when=_OPEN,
        ),
        Fix(
            name="variable_scalar_conversion",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/blob/v3.15.1/keras/src/backend/common/variables.py (Variable.__float__ and __int__ convert self.value, on a strategy a tf.distribute variable without those conversions; no upstream report found)",
            symptom="Under a multi-replica strategy, float(model.optimizer.learning_rate), int(model.optimizer.iterations) "
            "or float() of a metric's variable, as a callback logging them does, raise 'TypeError: float() argument "
            "must be a string or a real number, not 'MirroredVariable'' (or 'SyncOnReadVariable').",
            remedy="float() and int() of a scalar Keras variable backed by a tf.distribute variable convert its NumPy "
            "value (v.numpy(): the value every replica holds, or a sync-on-read variable's aggregate); every other "
            "variable converts as Keras does.",
            checked_on=("3.10.0", "3.13.2", "3.15.1", "3.16.0.dev2026102704"),
            remove_when=_OPEN,
        ),
        Fix(
            name="empty_batch_convolution",
            package="tensorflow",
            verified=">=2.18,<2.22",
            upstream="https://github.com/tensorflow/tensorflow/blob/v2.21.0/tensorflow/core/kernels/depthwise_conv_grad_op.cc (zero-size batches; also the oneDNN conv kernels, tensorflow/core/kernels/mkl/; no upstream report found)",
            symptom="A replica whose share of a (last, partial) batch is empty breaks CPU convolutions: with oneDNN on "
            "some CPUs a Conv on 0 examples returns the input's channel count and the next layer fails ('input depth "
            "must be evenly divisible by filter depth'), and a SeparableConv's depthwise-kernel gradient over 0 "
            "examples is uninitialized memory (e.g. 1e24), summed into every replica's weights.",
            remedy="Under a multi-replica strategy Keras' TensorFlow conv, depthwise, separable and transposed "
            "convolutions run an empty batch as one example of zeros and keep none of its rows: the right output "
            "shape and exactly zero gradients, what a replica without examples contributes. Not inside the pass "
            "XLA compiles (`jit_compile=True`): XLA's convolutions are not those kernels, and it cannot compile the "
            "guard's gradient.",
            checked_on=("2.18.1", "2.20.0", "2.21.0", "2.23.0.dev20261026"),
            notes="On this CI's CPUs, TensorFlow 2.18.1 to 2.23.0.dev fail the step instead ('Missing 1-th output from ... Conv2DBackpropFilter') of returning garbage gradients; the fix avoids both.",
            remove_when=_OPEN_TF,
        ),
        Fix(
            name="finished_epoch_iterator_cycle",
            package="keras",
            verified=">=3.10,<3.16",
            upstream="https://github.com/keras-team/keras/blob/v3.15.1/keras/src/trainers/epoch_iterator.py (EpochIterator.__iter__ keeps its own generator; no upstream report found)",
            symptom="Keras' epoch iterator of a finished fit/evaluate/predict lives on in a reference cycle (it "
            "holds the generator of its own steps, whose frame holds it), with its distributed tf.data pipeline "
            "and threads, until Python's cycle collector runs at some later moment; on several workers that "
            "moment falls inside a later call on one worker only, where destroying the old pipeline held that "
            "worker 30 s to 7 min while the others waited in a collective (3 of 4 runs of the 2x2 sharding test).",
            remedy="Under MultiWorkerMirroredStrategy each fit, evaluate and predict ends with gc.collect() "
            "(about 0.2 s), so the finished call's pipeline is destroyed then, on every worker at the same point.",
            checked_on=("3.10.0", "3.13.2", "3.15.1"),
            remove_when=_OPEN,
        ),
        Fix(
            name="blocking_iterator_deletion",
            package="tensorflow",
            verified=">=2.18,<2.22",
            upstream="https://github.com/tensorflow/tensorflow/blob/v2.21.0/tensorflow/core/data/root_dataset.cc (RootDataset::Iterator's destructor waits for its Model::OptimizeLoop thread, tensorflow/core/framework/model.cc; no upstream report found)",
            symptom="Under MultiWorkerMirroredStrategy, destroying a distributed iterator holds the thread that "
            "drops it 0.2 s, often about 1.25 s and up to 18 s (its tf.data autotuning threads sleep for a period "
            "doubling from 10 ms to 60 s, and the destructor waits for them), while the other workers wait in "
            "their next collective; Keras drops one or two every epoch of a finite input, so fit on arrays on 2 "
            "CPU workers stalled in 14 of 19 epochs (2.5-2.6 s an epoch against 1.5-1.8 s with one iterator). "
            "Under MirroredStrategy the step thread waits itself: Python's cycle collector destroys a finished "
            "call's iterator (Keras' epoch iterator sits in a reference cycle) on whatever thread it interrupts, "
            "and for a `from_generator` input a gc.collect() 20 s after fit took 61-102 s on TensorFlow 2.21 and "
            "122 s on 2.20 (0.2 s on 2.18).",
            remedy="Each iterator Keras (or verify_sharding) takes from an input keras-dist distributes under "
            "MultiWorkerMirroredStrategy or MirroredStrategy is also held by keras-dist and, once nothing else "
            "refers to it, destroyed on one of 4 deleting threads, where no step waits for it (fit on arrays on 2 "
            "workers: 1.5-1.9 s an epoch, no stalls; the gc.collect() above: 0.1-0.2 s); the last ones' waits "
            "fall at exit.",
            checked_on=("2.18.1", "2.20.0", "2.21.0"),
            remove_when=_OPEN_TF,
        ),
        Fix(
            name="sigterm_default_action",
            package="tensorflow",
            verified=">=2.18,<2.22",
            upstream="https://github.com/tensorflow/tensorflow/blob/v2.21.0/third_party/xla/xla/tsl/distributed_runtime/preemption/preemption_notifier.cc (SigtermNotifier)",
            symptom="Once a worker joins a multi-worker cluster, TensorFlow's preemption notifier catches "
            "SIGTERM and the process keeps training, so `kill`, Kubernetes and SLURM cannot stop it "
            "gracefully and the launcher must wait for its grace period and SIGKILL.",
            remedy="After joining, SIGTERM gets its default action back (terminate) unless the script "
            "installed its own Python handler.",
            checked_on=("2.18.1", "2.20.0", "2.21.0", "2.23.0.dev20261026"),
            remove_when=_OPEN_TF,
        ),
        Fix(
            name="multi_worker_steps_per_execution",
            package="tensorflow",
            verified=">=2.18,<2.22",
            upstream="https://github.com/keras-team/keras/blob/v3.15.1/keras/src/backend/tensorflow/trainer.py (multi_step_on_iterator; no upstream report found)",
            symptom="With steps_per_execution > 1 under MultiWorkerMirroredStrategy, or one worker's "
            "MirroredStrategy with CollectiveAllReduce (its default on several CPUs), Keras runs the "
            "step inside tf.cond inside tf.while_loop and TensorFlow fails on the collective ops "
            "there: 'You must feed a value for placeholder tensor .../while/cond/Placeholder'.",
            remedy="Where the all-reduce runs collective ops compile uses steps_per_execution=1 and warns; fit, evaluate "
            "and predict then run the steps Keras runs in whole executions of the steps_per_execution asked for: "
            "steps_per_epoch, validation_steps and steps are rounded up to its multiple (steps_per_epoch=5 with 3: "
            "6 steps an epoch), and an input that ends inside an execution ends it, as in Keras. The numbers are "
            "the same; per-step overhead grows, and batch callbacks run after every step (Keras: after every "
            "execution, with the last step's logs), with params['steps'] the rounded count.",
            notes="Not the same: a finite input of unknown length (e.g. after filter) with a steps_per_epoch it "
            "does not last: where it runs out inside an execution, Keras ends that epoch unaware and its next "
            "epoch runs no step; here the end is seen in the same epoch and the next epoch starts the input again. "
            "A keras.config.set_max_steps_per_epoch cap is not rounded (Keras runs whole executions past it).",
            checked_on=("2.18.1", "2.20.0", "2.21.0", "2.23.0.dev20261026"),
            remove_when=_OPEN_TF,
        ),
        Fix(
            name="file_sharding_cache",
            package="tensorflow",
            verified=">=2.18,<2.22",
            upstream="https://github.com/tensorflow/tensorflow/blob/v2.21.0/tensorflow/core/grappler/optimizers/data/auto_shard.cc (FILE rewrite keeps the cache resource; no upstream report found)",
            symptom="Under FILE auto-sharding, a pipeline with a cache() after its file readers (in memory, "
            "as TFDS adds to small datasets, or in a file) that was filled before being distributed gives "
            "every worker every example: the rewrite shards the file names but the filled cache is read.",
            remedy="keras-dist shards such pipelines by DATA (sharded after the cache) and warns once, "
            "naming the ways to keep FILE sharding.",
            checked_on=("2.18.1", "2.20.0", "2.21.0", "2.23.0.dev20261026"),
            remove_when=_OPEN_TF,
        ),
        Fix(
            name="slurm_cpu_nodes",
            package="tensorflow",
            verified=">=2.18,<2.22",
            upstream="https://github.com/tensorflow/tensorflow/blob/v2.21.0/tensorflow/python/distribute/cluster_resolver/slurm_cluster_resolver.py (get_num_gpus, cluster_spec)",
            symptom="SlurmClusterResolver on nodes without GPUs fails: it runs nvidia-smi "
            "(FileNotFoundError), and with gpus_per_node=0 divides GPUs among tasks with a range step "
            "of 0 (ValueError).",
            remedy="On nodes without GPUs keras-dist gives the resolver one placeholder GPU slot per "
            "task and tells it not to set CUDA_VISIBLE_DEVICES; the cluster spec is unchanged.",
            checked_on=("2.18.1", "2.20.0", "2.21.0", "2.23.0.dev20261026"),
            remove_when=_OPEN_TF,
        ),
        Fix(
            name="python_batches_written_in_place",
            package="tensorflow",
            verified=">=2.18,<2.22",
            upstream="https://github.com/tensorflow/tensorflow/blob/v2.21.0/tensorflow/python/lib/core/py_func.cc (a PyFunc's NumPy result whose data is 64-byte aligned becomes a tensor sharing its memory, ndarray_tensor.cc; no upstream report found)",
            symptom="Under a multi-replica strategy, fit and evaluate on a keras.utils.PyDataset, a generator or "
            "a from_generator dataset can overwrite the user's NumPy arrays: a batch that is a slice of an array "
            "whose memory starts on a 64-byte boundary reaches TensorFlow without a copy, and once the strategy "
            "splits it over replicas the step's ops write into it (the targets held loss terms), so the next "
            "epoch trains on garbage; on 2 workers, epoch 2's loss was 1.43 instead of 2.49.",
            remedy="A dataset that runs Python (from_generator, py_function, numpy_function) is copied batch "
            "by batch into memory TensorFlow owns before the strategy splits it (one copy of each batch, on "
            "tf.data's threads); the step then writes into the copy.",
            checked_on=("2.18.1", "2.19.1", "2.20.0", "2.21.0"),
            notes="TensorFlow 2.18.1 (with Keras 3.10.0) does not write into the arrays (its without-the-fix test "
            "finds them unchanged, as does the same pipeline in plain TensorFlow); 2.19.1 (with Keras 3.13.2) does, "
            "as 2.20.0 and 2.21.0 do. The fix stays on from the minimum supported 2.18, where it costs one copy "
            "of each batch and changes no number.",
            remove_when=_OPEN_TF,
        ),
        Fix(
            name="device_less_gather_input",
            package="tensorflow",
            verified=">=2.18,<2.22",
            upstream="https://github.com/tensorflow/tensorflow/blob/v2.21.0/tensorflow/python/distribute/cross_device_ops.py (validate_destinations: the gather's destinations are the value itself, and a tensor without a device is rejected; no upstream report found)",
            symptom="Under MultiWorkerMirroredStrategy, ReplicaContext.all_gather of a tensor with no device, "
            "such as labels straight from the distributed iterator, fails with 'ValueError: destinations can "
            "not be empty', so keras_dist.ops.all_gather of a batch's labels (in-batch negatives, batch-hard "
            "triplets) crashes on workers.",
            remedy="keras_dist.ops.all_gather passes each value through tf.identity in the replica's context "
            "first, which places it on the replica's device.",
            checked_on=("2.18.1", "2.20.0", "2.21.0", "2.23.0.dev20261026"),
            remove_when=_OPEN_TF,
        ),
        Fix(
            name="int32_batch_reduce",
            package="tensorflow",
            verified=">=2.18,<2.22",
            upstream="https://github.com/tensorflow/tensorflow/blob/v2.21.0/tensorflow/python/distribute/mirrored_strategy.py (MirroredExtended._get_cross_device_ops returns a new ReductionToOneDevice for each int32 value, and _batch_reduce_to refuses values whose cross-device ops differ; no upstream report found)",
            symptom="Under MirroredStrategy, fit and evaluate fail with 'Inputs to batch_reduce_to must be either "
            "all on the host or all on the compute devices' when a compiled metric keeps two int32 state "
            "variables (a counter of positives and one of examples).",
            remedy="keras-dist sums int32 metric state one variable at a time (one batch_reduce_to each); other "
            "dtypes stay packed in one sum per dtype.",
            checked_on=("2.18.1", "2.20.0", "2.21.0"),
            remove_when=_OPEN_TF,
        ),
    ]
}
