"""Whether this Python process is the `keras-dist` command itself (it must not load TensorFlow)."""

import os
import sys
from collections.abc import Sequence

from keras_dist._env import RESTART_COUNT_ENV as RESTART_COUNT_ENV  # Set by `keras-dist launch`; re-exported.

CLI_MODULE = "keras_dist.cli"
RESTART_EXIT_STATUS = 75  # EX_TEMPFAIL (sysexits.h): a worker saved its state and asks to be started again.


def is_keras_dist_command(orig_argv: Sequence[str] | None = None) -> bool:
    """Returns whether the process was started as `keras-dist ...` or `python -m keras_dist.cli ...`.

    Args:
        orig_argv: List of strings, the interpreter's original command line.
            Defaults to `sys.orig_argv`.

    Example:
    >>> is_keras_dist_command(["python", "-m", "keras_dist.cli", "launch"])
    True
    >>> is_keras_dist_command(["python", "-m", "mypackage.train"])
    False
    """
    argv = list(sys.orig_argv if orig_argv is None else orig_argv)
    if len(argv) > 1 and os.path.basename(argv[1]) == "keras-dist":  # python .../bin/keras-dist
        return True
    if argv and os.path.basename(argv[0]) == "keras-dist":
        return True
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("-m"):
            module = arg[2:] or (argv[i + 1] if i + 1 < len(argv) else "")
            return module in (CLI_MODULE, "keras_dist")
        if not arg.startswith("-") or arg == "-c":
            return False  # a script or -c: the interpreter's own options end here
        i += 2 if arg in _OPTIONS_WITH_VALUE else 1
    return False


_OPTIONS_WITH_VALUE = ("-X", "-W", "--check-hash-based-pycs")
