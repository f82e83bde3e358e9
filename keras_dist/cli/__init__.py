"""The `keras-dist` console script (also `python -m keras_dist.cli`).

Owns: the top-level `argparse` parser and dispatch to one module per subcommand.
Each subcommand module `cli/<name>.py` exposes `<name>_command_parser(subparsers)`,
which adds its parser and sets `func=<name>_command`, and `<name>_command(args)`,
which returns the exit status. To add a subcommand, import its module and list
it in `_COMMAND_MODULES`.
Must not: hold subcommand logic. The subcommand modules must not import
TensorFlow or Keras at module level: `keras_dist/__init__.py` loads nothing in the
`keras-dist` process, so `launch` starts without TensorFlow (`env` imports it when run).
"""

import argparse

from keras_dist.cli import env, launch
from keras_dist.version import __version__

_COMMAND_MODULES = (env, launch)


def main(argv=None):
    """Runs the `keras-dist` command line.

    Args:
        argv: List of strings, the arguments after the program name.
            Defaults to `None` (`sys.argv[1:]`).

    Returns:
        Integer exit status of the subcommand.

    Raises:
        SystemExit: Status 2 for a bad command line (before any process
            starts), 0 after `--help` or `--version`.

    Example:
    >>> try:
    ...     main(["launch", "--num-workers", "0", "train.py"])
    ... except SystemExit as exc:
    ...     print("exit status", exc.code)
    exit status 2
    """
    parser = argparse.ArgumentParser(
        prog="keras-dist", description="Distributed training for Keras 3 on tf.distribute."
    )
    parser.add_argument("--version", action="version", version=f"keras-dist {__version__}")
    subparsers = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND", required=True)
    for module in _COMMAND_MODULES:
        name = module.__name__.rpartition(".")[2]
        getattr(module, f"{name}_command_parser")(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)
