"""Checks that each notebook's install cell leaves a stack's Keras, TensorFlow, TFDS, h5py and NumPy as they are.

    python ci/stacks/check_install_cells.py PYTHON [--notebooks DIR] [--source PATH]

For each examples/notebooks/*.ipynb, the first code cell that runs `pip install` is executed by PYTHON
(the stack's interpreter, e.g. a venv that mirrors Colab's package list) with `subprocess.run`
replaced by a recorder, so the cell decides what to install as it would on that stack (the TPU
notebook adds tensorflow-tpu only where there is no TensorFlow). Each recorded install then runs as
`PYTHON -m pip install --dry-run --quiet --report - <args>`, with keras-dist's requirement pointing
at the local checkout (PATH, default: this repository) instead of the repository on the web. The
check fails, naming the notebook and the package, when pip would install, upgrade, downgrade or
reinstall any keras* (keras-dist itself excepted), tensorflow*, tf-*, h5py or numpy distribution.
Needs only the standard library (and the index, or pip's cache, for the dry run). Exit status 0:
every notebook passes; 1: some would change the stack; 2: a notebook has no install cell or the cell
or pip failed.
"""

import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Distributions an install cell must not touch (names normalized as in PEP 503).
PROTECTED = re.compile(r"^(keras.*|tensorflow.*|tf-.*|h5py|numpy)$")
OURS = "keras-dist"
# How the notebooks name keras-dist: the repository on the web, or the distribution itself.
KERAS_DIST_REQUIREMENT = re.compile(
    r"^(git\+https://github\.com/keras-dist/keras-dist(\.git)?(@[^#\s]*)?(#.*)?|keras[-_]dist(\[[^\]]*\])?)$"
)

# Runs a cell's source in the stack's Python and prints, as JSON, the argument lists of the
# `pip install` commands it would run (they are recorded, not run).
RECORDER = r"""
import json, os, shlex, subprocess, sys

source = sys.stdin.read()
installs = []

def record(args, *unused_args, **unused_kwargs):
    argv = shlex.split(args) if isinstance(args, str) else [str(a) for a in args]
    if "pip" not in argv or "install" not in argv[argv.index("pip"):]:
        raise SystemExit(f"the install cell runs something other than pip install: {argv}")
    installs.append(argv[argv.index("install", argv.index("pip")) + 1:])
    return subprocess.CompletedProcess(argv, 0, "", "")

subprocess.run = subprocess.call = subprocess.check_call = record
os.environ.pop("KERAS_DIST_SMOKE", None)  # The cell as a user runs it.
lines = []
for line in source.splitlines():  # IPython's `!pip install ...` and `%pip install ...` lines.
    stripped = line.strip()
    if stripped.startswith(("!pip ", "%pip ", "!python -m pip ", "%python -m pip ")):
        line = line[: len(line) - len(stripped)] + f"subprocess.run({stripped[1:]!r})"
    lines.append(line)
exec(compile("\n".join(lines), "<install cell>", "exec"), {"__name__": "__main__", "subprocess": subprocess})
print(json.dumps(installs))
"""


def normalize(name):
    """Returns `name` normalized as in PEP 503 (`Tensorflow_CPU` -> `tensorflow-cpu`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def install_cell(path):
    """Returns the source of the first code cell of the notebook at `path` that runs `pip install`, or `None`."""
    with open(path, encoding="utf-8") as f:
        notebook = json.load(f)
    for cell in notebook["cells"]:
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] == "code" and "pip" in source and "install" in source:
            return source
    return None


def recorded_installs(python, source):
    """Returns the argument lists (after `install`) of the pip installs the cell would run under `python`."""
    result = subprocess.run(
        [python, "-c", RECORDER], input=source, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    if result.returncode != 0:
        raise RuntimeError(f"the install cell failed under {python}: {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def local_arguments(args, source_dir):
    """Returns pip's arguments with keras-dist's requirement replaced by `source_dir` (extras kept) and -q dropped."""
    replaced, found = [], False
    for arg in args:
        if arg in ("-q", "--quiet", "-qq"):
            continue
        match = KERAS_DIST_REQUIREMENT.match(arg)
        if match:
            extras = re.search(r"\[[^\]]*\]$", arg.split("#")[0])
            arg, found = source_dir + (extras.group(0) if extras else ""), True
        replaced.append(arg)
    return replaced, found


def installed_versions(python):
    """Returns `{normalized name: version}` of the distributions installed for `python`."""
    code = (
        "import json, importlib.metadata as m\n"
        "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions() if d.metadata['Name']}))"
    )
    result = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return {normalize(name): version for name, version in json.loads(result.stdout).items()}


def dry_run(python, args):
    """Returns `[(normalized name, version)]` that `pip install args` would install, from pip's report."""
    command = [python, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()[-3000:]}")
    report = json.loads(result.stdout)
    return [(normalize(item["metadata"]["name"]), item["metadata"]["version"]) for item in report["install"]]


def changes(planned, installed):
    """Returns a line for each protected distribution in `planned` (from `dry_run`), saying what pip would do."""
    found = []
    for name, new in planned:
        if name == OURS or not PROTECTED.match(name):
            continue
        old = installed.get(name)
        if old is None:
            found.append(f"install {name} {new}")
        elif old == new:
            found.append(f"reinstall {name} {new}")
        else:
            found.append(f"change {name} {old} -> {new}")
    return found


def check(python, notebooks, source_dir):
    """Checks every notebook in `notebooks`; returns the exit status (see the module docstring)."""
    installed = installed_versions(python)
    stack = ", ".join(f"{n} {v}" for n, v in sorted(installed.items()) if PROTECTED.match(n) and n != OURS)
    print(f"stack: {python} ({stack or 'none of ' + PROTECTED.pattern})")
    status = 0
    for name in sorted(n for n in os.listdir(notebooks) if n.endswith(".ipynb")):
        source = install_cell(os.path.join(notebooks, name))
        try:
            if source is None:
                raise RuntimeError("no install cell (a code cell that runs pip install)")
            installs = recorded_installs(python, source)
            if not installs:
                raise RuntimeError("the install cell installs nothing on this stack")
            problems, planned_names, named_ours = [], [], False
            for args in installs:
                args, found = local_arguments(args, source_dir)
                named_ours |= found
                planned = dry_run(python, args)
                planned_names += [f"{n} {v}" for n, v in planned]
                problems += changes(planned, installed)
            if not named_ours:
                raise RuntimeError("the install cell does not install keras-dist")
        except (RuntimeError, subprocess.SubprocessError, json.JSONDecodeError, KeyError) as e:
            print(f"ERROR {name}: {e}")
            status = max(status, 2)
            continue
        if problems:
            print(f"FAIL  {name}: pip would " + "; ".join(problems))
            status = max(status, 1)
        else:
            print(f"ok    {name}: installs {', '.join(planned_names)}")
    return status


def main(argv=None):
    """Parses the command line and runs `check`; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("python", help="the stack's Python interpreter (e.g. /path/to/venv/bin/python)")
    parser.add_argument("--notebooks", default=os.path.join(ROOT, "examples", "notebooks"))
    parser.add_argument("--source", default=ROOT, help="the keras-dist checkout to install (default: this one)")
    args = parser.parse_args(argv)
    return check(args.python, args.notebooks, os.path.abspath(args.source))


if __name__ == "__main__":
    sys.exit(main())
