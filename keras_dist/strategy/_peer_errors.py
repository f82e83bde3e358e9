"""Layer 2: messages for a worker that did not join, stopped answering, or ran another program.

TensorFlow reports these as generic `UnavailableError`/`DeadlineExceededError`/
`InvalidArgumentError` texts; the functions here name the worker(s) involved
(from the message, else by probing their addresses) and say what to do.
"""

import re

from keras_dist import _env, errors
from keras_dist._runtime import multi_worker
from keras_dist.strategy._cluster import LOCAL, parse_tf_config  # noqa: F401 (doctests)

_TASK_IN_MESSAGE = re.compile(r"/job:(chief|worker)/(?:replica:\d+/)?task:(\d+)")


_USEFUL_MARKERS = (
    "mismatch",
    "unhealthy",
    "Socket closed",
    "Connection refused",
    "timed out",
    "Barrier",
    "aborted",
    "is down",
)


def _informative_line(error_text):
    """Returns the line of a TensorFlow error that says most about the cause."""
    lines = [line.strip() for line in error_text.splitlines() if line.strip()]
    for marker in _USEFUL_MARKERS:
        for line in lines:
            if marker in line:
                return line
    return next((line for line in lines if line != "Graph execution error:"), "")


def tasks_named_in(message, info):
    """Returns the other tasks a TensorFlow error message names, as `"worker:1"`, in order.

    Args:
        message: String, the text of a TensorFlow error.
        info: `ClusterInfo` of this process (its own task is left out).
    """
    names = []
    for kind, index in _TASK_IN_MESSAGE.findall(message):
        name = f"{kind}:{int(index)}"
        if name != info.task_name and name not in names and name in info.addresses():
            names.append(name)
    return names


def peer_failure_message(info, error_text, *, missing, during, timeout_seconds, timeout_variable):
    """Returns the message of a `WorkerUnavailableError`.

    Args:
        info: `ClusterInfo` of this process.
        error_text: String, TensorFlow's error message (its first line is quoted).
        missing: List of task names (`"worker:1"`) that did not answer.
        during: String, `"startup"` (joining the cluster), `"training"` or `"collective"`.
        timeout_seconds: Float, the timeout that expired, in seconds.
        timeout_variable: String, the environment variable that sets it.

    Example:
    >>> info = parse_tf_config('{"cluster": {"worker": ["h:1", "h:2"]}, '
    ...                        '"task": {"type": "worker", "index": 0}}')
    >>> peer_failure_message(info, "boom", missing=["worker:1"], during="startup",
    ...                      timeout_seconds=5, timeout_variable="X")[:61]
    '[worker:0] worker:1 (h:2) did not join the cluster within 5 s'
    """
    addresses = info.addresses()
    who = ", ".join(f"{name} ({addresses[name]})" for name in missing) or (
        "another worker (TensorFlow did not say which)"
    )
    first_line = _informative_line(error_text)
    if during == "startup":
        what = f"did not join the cluster within {timeout_seconds:g} s ({timeout_variable})"
        fix = (
            "start every worker listed in the cluster (`keras-dist launch` starts them all), check "
            f"that their addresses are reachable from this machine, or raise {timeout_variable}"
        )
    elif during == "collective":
        what = f"did not take part in a collective within {timeout_seconds:g} s ({timeout_variable})"
        fix = (
            "read that worker's log: every worker must run the same steps (same number of batches "
            f"and the same calls to fit/evaluate/predict), or raise {timeout_variable}"
        )
    else:
        what = (
            "stopped answering or crashed (seen from a broken connection, or after "
            f"{timeout_seconds:g} s without heartbeats, {timeout_variable})"
        )
        fix = (
            "read the log of that worker for why it stopped, then restart all workers "
            "(keras.callbacks.BackupAndRestore resumes from the last finished epoch). If it "
            "ended normally, the workers ran different programs: every worker must make the "
            "same fit/evaluate/predict calls (not `if keras_dist.is_chief(): model.evaluate(...)`)"
        )
    return (
        f"[{info.task_name}] {who} {what}. Received from TensorFlow: {first_line[:300]} "
        f"Fix: {fix}. See docs/troubleshooting.md#worker-unavailable."
    )


_TIMEOUT_VARIABLES = {
    "startup": ("startup_timeout_seconds", _env.STARTUP_TIMEOUT_ENV),
    "training": ("heartbeat_timeout_seconds", _env.HEARTBEAT_TIMEOUT_ENV),
    "collective": ("collective_timeout_seconds", _env.COLLECTIVE_TIMEOUT_ENV),
}


def worker_unavailable_error(info, error_text, *, during, timeouts):
    """Returns a `WorkerUnavailableError` naming the workers that did not answer.

    The workers are those TensorFlow's message names; when it names none, those
    whose address refuses a TCP connection now.

    Args:
        info: `ClusterInfo` of this process.
        error_text: String, TensorFlow's error message.
        during: String, `"startup"`, `"training"` (heartbeats stopped) or
            `"collective"` (a collective timed out).
        timeouts: Dict of timeouts in seconds, as `timeouts_from_environment` returns.
    """
    missing = tasks_named_in(error_text, info)
    if not missing:
        peers = {name: a for name, a in info.addresses().items() if name != info.task_name}
        down = set(multi_worker.unreachable_addresses(peers.values()))
        missing = [name for name, address in peers.items() if address in down]
    key, variable = _TIMEOUT_VARIABLES[during]
    message = peer_failure_message(
        info,
        error_text,
        missing=missing,
        during=during,
        timeout_seconds=timeouts[key],
        timeout_variable=variable,
    )
    return errors.WorkerUnavailableError(message, missing)


def out_of_step_message(info, error_text):
    """Returns the message for workers that ran different collectives (a mismatched program).

    Args:
        info: `ClusterInfo` of this process.
        error_text: String, TensorFlow's error message (e.g. "Shape mismatch in
            the collective instance 804").

    Example:
    >>> out_of_step_message(LOCAL, "Shape mismatch in the collective instance 7")[:58]
    '[worker:0] The workers are out of step: another worker ran'
    """
    return (
        f"[{info.task_name}] The workers are out of step: another worker ran a different "
        f"collective operation at the same point. Received from TensorFlow: "
        f"{_informative_line(error_text)[:300]} Fix: every worker must make the same "
        "fit/evaluate/predict calls with the same epochs, steps and batch sizes (do not "
        "guard them with `if keras_dist.is_chief():`)"
        + (
            "; a shape mismatch in the training step can also mean the workers' steps give gradients "
            "to different variables (do not branch on `keras_dist.task_id()` in `call` or `train_step`, "
            "docs/troubleshooting.md#gradient-structure)"
            if "shape mismatch" in error_text.lower()
            else ""
        )
        + ". See docs/troubleshooting.md#out-of-step."
    )


def gradient_structure_message(info, error_text):
    """Returns the message for workers whose steps give gradients to different variables.

    Args:
        info: `ClusterInfo` of this process.
        error_text: String, TensorFlow's assertion message from
            `keras_dist.collectives`' gradient-structure check; the variable
            names follow the check's own sentence.

    Example:
    >>> message = gradient_structure_message(LOCAL, "assertion failed: [...on others:] [dense/kernel]")
    >>> message[:62], "for: dense/kernel." in message
    ('[worker:0] The workers disagree on which variables receive a g', True)
    """
    names = error_text.split("on others:", 1)[-1].split("\n", 1)[0].strip(" []")
    return (
        f"[{info.task_name}] The workers disagree on which variables receive a gradient. "
        f"Expected: every worker's step gives a gradient to the same variables (dense or sparse alike). "
        f"Received: a gradient on some workers and none (or a sparse one) on others for: {names[:500]}. "
        "Fix: do not branch on `keras_dist.task_id()`, `is_chief()` or other per-worker Python values "
        "inside `call` or `train_step`; use the same layers on every worker (a layer may take a zero "
        "weight instead of being skipped). See docs/troubleshooting.md#gradient-structure."
    )
