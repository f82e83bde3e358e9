"""`keras-dist env`: what a bug report needs, ready to paste.

Owns: collecting versions, devices, the detected cluster, the strategy
`strategy="auto"` would pick and the active compatibility fixes, and printing
them as Markdown. Must not: join a cluster or create a strategy (it only reads).
"""

import os
import platform
import sys
from importlib import metadata

from keras_dist import _env

_PACKAGES = ("keras-dist", "keras", "tensorflow", "tensorflow-datasets", "numpy", "protobuf")


def env_command_parser(subparsers):
    """Adds the `env` subcommand to `subparsers`.

    Args:
        subparsers: The object returned by `ArgumentParser.add_subparsers()`.

    Returns:
        The `argparse.ArgumentParser` of `env`.
    """
    parser = subparsers.add_parser(
        "env",
        help="Print versions, devices, cluster, strategy and active fixes for a bug report.",
        description="Print versions, devices, the detected cluster and strategy, and the active "
        "compatibility fixes, as Markdown to paste into a bug report.",
    )
    parser.set_defaults(func=env_command)
    return parser


def env_command(args):
    """Prints `format_report(collect_environment())`; returns 0."""
    del args
    print(format_report(collect_environment()))
    return 0


def collect_environment(environ=None):
    """Returns the facts `keras-dist env` prints, as a dict of sections.

    Args:
        environ: Mapping of environment variables. Defaults to `os.environ`.

    Returns:
        Dict from section title to a dict of `name: value` strings.
    """
    from keras_dist import _compat
    from keras_dist._runtime import devices
    from keras_dist.strategy import _cluster, _resolve

    environ = os.environ if environ is None else environ
    versions = {"python": sys.version.split()[0], "platform": platform.platform()}
    for package in _PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    try:
        info = _cluster.cluster_from_environment(environ)
        cluster = {
            "source": info.source,
            "task": info.task_name,
            "is_chief": str(info.is_chief),
            "num_workers": str(info.num_workers),
            **info.addresses(),
        }
        num_tasks = 0 if info.source == "local" else info.num_workers
    except ValueError as e:
        cluster, num_tasks = {"error": str(e)}, 0
    strategy = _resolve.choose_strategy_name(
        tpu_available=bool(environ.get("TPU_NAME") or environ.get("COLAB_TPU_ADDR")),
        num_cluster_tasks=num_tasks,
        num_gpus=len(devices.gpu_names()),
        num_cpu_replicas=devices.num_logical_cpus(),
    )
    return {
        "Versions": versions,
        "Devices": {
            "GPUs": ", ".join(devices.gpu_names()) or "none",
            "logical CPU devices (replicas)": str(devices.num_logical_cpus()),
            "CPU cores": str(os.cpu_count()),
        },
        "Cluster": cluster,
        "Strategy": {'strategy="auto" would use': strategy},
        "Active compatibility fixes": {fix.name: fix.upstream for fix in _compat.active_fixes()},
        "Settings": {k: v for k, v in sorted(environ.items()) if k.startswith(_env.PREFIX)}
        or {f"{_env.PREFIX}*": "none set"},
    }


def format_report(sections):
    """Returns `sections` (from `collect_environment`) as Markdown.

    Example:
    >>> print(format_report({"Versions": {"keras": "3.15.1"}}))
    ### Versions
    - keras: 3.15.1
    <BLANKLINE>
    """
    lines = []
    for title, entries in sections.items():
        lines.append(f"### {title}")
        lines.extend(f"- {name}: {value}" for name, value in entries.items())
        lines.append("")
    return "\n".join(lines)
