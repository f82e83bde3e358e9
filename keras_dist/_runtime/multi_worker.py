"""Create `MultiWorkerMirroredStrategy` with bounded waits, and name unreachable peers.

TensorFlow's strategy waits for the cluster without a time limit and uses one CPU
device per worker. This module (private TF internals, hence `_runtime`) adds:
a startup timeout and heartbeat timeout on TensorFlow's coordination service, an
optional collective timeout, several simulated CPU replicas per worker, a random
seed shared by all workers, and SIGTERM's default action after joining.

What happens on each worker: every worker calls `create_strategy` once, at
program start; it returns when all workers listed in the cluster have joined.
"""

import faulthandler
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading

import tensorflow as tf
from tensorflow.python.distribute import collective_all_reduce_strategy as _mwms
from tensorflow.python.distribute import multi_worker_util
from tensorflow.python.eager import context

from keras_dist import _env
from keras_dist._compat import locations
from keras_dist._runtime import keras_internals

coordination_config_pb2 = locations.coordination_config_module()  # Moved in TF 2.19 (keras_dist._compat.locations).


class _CollectiveAllReduceExtended(_mwms.CollectiveAllReduceExtended):
    """TensorFlow's extended strategy, with `num_cpu_replicas` CPU devices per worker."""

    def __init__(self, container, *, cluster_resolver, communication_options, num_cpu_replicas):
        self._keras_dist_num_cpu_replicas = num_cpu_replicas
        super().__init__(container, cluster_resolver=cluster_resolver, communication_options=communication_options)

    def _initialize_local_devices(self, cluster_resolver, worker_device):
        devices, device_type = super()._initialize_local_devices(cluster_resolver, worker_device)
        if device_type == "CPU" and self._keras_dist_num_cpu_replicas > 1:
            devices = tuple(f"{worker_device}/device:CPU:{i}" for i in range(self._keras_dist_num_cpu_replicas))
        return devices, device_type


class MultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """`tf.distribute.MultiWorkerMirroredStrategy` that can hold several CPU replicas per worker."""

    def __init__(self, cluster_resolver, communication_options, *, num_cpu_replicas=1):
        tf.distribute.Strategy.__init__(
            self,
            _CollectiveAllReduceExtended(
                self,
                cluster_resolver=cluster_resolver,
                communication_options=communication_options,
                num_cpu_replicas=num_cpu_replicas,
            ),
        )


def create_strategy(
    cluster_resolver,
    *,
    startup_timeout_seconds,
    heartbeat_timeout_seconds,
    collective_timeout_seconds,
    num_cpu_replicas=1,
):
    """Creates the multi-worker strategy; returns once every worker has joined.

    Args:
        cluster_resolver: `tf.distribute.cluster_resolver.ClusterResolver` with
            the cluster, this task's type and id.
        startup_timeout_seconds: Float, how long to wait for every task to join.
        heartbeat_timeout_seconds: Float, how long a task may stop answering
            before the others abort their collectives.
        collective_timeout_seconds: Float, the longest one collective may wait
            for its peers (0 disables).
        num_cpu_replicas: Integer, replicas per worker when the worker has no
            GPU (logical CPU devices must exist already).

    Returns:
        A `tf.distribute.MultiWorkerMirroredStrategy`.

    Raises:
        RuntimeError: TensorFlow already ran an operation in this process, or
            some workers did not join within `startup_timeout_seconds`.

    Distributed behavior:
        Collective: every worker must call this once; it blocks until all have.
    """
    cluster_spec = multi_worker_util.normalize_cluster_spec(cluster_resolver.cluster_spec())
    if cluster_spec.jobs and context.context().coordination_service is None:
        jobs = [
            coordination_config_pb2.CoordinatedJob(name=job, num_tasks=cluster_spec.num_tasks(job))
            for job in ("chief", "worker")
            if job in cluster_spec.jobs
        ]
        context.context().configure_coordination_service(
            service_type="standalone",
            service_leader=multi_worker_util.coordination_leader(cluster_spec),
            coordinated_jobs=jobs,
            cluster_register_timeout_in_ms=int(startup_timeout_seconds * 1000),
            heartbeat_timeout_in_ms=int(heartbeat_timeout_seconds * 1000),
        )
        # Without the barrier, the register timeout is not enforced: task 0 waits forever.
        if locations.coordination_register_barrier_supported():
            context.context().coordination_service.cluster_register_with_barrier = True
            watchdog = None
        else:  # TensorFlow 2.18 has no such barrier: keras-dist enforces the timeout itself.
            watchdog = _startup_watchdog(cluster_resolver, cluster_spec, startup_timeout_seconds)
    else:
        watchdog = None
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=collective_timeout_seconds or None)
    try:
        return MultiWorkerMirroredStrategy(cluster_resolver, options, num_cpu_replicas=num_cpu_replicas)
    finally:
        if watchdog is not None:
            watchdog.cancel()


def _startup_watchdog(cluster_resolver, cluster_spec, startup_timeout_seconds):
    """Ends this process with status 1 when the cluster has not formed within the startup timeout.

    Where TensorFlow's coordination service has no register barrier (TF 2.18), the
    leader waits for a missing worker forever, inside TensorFlow and holding the
    GIL, so no Python thread can run. `faulthandler`'s C timer still does: after
    `startup_timeout_seconds` (and 1 s) it writes the stacks into a pipe and
    exits with status 1; a small process reading the pipe writes the error as
    soon as the stacks start, naming the workers whose address refuses a
    connection, as an uncaught `WorkerUnavailableError` would. That process
    ignores SIGTERM and SIGINT, and `keras-dist launch` and
    `keras_dist.testing.run_workers` wait for a stopped worker's whole process
    group (`keras_dist._process.stop_process_groups`), so the error is not lost
    when the worker's group is stopped just after it exits. When the strategy
    exists first, `cancel` stops the timer and closes the pipe, and that
    process ends silently.

    Returns:
        An object whose `cancel()` stops the watchdog.
    """
    own = f"{cluster_resolver.task_type}:{cluster_resolver.task_id}"
    peers = {
        f"{job}:{index}": cluster_spec.task_address(job, index)
        for job in cluster_spec.jobs
        for index in cluster_spec.task_indices(job)
        if f"{job}:{index}" != own
    }
    read_end, write_end = os.pipe()
    reporter = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _REPORT_SCRIPT,
            json.dumps([own, peers, startup_timeout_seconds, _env.STARTUP_TIMEOUT_ENV]),
        ],
        stdin=read_end,
        close_fds=True,
    )
    os.close(read_end)
    stacks = os.fdopen(write_end, "w")
    faulthandler.dump_traceback_later(startup_timeout_seconds + 1.0, repeat=False, file=stacks, exit=True)

    class Watchdog:
        def cancel(self):
            faulthandler.cancel_dump_traceback_later()
            stacks.close()
            reporter.wait(timeout=30)

    return Watchdog()


# Run by `_startup_watchdog`'s reporter process (no TensorFlow): silent unless the pipe brings stacks.
# It ignores SIGTERM and SIGINT: stopping the worker's process group just after the worker exits must not lose
# the message (CI lost it so on the oldest stack); the end of the pipe still ends it.
_REPORT_SCRIPT = """
import json, signal, socket, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
own, peers, timeout, variable = json.loads(sys.argv[1])
if sys.stdin.buffer.read(1):  # The timer fired (the worker exits once its stacks are written): report now.
    missing = []
    for name, address in peers.items():
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
        except OSError:
            missing.append(f"{name} ({address})")
    who = ", ".join(missing) or "another worker (every address answers; one may still be starting)"
    sys.stderr.write(
        f"keras_dist.errors.WorkerUnavailableError: [{own}] {who} did not join the cluster within {timeout:g} s "
        f"({variable}). Fix: start every worker listed in the cluster (`keras-dist launch` starts them all), check "
        f"that their addresses are reachable from this machine, or raise {variable}. "
        "See docs/troubleshooting.md#worker-unavailable.\\n"
    )
    sys.stderr.flush()
    sys.stdin.buffer.read()
"""


def unreachable_addresses(addresses, *, timeout_seconds=2.0):
    """Returns the `host:port` addresses that refuse or time out a TCP connection.

    Args:
        addresses: Iterable of `"host:port"` strings.
        timeout_seconds: Float, the connect timeout per address.
    """
    unreachable = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_seconds):
                pass
        except OSError:
            unreachable.append(address)
    return unreachable


def share_random_seed(strategy):
    """Seeds Python, NumPy, TensorFlow and Keras on every worker with one seed drawn on the chief.

    Unseeded shuffles (Keras' NumPy-input shuffle, `tf.data` `shuffle` without
    `seed=`, `PyDataset` batch order) and unseeded random data must agree
    across workers, or TensorFlow's per-worker sharding of the data drops some
    examples and repeats others. A later `keras.utils.set_random_seed(s)` with
    the same `s` on every worker keeps them in agreement too.

    Args:
        strategy: The multi-worker `tf.distribute.Strategy`.

    Returns:
        Integer, the seed now set on every worker; a seed the script already
        set with `keras.utils.set_random_seed` is kept (the all-reduce still runs).

    Distributed behavior:
        Collective: every worker must call it once, at the same point.
    """
    import keras

    drawn = random.SystemRandom().randrange(1, 2**31 - 1)

    def replica_fn():
        context = tf.distribute.get_replica_context()
        is_first = tf.equal(context.replica_id_in_sync_group, 0)
        mine = tf.where(is_first, tf.constant(drawn, tf.int64), tf.constant(0, tf.int64))
        return context.all_reduce("SUM", mine)

    shared = int(strategy.experimental_local_results(strategy.run(replica_fn))[0].numpy())
    if keras_internals.get_random_seed() is not None:
        return keras_internals.get_random_seed()  # The script seeded before importing keras_dist.
    keras.utils.set_random_seed(shared)
    return shared


def same_on_every_worker(strategy, values):
    """Returns whether every worker passed the same `values`.

    Args:
        strategy: The multi-worker `tf.distribute.Strategy`.
        values: Sequence of integers (at most 2**63 - 1 each), the same length
            on every worker.

    Returns:
        Boolean, the same on every worker.

    Distributed behavior:
        Collective (one all-gather of `len(values)` int64 per replica): every
        worker must call it at the same point, with as many values.
    """
    mine = tf.constant([list(values)], tf.int64)

    def replica_fn():
        return tf.distribute.get_replica_context().all_gather(mine, axis=0)

    gathered = strategy.experimental_local_results(strategy.run(replica_fn))[0].numpy()
    return bool((gathered == gathered[:1]).all())


def restore_default_sigterm():
    """Gives SIGTERM its default action (terminate) back after TensorFlow took it over.

    TensorFlow's coordination service installs a C-level SIGTERM handler (its
    preemption notifier) that records the signal and lets the process run on.
    A Python handler the script installed itself is left alone.

    Returns:
        Boolean, whether the default action was restored.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return True
