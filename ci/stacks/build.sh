#!/usr/bin/env bash
# Builds one test stack's virtual environment from the project's own files (issue 20).
#
#   bash ci/stacks/build.sh STACK VENV_DIR     # STACK: colab, oldest or nightly (ci/stacks/STACK.txt)
#
# 1. Creates VENV_DIR with the stack's Python (the "# python: X.Y.Z" line of STACK.txt, from pyenv).
# 2. Installs the stack's packages (every line of STACK.txt) and records `pip freeze` in
#    VENV_DIR/stack-freeze.txt: the stack as a user has it before keras-dist.
# 3. Installs keras-dist from this checkout as a user would, plainly: pip install -c STACK.txt -e ".[test]"
#    (nightly: --no-deps, and the [test] packages apart: keras-dist's `keras` requirement would pull the
#    `keras` distribution over keras-nightly).
# 4. Fails when step 3 changed any Keras, TensorFlow, TensorBoard or TFDS package (keras*, tensorflow*,
#    tf-*, tb-*, tensorboard*), since installing keras-dist must leave the user's stack alone.
# Quiet; prints one summary line. Exit 0: built and unchanged.
set -euo pipefail

if [[ $# -ne 2 ]]; then
    echo "usage: bash ci/stacks/build.sh STACK VENV_DIR (STACK: one of colab, oldest, nightly)" >&2
    exit 2
fi
stack=$1
venv=$(realpath -m "$2")
root=$(cd "$(dirname "$0")/../.." && pwd)
constraints="$root/ci/stacks/$stack.txt"
if [[ ! -f $constraints ]]; then
    echo "build.sh: no stack named '$stack': expected $constraints (one of: $(cd "$root/ci/stacks" && ls ./*.txt | sed 's|./||; s|\.txt||' | tr '\n' ' '))" >&2
    exit 2
fi

python_version=$(sed -n 's/^# python: *\([0-9.]*\).*/\1/p' "$constraints")
if [[ -z $python_version ]]; then
    echo "build.sh: $constraints names no Python: add a line '# python: X.Y.Z'" >&2
    exit 2
fi
pyenv_root=${PYENV_ROOT:-$( (command -v pyenv >/dev/null && pyenv root) || echo "$HOME/.pyenv")}
python="$pyenv_root/versions/$python_version/bin/python"
if [[ ! -x $python ]]; then
    echo "build.sh: stack '$stack' needs Python $python_version, expected at $python; installed: $(ls "$pyenv_root/versions" 2>/dev/null | tr '\n' ' '). Fix: pyenv install $python_version, or change the '# python:' line of $constraints" >&2
    exit 1
fi

rm -rf "$venv"
"$python" -m venv "$venv"
# Quiet: pip -q; build-backend deprecation warnings off; and without this machine's notes about the
# configured local package indexes that do not exist ("WARNING: Location 'file://...' is ignored").
pip() {
    PYTHONWARNINGS=ignore "$venv/bin/python" -m pip --disable-pip-version-check "$@" \
        2> >(grep -v "^WARNING: Location 'file:" >&2)
}
pip install -q --upgrade pip

# 2. The stack as a user has it.
pip install -q -r "$constraints"
pip freeze --all >"$venv/stack-freeze.txt"

# 3. keras-dist, installed plainly from the checkout.
cd "$root"
if [[ $stack == nightly ]]; then
    pip install -q --no-deps -e .
    mapfile -t test_packages < <("$venv/bin/python" - <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
# keras-dist's own requirements except keras (keras-nightly provides it), then the [test] extra.
for requirement in project["dependencies"] + project["optional-dependencies"]["test"]:
    if not requirement.replace(" ", "").lower().startswith("keras"):
        print(requirement)
PY
    )
    pip install -q "${test_packages[@]}"
else
    if ! pip install -q -c "$constraints" -e ".[test]"; then
        echo "build.sh: FAILED: pip cannot install keras-dist into stack '$stack' without changing the versions $constraints pins (pip's reason above). Fix: keras-dist's requirements in pyproject.toml must accept them." >&2
        exit 1
    fi
fi
pip freeze --all >"$venv/installed-freeze.txt"

# 4. Nothing of the stack changed.
guarded='^(keras|tensorflow|tf-|tf_|tb-|tb_|tensorboard)'
changed=$(diff <(grep -iE "$guarded" "$venv/stack-freeze.txt" | sort) <(grep -iE "$guarded" "$venv/installed-freeze.txt" | sort) || true)
if [[ -n $changed ]]; then
    echo "build.sh: FAILED: installing keras-dist into stack '$stack' changed its Keras/TensorFlow/TFDS packages (< before, > after):" >&2
    echo "$changed" >&2
    echo "Fix: keras-dist's requirements in pyproject.toml must accept the versions in $constraints." >&2
    exit 1
fi

# The stack imports (TensorFlow's C++ start-up notes go to a file, shown only when the import fails).
if ! summary=$("$venv/bin/python" - 2>"$venv/import-stderr.txt" <<'PY'
import importlib.metadata as md
import os
import platform

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras, tensorflow, tensorflow_datasets  # noqa: E401,F401  The stack imports (e.g. TFDS' protobuf).

def version(*names):
    for name in names:
        try:
            return f"{name} {md.version(name)}"
        except md.PackageNotFoundError:
            pass
    return f"{names[0]} missing"

print(", ".join([
    f"Python {platform.python_version()}",
    version("keras", "keras-nightly"),
    version("tensorflow", "tf-nightly", "tensorflow-cpu", "tensorflow-tpu"),
    version("tensorflow-datasets"),
    version("keras-dist"),
]))
PY
); then
    cat "$venv/import-stderr.txt" >&2
    echo "build.sh: FAILED: stack '$stack' was installed but keras, tensorflow or tensorflow_datasets does not import (above)." >&2
    exit 1
fi
echo "stack $stack: $summary; installing keras-dist changed none of Keras/TensorFlow/TFDS ($venv)"
