"""Exception and warning types that users may need to catch.

keras-dist raises built-in types (`ValueError`, `TypeError`, `RuntimeError`) for
bad input and wrong state; the types here exist only where a user needs to tell
keras-dist's own conditions apart from everything else.
"""

from collections.abc import Iterable


class KerasDistWarning(UserWarning):
    """Base class of every warning keras-dist emits (so tests can turn them into errors)."""


class WorkerUnavailableError(RuntimeError):
    """Another worker did not join the cluster in time, or stopped answering during training.

    Raised on every surviving worker instead of hanging: at startup after
    `KERAS_DIST_STARTUP_TIMEOUT` seconds, during `fit`/`evaluate`/`predict`
    after `KERAS_DIST_HEARTBEAT_TIMEOUT` seconds without a heartbeat (or after
    `KERAS_DIST_COLLECTIVE_TIMEOUT` when set). The message names the worker(s).

    Attributes:
        missing: Tuple of task names (`"worker:1"`) that did not answer; empty
            when TensorFlow did not say which.
    """

    def __init__(self, message: str, missing: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)


class WorkerStalledError(WorkerUnavailableError):
    """A live worker did not reach the next collective within the stall bound (the stall watchdog).

    Raised on every worker with the same message: it names the stuck
    worker(s), the train step each last finished, what each was doing (a
    callback, saving, its own code, another collective, or frozen) and the
    collective the others wait in. The bound is `max(KERAS_DIST_STALL_TIMEOUT,
    20 x the median step time)`, 60 s by default; 0 turns the watchdog off.

    Attributes:
        missing: Tuple of the stuck workers' task names (`"worker:1"`).
    """
