"""`keras-dist launch`: start one process per worker, each with its own TF_CONFIG.

Owns: turning the command line into a cluster spec and one environment per
worker (pure functions below), and validating the command line. Only `launch_command`
starts processes; `_worker_group.WorkerGroup` supervises them (output prefixed
`[worker:<task_id>]`, stopping all when one fails or on SIGINT or SIGTERM).
Must not: import TensorFlow or Keras (the launcher runs without them), or
interpret the script's own arguments.

Exit status of `keras-dist launch`:
    0 when every worker exits with status 0;
    the status of the first worker seen failing, or 128 + N when that worker was
    killed by signal N (the shell's convention, e.g. 137 for SIGKILL);
    130 after SIGINT and 143 after SIGTERM to the launcher, or 75 when the
    workers saved a backup on that SIGTERM (a `BackupAndRestore` in `fit`):
    run the same command again to resume;
    with --max-restarts N, a failed worker group is restarted up to N times
    (new ports, KERAS_DIST_RESTART_COUNT=1, 2, ...), and the status is that of
    the last attempt;
    with --min-workers M as well (elastic), each worker slot may fail N times;
    one that fails again is dropped and the others go on, renumbered, while at
    least M remain (a dropped slot gets one more try at the next restart that
    another slot's failure causes); the status is that of the last attempt;
    2 for a bad command line (reported by argparse before any process starts).
"""

import argparse
import os
import sys

from keras_dist._env import (
    RESTART_COUNT_ENV,
    WORKER_SLOT_ENV,
)
from keras_dist.cli._cluster_env import (  # Re-exported: the launcher's public functions.
    DEFAULT_NUM_WORKERS,
    LOOPBACK,
    build_cluster_spec,
    build_tf_config,
    build_worker_env,
    check_positive_int,
    check_seconds,
    find_free_ports,
    parse_worker_addresses,
)
from keras_dist.cli._elastic import Membership
from keras_dist.cli._threads import (
    check_threads,
    threads_for_launch,
    threads_per_worker,
)
from keras_dist.cli._worker_group import WorkerGroup, exit_status_message, launcher_exit_status

DEFAULT_GRACE_PERIOD = 10.0

__all__ = [
    "build_cluster_spec",
    "build_tf_config",
    "build_worker_env",
    "exit_status_message",
    "find_free_ports",
    "launch_command",
    "launch_command_parser",
    "launcher_exit_status",
    "parse_worker_addresses",
    "threads_per_worker",
]


def launch_command_parser(subparsers):
    """Adds the `launch` subcommand to `subparsers`.

    Args:
        subparsers: The object returned by `ArgumentParser.add_subparsers()`.

    Returns:
        The `argparse.ArgumentParser` of `launch`.

    Example:
    >>> parser = argparse.ArgumentParser(prog="keras-dist")
    >>> _ = launch_command_parser(parser.add_subparsers())
    >>> args = parser.parse_args(["launch", "--num-workers", "3", "train.py", "--epochs", "3"])
    >>> args.num_workers, args.script, args.script_args
    (3, 'train.py', ['--epochs', '3'])
    """
    parser = subparsers.add_parser(
        "launch",
        help="Run a training script on several workers, each with its own TF_CONFIG.",
        description="Run SCRIPT once per worker with TF_CONFIG set; output lines are prefixed [worker:i].",
        epilog=__doc__ and __doc__[__doc__.index("Exit status") :],  # None under python -OO.
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("--num-workers", type=int, metavar="W", help=f"local workers on {LOOPBACK} (default {DEFAULT_NUM_WORKERS})")
    add("--workers", metavar="HOST:PORT,...", help="every worker's address, in task order (a real cluster)")
    add("--task-index", type=int, metavar="I", help="with --workers: the one worker this machine runs")
    add("--cpu-replicas", type=int, metavar="R", help="split each worker's CPU into R replicas")
    add(
        "--threads-per-worker",
        type=int,
        metavar="N",
        help="TensorFlow intra-op and inter-op threads per worker; 0 = TensorFlow's default "
        "(default: the host's cores shared out among the local workers)",
    )
    add("--startup-timeout", type=float, metavar="SECONDS", help="passed as KERAS_DIST_STARTUP_TIMEOUT")
    add("--heartbeat-timeout", type=float, metavar="SECONDS", help="passed as KERAS_DIST_HEARTBEAT_TIMEOUT")
    add("--collective-timeout", type=float, metavar="SECONDS", help="passed as KERAS_DIST_COLLECTIVE_TIMEOUT")
    add(
        "--stall-timeout",
        type=float,
        metavar="SECONDS",
        help="passed as KERAS_DIST_STALL_TIMEOUT: the stall watchdog's bound (default 60; 0 = off)",
    )
    add(
        "--grace-period",
        type=float,
        default=DEFAULT_GRACE_PERIOD,
        metavar="SECONDS",
        help=f"wait after SIGTERM/SIGINT before SIGKILL (default {DEFAULT_GRACE_PERIOD:g})",
    )
    add(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart all workers up to N times after a failure (default 0); the script resumes with BackupAndRestore",
    )
    add(
        "--min-workers",
        type=int,
        metavar="M",
        help="elastic: a worker that fails after its --max-restarts is dropped, and the rest go on from the "
        "last backup while at least M remain (a local launch only; default: the number of workers, no drop)",
    )
    add("-m", "--module", action="store_true", help="SCRIPT is a module name, run as python -m")
    add("script", metavar="SCRIPT", help="the training script (or module, with -m)")
    add("script_args", nargs=argparse.REMAINDER, metavar="...", help="arguments passed to SCRIPT unchanged")
    parser.set_defaults(func=launch_command, parser=parser)
    return parser


def launch_command(args):
    """Runs `keras-dist launch`: starts the workers and waits for all of them.

    Args:
        args: `argparse.Namespace` parsed by the `launch` parser.

    Returns:
        Integer exit status; see this module's docstring.

    Raises:
        SystemExit: Status 2 for a bad command line, before any process starts.
        ValueError: A bad command line when `args` has no `parser` to report it.
    """
    try:
        _validate_args(args)
    except ValueError as exc:
        if getattr(args, "parser", None) is None:
            raise
        args.parser.error(str(exc))
    options = dict(
        cpu_replicas=args.cpu_replicas,
        startup_timeout=args.startup_timeout,
        heartbeat_timeout=args.heartbeat_timeout,
        collective_timeout=args.collective_timeout,
        stall_timeout=getattr(args, "stall_timeout", None),
    )
    command = [sys.executable, "-u", *(["-m"] if args.module else []), args.script, *args.script_args]
    requested_threads = getattr(args, "threads_per_worker", None)
    max_restarts = getattr(args, "max_restarts", 0) or 0
    num_workers = 1 if args.workers is not None else (args.num_workers or DEFAULT_NUM_WORKERS)
    membership = Membership(num_workers, max_restarts, getattr(args, "min_workers", None))
    while True:
        if args.workers is not None:
            cluster_spec = build_cluster_spec(addresses=parse_worker_addresses(args.workers))
            task_ids = [args.task_index]
        else:
            cluster_spec = build_cluster_spec(ports=find_free_ports(len(membership.slots)))  # Fresh ports per attempt.
            task_ids = range(len(membership.slots))
        threads = threads_for_launch(len(task_ids), requested_threads, os.environ)
        envs = {}
        for i in task_ids:
            envs[i] = build_worker_env(
                os.environ, cluster_spec=cluster_spec, task_id=i, threads_per_worker=threads, **options
            )
            envs[i][RESTART_COUNT_ENV] = str(membership.attempt)
            if args.workers is None:
                envs[i][WORKER_SLOT_ENV] = str(membership.worker_slot(i))
        group = WorkerGroup(grace_period=args.grace_period)
        status = group.run(command, envs)
        if status == 0 or group.received_signal is not None:
            return status
        failed = group.failed_task_id if args.workers is None else 0
        decision = membership.after_failure(membership.worker_slot(failed or 0))
        if not decision.restart and not membership.elastic:
            return status  # Restarts used up: the fixed policy ends with the last attempt's status, silently.
        print(f"keras-dist launch: {decision.message}", file=sys.stderr, flush=True)
        if not decision.restart:
            return status


def _validate_args(args):
    if args.workers is not None:
        _validate_cluster_args(args)
    elif args.task_index is not None:
        raise ValueError(
            "`--task-index` only applies with `--workers`; a local launch starts every worker. "
            f"Received: --task-index={args.task_index}. Fix: drop --task-index, or add --workers."
        )
    elif args.num_workers is not None:
        check_positive_int("--num-workers", args.num_workers, fix="pass --num-workers 1 or more.")
    if args.cpu_replicas is not None:
        check_positive_int("--cpu-replicas", args.cpu_replicas, fix="pass --cpu-replicas 1 or more.")
    if getattr(args, "threads_per_worker", None) is not None:
        check_threads("--threads-per-worker", args.threads_per_worker)
    for name in ("startup_timeout", "heartbeat_timeout", "collective_timeout"):
        if getattr(args, name) is not None:
            check_seconds("--" + name.replace("_", "-"), getattr(args, name))
    if getattr(args, "stall_timeout", None) is not None:
        check_seconds("--stall-timeout", args.stall_timeout, allow_zero=True)
    check_seconds("--grace-period", args.grace_period, allow_zero=True)
    max_restarts = getattr(args, "max_restarts", 0)
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(
            f"`--max-restarts` must be an integer >= 0. Received: --max-restarts={max_restarts}. "
            "Fix: pass 0 (no restart) or the number of restarts to allow."
        )
    min_workers = getattr(args, "min_workers", None)
    if min_workers is not None:
        if args.workers is not None:
            raise ValueError(
                "`--min-workers` applies to a local launch (`--num-workers`): with `--workers`, each machine "
                f"runs its own launcher and no launcher sees them all. Received: --min-workers={min_workers} "
                "with --workers. Fix: drop --min-workers, or let your cluster engine restart the job."
            )
        num_workers = args.num_workers or DEFAULT_NUM_WORKERS
        if not isinstance(min_workers, int) or not 1 <= min_workers <= num_workers:
            raise ValueError(
                f"`--min-workers` must be from 1 to the number of workers ({num_workers}). "
                f"Received: --min-workers={min_workers}. Fix: pass a count from 1 to {num_workers}, or drop it."
            )
    if not args.module and not os.path.isfile(args.script):
        raise ValueError(
            f"The script to launch must be an existing file. Received: SCRIPT={args.script!r} "
            f"(working directory {os.getcwd()!r}). Fix: check the path, or pass -m to run a module."
        )


def _validate_cluster_args(args):
    if args.num_workers is not None:
        raise ValueError(
            "Pass either `--workers` (a real cluster) or `--num-workers` (local workers), not both. "
            f"Received: --workers={args.workers}, --num-workers={args.num_workers}. "
            "Fix: drop --num-workers; with --workers the count is the number of addresses."
        )
    addresses = parse_worker_addresses(args.workers)
    if args.task_index is None:
        raise ValueError(
            "`--task-index` is required with `--workers`: it picks the worker this machine runs. "
            f"Received: --workers={args.workers} and no --task-index. "
            "Fix: pass --task-index 0 on the first machine, 1 on the next, and so on."
        )
    if not 0 <= args.task_index < len(addresses):
        raise ValueError(
            f"`--task-index` must be from 0 to {len(addresses) - 1}, one per address in `--workers`. "
            f"Received: --task-index={args.task_index}, --workers={args.workers}. "
            "Fix: pass the position of this machine's address in --workers, counting from 0."
        )
