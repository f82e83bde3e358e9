"""Base module: `TF_CONFIG` parsed and validated, without TensorFlow.

`import keras_dist` checks `TF_CONFIG` here before it imports TensorFlow, so a
malformed cluster description fails in a fraction of a second, on every worker
at once, with a message that says how to fix it (`validate_environment`);
`keras_dist.strategy` reads the cluster with the same functions.

`TF_CONFIG` is the JSON TensorFlow reads (https://www.tensorflow.org/guide/distributed_training#TF_CONFIG),
as Kubeflow's TFJob and Ray Train's TensorflowTrainer write it:
`{"cluster": {"chief": ["host:port"], "worker": ["host:port", ...]}, "task": {"type": "worker", "index": 0}}`.
"""

import dataclasses
import json
import os
import re
from collections.abc import Mapping

TRAINING_TASK_TYPES = ("chief", "worker")
_OTHER_TASK_TYPES = ("evaluator", "ps")
_TOP_LEVEL_KEYS = ("cluster", "task", "environment", "rpc_layer", "session_master")
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")
_TF_CONFIG_EXAMPLE = '{"cluster": {"worker": ["host0:port", "host1:port"]}, "task": {"type": "worker", "index": 0}}'


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """This process's place in a cluster of workers.

    Attributes:
        cluster: Dict from task type (`"chief"`, `"worker"`) to a tuple of
            `"host:port"` addresses, empty when there is no cluster.
        task_type: String, this process's task type (`"worker"` alone).
        task_id: Integer, this process's index among tasks of its type.
        source: String, where the cluster came from: `"TF_CONFIG"`, `"SLURM"`,
            `"strategy"` (read back from a strategy's cluster resolver) or
            `"local"` (no cluster).
    """

    cluster: dict
    task_type: str = "worker"
    task_id: int = 0
    source: str = "local"

    @property
    def num_workers(self) -> int:
        """Integer, the processes that train: `chief` and `worker` tasks (1 without a cluster)."""
        return sum(len(self.cluster.get(kind, ())) for kind in TRAINING_TASK_TYPES) or 1

    @property
    def is_chief(self) -> bool:
        """Boolean: task `chief`, or worker 0 when the cluster has no chief."""
        if "chief" in self.cluster:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_id == 0

    @property
    def task_name(self) -> str:
        """String `"<task_type>:<task_id>"`, the prefix the launcher puts on this worker's output."""
        return f"{self.task_type}:{self.task_id}"

    def addresses(self) -> dict[str, str]:
        """Returns a dict from task name (`"worker:1"`) to its `"host:port"`, chief first."""
        return {
            f"{kind}:{i}": address
            for kind in TRAINING_TASK_TYPES
            for i, address in enumerate(self.cluster.get(kind, ()))
        }


LOCAL = ClusterInfo(cluster={})


def parse_tf_config(text: str) -> ClusterInfo:
    """Parses and validates a `TF_CONFIG` string.

    Args:
        text: String, the JSON value of `TF_CONFIG`.

    Returns:
        `ClusterInfo` with `source="TF_CONFIG"`.

    Raises:
        ValueError: The JSON is malformed; `cluster` or `task` is missing or of
            the wrong type; a task type is unknown or unsupported (`ps`,
            `master`, a second `chief`); an address is not `host:port`; two
            tasks share an address; or the task's type or index is not in the
            cluster. Each message shows what was received and how to fix it.

    Example:
    >>> info = parse_tf_config('{"cluster": {"worker": ["a:1", "b:2"]}, '
    ...                        '"task": {"type": "worker", "index": 1}}')
    >>> info.num_workers, info.task_name, info.is_chief
    (2, 'worker:1', False)
    """
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        _fail(f"`TF_CONFIG` is not valid JSON ({e}).", text)
    if not isinstance(config, dict):
        _fail(f"`TF_CONFIG` must be a JSON object, not a {type(config).__name__}.", text)
    unknown = sorted(set(config) - set(_TOP_LEVEL_KEYS))
    if unknown:
        _fail(f"`TF_CONFIG` has unknown key(s) {unknown}; expected {list(_TOP_LEVEL_KEYS[:2])}.", text)
    cluster = _validate_cluster(config.get("cluster"), text)
    task_type, task_id = _validate_task(config.get("task"), cluster, text)
    return ClusterInfo(cluster=cluster, task_type=task_type, task_id=task_id, source="TF_CONFIG")


def _validate_cluster(cluster, text):
    if not isinstance(cluster, dict) or not cluster:
        _fail(
            "`TF_CONFIG` needs a non-empty `cluster` object mapping task types to address lists.",
            text,
        )
    for kind, addresses in cluster.items():
        if kind == "master":
            _fail("Task type `master` is TensorFlow 1's name; TensorFlow 2 calls it `chief`.", text)
        if kind == "ps":
            _fail(
                "keras-dist trains with MultiWorkerMirroredStrategy, which has no parameter "
                "servers (Keras 3 `fit` does not support ParameterServerStrategy, "
                "keras-team/keras#18624); remove the `ps` tasks.",
                text,
            )
        if kind not in TRAINING_TASK_TYPES + _OTHER_TASK_TYPES:
            _fail(f"Unknown task type {kind!r} in `cluster`; expected `chief` and/or `worker`.", text)
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            _fail(f'`cluster.{kind}` must be a list of "host:port" strings.', text)
        for address in addresses:
            match = _ADDRESS.match(address)
            if not match or not 1 <= int(match.group(2)) <= 65535:
                _fail(
                    f'Address {address!r} of `cluster.{kind}` is not "host:port" with a port from 1 to 65535.',
                    text,
                )
    if len(cluster.get("chief", [])) > 1:
        _fail(f"A cluster has at most one `chief`; got {len(cluster['chief'])}.", text)
    if not any(cluster.get(kind) for kind in TRAINING_TASK_TYPES):
        _fail("`cluster` lists no `chief` or `worker` task, so nobody trains.", text)
    seen = {}
    for kind, addresses in cluster.items():
        for i, address in enumerate(addresses):
            if address in seen:
                _fail(f"Tasks {seen[address]} and {kind}:{i} share the address {address!r}.", text)
            seen[address] = f"{kind}:{i}"
    return {kind: tuple(addresses) for kind, addresses in cluster.items()}


def _validate_task(task, cluster, text):
    num_tasks = sum(len(v) for v in cluster.values())
    if task is None and num_tasks == 1:
        return next((kind, 0) for kind, v in cluster.items() if v)
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        _fail('`TF_CONFIG` needs `"task": {"type": ..., "index": ...}` naming this process.', text)
    task_type, task_id = task["type"], task["index"]
    if task_type not in cluster:
        _fail(f"`task.type` {task_type!r} is not a task type of `cluster` ({sorted(cluster)}).", text)
    if task_type in _OTHER_TASK_TYPES:
        _fail(
            f"This process is task {task_type!r}; keras-dist runs only `chief` and `worker` "
            "tasks (side-car evaluation is not supported). Run evaluation inside `fit` "
            "(`validation_data=`) or start this process without that TF_CONFIG.",
            text,
        )
    if isinstance(task_id, bool) or not isinstance(task_id, int):
        _fail(f"`task.index` must be an integer; got {task_id!r}.", text)
    if not 0 <= task_id < len(cluster[task_type]):
        _fail(
            f"`task.index` {task_id} is out of range: `cluster.{task_type}` has "
            f"{len(cluster[task_type])} task(s), so the index must be 0 to {len(cluster[task_type]) - 1}.",
            text,
        )
    return task_type, task_id


def _fail(problem, text):
    raise ValueError(
        f"Invalid TF_CONFIG: {problem} Received: TF_CONFIG={text[:300]!r}. Expected a JSON object like "
        f"{_TF_CONFIG_EXAMPLE}. Fix: correct TF_CONFIG (or unset it to train on this machine "
        "only); `keras-dist launch` writes a valid one for local runs. See docs/troubleshooting.md#tf_config."
    )


def validate_environment(environ: Mapping[str, str] | None = None) -> None:
    """Parses `TF_CONFIG` where it is set, to fail at once on a malformed one.

    Args:
        environ: Mapping of environment variables. Defaults to `os.environ`.

    Raises:
        ValueError: `TF_CONFIG` is set but invalid (see `parse_tf_config`).
    """
    environ = os.environ if environ is None else environ
    raw = environ.get("TF_CONFIG", "").strip()
    if raw:
        parse_tf_config(raw)
