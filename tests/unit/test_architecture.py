"""Import contracts, checked in the test run: the layers of STYLE.md section 1, read from pyproject.toml.

`lint-imports` (import-linter, run by `.ci/run`) checks the same `[tool.importlinter]` contracts;
this test parses every module of `keras_dist/` with `ast` (imports inside functions included),
so the tier-1 run fails on an upward import even where import-linter is not installed. It
also checks what import-linter cannot express: only `keras_dist._runtime` and
`keras_dist._compat` import TensorFlow's and Keras' private modules.
"""

import ast
import pathlib

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "keras_dist"
PRIVATE_MODULES = ("tensorflow.python", "keras.src")
MAY_IMPORT_PRIVATE = ("_runtime", "_compat")


def _contracts():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {contract["id"]: contract for contract in config["contracts"]}


def _read_sources(root=ROOT):
    """Returns `{module name: source text}` for every module of the package."""
    sources = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        sources[name] = path.read_text()
    return sources


def _is_package(name, sources):
    return any(other.startswith(name + ".") for other in sources) or name == PACKAGE


def _imports(name, source, sources):
    """Yields `(imported module, line)` for each import in `source`: package modules resolved, others as written."""
    package = name if _is_package(name, sources) else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for alias in node.names:
                candidate = f"{module}.{alias.name}"
                yield (candidate if candidate in sources else module), node.lineno
                if _child(module) == "":
                    yield candidate, node.lineno  # `from tensorflow import python` imports tensorflow.python


def _child(module):
    """`keras_dist.strategy._resolve` -> `strategy`; `keras_dist` itself -> None; not ours -> ""."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return ""
    return parts[1] if len(parts) > 1 else None


def _layer_index(layers):
    """Maps each child name to `(layer position, highest first)`; raises on "|" (independent) layers."""
    index = {}
    for position, layer in enumerate(layers):
        assert "|" not in layer, "independent layers are not checked here; use ':' siblings or extend this test"
        for child in layer.split(":"):
            index[child.strip()] = position
    return index


def layer_violations(sources, layers):
    """Returns one line per import from a lower layer to a higher one (or to the package root)."""
    index = _layer_index(layers)
    found = []
    for name, source in sources.items():
        importer = _child(name)
        if importer is None:
            continue  # keras_dist/__init__.py: the public surface re-exports from every layer.
        for imported, line in _imports(name, source, sources):
            target = _child(imported)
            if target == "" or target == importer:
                continue
            if target is None:
                found.append(f"{name} (l.{line}) imports the package root {PACKAGE} (above every layer)")
            elif index[target] < index[importer]:
                found.append(f"{name} (l.{line}) imports {imported}: layer {importer!r} is below {target!r}")
    return list(dict.fromkeys(found))  # one line per import statement, in file order


def unlisted_children(sources, layers):
    index = _layer_index(layers)
    return sorted({_child(name) for name in sources if _child(name) and _child(name) not in index})


def forbidden_imports(sources, source_modules, forbidden):
    """Returns one line per chain from a module of `source_modules` to a `forbidden` package (through ours)."""
    found = []
    for start in source_modules:
        chain = {start: [start]}
        queue = [start]
        while queue:
            module = queue.pop(0)
            for imported, line in _imports(module, sources[module], sources):
                if imported.split(".")[0] in forbidden:
                    found.append(" -> ".join(chain[module]) + f" -> {imported} (l.{line})")
                elif imported in sources and imported not in chain:
                    chain[imported] = chain[module] + [imported]
                    queue.append(imported)
    return found


def private_imports(sources):
    found = []
    for name, source in sources.items():
        if _child(name) in MAY_IMPORT_PRIVATE:
            continue
        for imported, line in _imports(name, source, sources):
            if any(imported == p or imported.startswith(p + ".") for p in PRIVATE_MODULES):
                found.append(f"{name} (l.{line}) imports {imported}")
    return sorted(set(found))


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    layers = _contracts()["layers"]["layers"]
    assert layer_violations(_read_sources(), layers) == []


def test_every_module_is_in_a_layer():
    layers = _contracts()["layers"]["layers"]
    assert unlisted_children(_read_sources(), layers) == [], "add the new module to a layer in pyproject.toml"


def test_the_launcher_runs_without_tensorflow():
    contract = _contracts()["launcher-without-tensorflow"]
    found = forbidden_imports(_read_sources(), contract["source_modules"], contract["forbidden_modules"])
    assert found == []


def test_only_the_runtime_and_compat_import_private_modules():
    assert private_imports(_read_sources()) == []


def test_the_checks_fail_on_planted_imports():
    """The contracts can fail: an upward import, a TF import in the launcher, a private module, a new module."""
    contracts = _contracts()
    layers = contracts["layers"]["layers"]
    sources = _read_sources()
    planted = dict(sources)
    planted["keras_dist._runtime.threads"] += "\nfrom keras_dist.cli import _threads\n"
    planted["keras_dist.strategy._plan"] += "\nfrom keras_dist import DistributedModel\n"
    planted["keras_dist._env"] += "\nimport tensorflow.python.eager\n"
    planted["keras_dist.data._creator"] += "\ndef f():\n    from keras.src import backend\n"
    planted["keras_dist.newthing"] = ""
    found = layer_violations(planted, layers)
    assert len(found) == 2, found
    assert "keras_dist._runtime.threads" in found[0] and "layer '_runtime' is below 'cli'" in found[0]
    assert "keras_dist.strategy._plan" in found[1] and "the package root keras_dist" in found[1]
    assert unlisted_children(planted, layers) == ["newthing"]
    launcher = forbidden_imports(planted, contracts["launcher-without-tensorflow"]["source_modules"], ["tensorflow"])
    assert any(
        chain.startswith("keras_dist.cli.launch -> ") and "keras_dist._env -> tensorflow" in chain for chain in launcher
    )
    assert {line.split(" (")[0] for line in private_imports(planted)} == {"keras_dist._env", "keras_dist.data._creator"}


def test_nothing_points_outside_the_repository():
    """Comments and docs describe their cases in place: no path into the team's folder outside the repository."""
    outside = "shared" + "/cases"  # split, so this file does not match itself
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("keras_dist", "tests", "docs", "examples", "benchmarks")
        for path in sorted((ROOT / folder).rglob("*"))
        if path.suffix in (".py", ".md", ".toml", ".txt")
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if outside in line
    ] + [f"README.md:{n}" for n, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1) if outside in line]
    assert found == [], "describe the case itself (what program, what it showed) instead"
