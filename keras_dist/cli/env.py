"""`keras-dist env`: what a bug report needs, ready to paste.

Owns: collecting versions, devices, the detected cluster, the strategy
`strategy="auto"` would pick and the active compatibility fixes, and printing
them as Markdown. Must not: join a cluster or create a strategy (it only reads).
"""

import importlib.util
import os
import platform
import re
import sys
from importlib import metadata

from keras_dist import _env, version

# The modules whose version and distribution the report names, with the package name of `version.SUPPORTED`.
_MODULES = {"keras": "keras", "tensorflow": "tensorflow", "tensorflow_datasets": None, "numpy": None}
_DISTRIBUTIONS = ("protobuf", "libtpu")  # Looked up by distribution name (no module of their own to ask).


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
    environ = os.environ if environ is None else environ
    supported = {
        "range": version.supported_summary(),
        "tested stacks": version.describe_tested_stacks(),
        "watched": f"{' and '.join(version.WATCHED)} (CI runs them; a failure there does not fail CI)",
    }
    sections = {"Versions": collect_versions(), "Supported and tested": supported}
    if importlib.util.find_spec("tensorflow") is None:
        return {**sections, "TensorFlow": {"error": version.missing_tensorflow_message()}}
    return {**sections, **_collect_runtime(environ)}


def _collect_runtime(environ):
    """Returns the sections that need TensorFlow: devices, cluster, strategy, fixes, settings."""
    from keras_dist import _compat
    from keras_dist._runtime import devices
    from keras_dist.strategy import _cluster, _resolve

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


def collect_versions(distributions=None):
    """Returns `{name: description}` for Python, keras-dist, Keras, TensorFlow, TFDS, NumPy, protobuf, libtpu.

    Each module is named with the distribution that installed it (`tf-nightly`, `tensorflow-tpu`,
    `keras-nightly`...), found from the installed files (`importlib.metadata.packages_distributions`),
    not by a distribution's name; Python, Keras and TensorFlow also say whether their version is
    inside the supported range (`keras_dist.version.SUPPORTED`).

    Args:
        distributions: Mapping from a top-level module to the distributions that install it.
            Defaults to `importlib.metadata.packages_distributions()`.

    Returns:
        Dict from name to a one-line string.
    """
    if distributions is None:
        distributions = metadata.packages_distributions()
    python = sys.version.split()[0]
    versions = {
        "python": f"{python} ({_range_note('python', python)})",
        "platform": platform.platform(),
        "keras-dist": _keras_dist_version(),
    }
    for module, package in _MODULES.items():
        versions[module.replace("_", "-")] = _describe_module(module, package, distributions.get(module, ()))
    for name in _DISTRIBUTIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def _keras_dist_version():
    where = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        installed = metadata.version("keras-dist")
    except metadata.PackageNotFoundError:
        return f"{version.__version__} (no installed distribution: imported from {where})"
    if installed != version.__version__:
        return f"{version.__version__} (imported from {where}; the installed distribution says {installed})"
    return version.__version__


def _describe_module(module, package, dists):
    """Returns `"2.20.0 (distribution tensorflow-tpu; inside the supported range 2.18-2.21)"` and the like."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        return "not installed"
    found = []
    for dist in dict.fromkeys(dists):  # In order, once each.
        try:
            found.append((_normalize(dist), metadata.version(dist)))
        except metadata.PackageNotFoundError:
            pass
    loaded = sys.modules.get(module)
    running = getattr(loaded, "__version__", None) or (found[0][1] if len(found) == 1 else None)
    if not found:
        notes = [f"no installed distribution: imported from {spec.origin}"]
    elif len(found) == 1:
        notes = [f"distribution {found[0][0]}"]
    else:
        listed = ", ".join(f"{dist} {installed}" for dist, installed in found)
        notes = [
            f"distributions {listed} each install the `{module}` module, over one another's files: "
            "uninstall them all, then install one"
        ]
    if package is not None and running is not None:
        notes.append(_range_note(package, running))
    return f"{running or 'unknown version'} ({'; '.join(notes)})"


def _normalize(dist):
    """Returns a distribution's name as pip spells it (PEP 503): `tensorflow_tpu` -> `tensorflow-tpu`."""
    return re.sub(r"[-_.]+", "-", dist).lower()


def _range_note(package, installed):
    where = "inside" if version.in_supported_range(package, installed) else "outside"
    note = f"{where} the supported range {version.supported_range(package)}"
    return note + (": not tested (see docs/compat.md)" if where == "outside" else "")


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
