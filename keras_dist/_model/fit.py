"""`fit`, `evaluate` and `predict` of a `DistributedModel`, around Keras' own.

Each binds its inputs (`data._inputs`: distributed datasets, the input plan),
names a lost worker in the error (`workers.naming_lost_workers`) and prints on
the chief only. `fit` also adapts the callbacks for several workers, records a
`Timeline` when one is among them (or `KERAS_DIST_TIMELINE` asks), resumes a
`BackupAndRestore` backup mid-epoch (skipping the steps already done), and on
SIGTERM exits with status 75 once every worker saved one backup. `fit` and
`evaluate` also let the first step function check the compiled losses and
metrics on their first global batch (`coupling`).
"""

import contextlib

import keras

from keras_dist._compat import keras_fixes
from keras_dist._model import coupling, monitoring, step_functions, workers
from keras_dist.callbacks import _adapt as callbacks_adapt
from keras_dist.callbacks import _resume as callbacks_resume
from keras_dist.callbacks import _timeline as callbacks_timeline
from keras_dist.data import _distribute as data_distribute
from keras_dist.data import _inputs as data_inputs


def fit(model, keras_fit, args, kwargs):
    """`DistributedModel.fit`: Keras' `fit` (`keras_fit`, bound) with the arguments above adapted."""
    arguments = data_inputs.bind_inputs(model, keras.Model.fit, args, kwargs, ("x", "validation_data"))
    step_functions.keras_step_counts(model, arguments, ("steps_per_epoch", "validation_steps"))
    backups = callbacks_resume.backups_in(arguments.get("callbacks"))
    resume_point = callbacks_resume.ResumePoint(0)
    if backups:
        # A DatasetCreator's input is built per worker by the user: it resumes at the epoch.
        by_step = not data_distribute.is_distributed(arguments.get("x"))
        resume_point = callbacks_resume.ResumePoint.of(backups[0], by_step=by_step)
    arguments["callbacks"] = callbacks_adapt.adapt_callbacks(
        arguments.get("callbacks"), model, model._agreement(), resume_point=resume_point
    )
    agree_on_stop = arguments["callbacks"][-1]
    timeline = callbacks_timeline.timeline_in(arguments["callbacks"])
    with contextlib.ExitStack() as stack:
        stack.enter_context(keras_fixes.collecting_after(model.distribute_strategy))  # Exits last.
        stack.enter_context(workers.naming_lost_workers(model))
        if timeline is not None:  # Outside `fit`'s own phase: the file and the report come after it ended.
            stack.enter_context(monitoring.recording_timeline(model, timeline))
        stack.enter_context(monitoring.tracking_call(model, "fit"))
        stack.enter_context(monitoring.tracking_callbacks(arguments["callbacks"]))
        stack.enter_context(data_inputs.distributing_inputs(model, ["fit", "validation"], arguments))
        stack.enter_context(coupling.remembering_first_batch(model, arguments))
        if backups:
            x, steps_per_epoch = arguments.get("x"), arguments.get("steps_per_epoch")
            can_skip = callbacks_resume.epoch_length_is_known(x, steps_per_epoch)
            batch_size = data_inputs.array_batch_size(x, arguments.get("batch_size"))
            stack.enter_context(callbacks_resume.skipping_resumed_steps(model, resume_point, can_skip, batch_size))
            stack.enter_context(callbacks_resume.catching_sigterm())
        history = keras_fit(**workers.chief_only_verbosity(model, arguments))
    if agree_on_stop.preempted:
        print(
            f"keras-dist: SIGTERM: every worker saved a backup in {backups[0].backup_dir!r} and stopped; "
            f"exiting with status {callbacks_resume.RESTART_EXIT_STATUS} (run the same command again to resume).",
            flush=True,
        )
        raise SystemExit(callbacks_resume.RESTART_EXIT_STATUS)
    return history


def evaluate(model, keras_evaluate, args, kwargs):
    """`DistributedModel.evaluate`: Keras' `evaluate` (`keras_evaluate`, bound) on the distributed inputs."""
    arguments = data_inputs.bind_inputs(model, keras.Model.evaluate, args, kwargs, ("x",))
    step_functions.keras_step_counts(model, arguments, ("steps",))
    with (
        keras_fixes.collecting_after(model.distribute_strategy),  # Exits last.
        workers.naming_lost_workers(model),
        monitoring.tracking_call(model, "evaluate"),
        monitoring.tracking_callbacks(arguments.get("callbacks")),
        data_inputs.distributing_inputs(model, ["evaluate"], arguments),
        coupling.remembering_first_batch(model, arguments),
    ):
        return keras_evaluate(**workers.chief_only_verbosity(model, arguments))


def predict(model, keras_predict, args, kwargs):
    """`DistributedModel.predict`: Keras' `predict` (`keras_predict`, bound) on the distributed inputs."""
    arguments = data_inputs.bind_inputs(model, keras.Model.predict, args, kwargs, ("x",))
    step_functions.keras_step_counts(model, arguments, ("steps",))
    with (
        keras_fixes.collecting_after(model.distribute_strategy),  # Exits last.
        workers.naming_lost_workers(model),
        monitoring.tracking_call(model, "predict"),
        monitoring.tracking_callbacks(arguments.get("callbacks")),
        data_inputs.distributing_inputs(model, ["predict"], arguments),
    ):
        return keras_predict(**workers.chief_only_verbosity(model, arguments))


def predict_on_batch(model, x):
    """One batch's predictions split across the replicas, as `predict` splits them (several replicas)."""
    batch_size = int(keras.tree.flatten(x)[0].shape[0])
    return model.predict(x, batch_size=max(batch_size, 1), verbose=0)
