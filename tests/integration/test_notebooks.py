"""The Colab notebooks in examples/notebooks: in sync with their tested sources, no outputs, and they run (smoke mode)."""

import os

import pytest

# The [dev] extra's notebook tools; a stack built with only [test] (ci/stacks/) skips this file.
jupytext = pytest.importorskip("jupytext")
nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

NOTEBOOKS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "notebooks"
)
NAMES = sorted(name[:-6] for name in os.listdir(NOTEBOOKS) if name.endswith(".ipynb"))


@pytest.mark.parametrize("name", NAMES)
def test_notebook_matches_its_source_and_has_no_outputs(name):
    notebook = nbformat.read(os.path.join(NOTEBOOKS, name + ".ipynb"), as_version=4)
    source = jupytext.read(os.path.join(NOTEBOOKS, name + ".py"))
    assert [c.source for c in notebook.cells] == [c.source for c in source.cells], (
        f"{name}.ipynb differs from {name}.py: run `jupytext --sync examples/notebooks/{name}.py`"
    )
    assert all(not c.get("outputs") for c in notebook.cells if c.cell_type == "code"), "strip the outputs"
    assert (
        "colab-badge.svg" in notebook.cells[0].source
        and "colab.research.google.com/github/" in notebook.cells[0].source
    )


def _run(name, tmp_path, timeout):
    notebook = nbformat.read(os.path.join(NOTEBOOKS, name + ".ipynb"), as_version=4)
    os.environ["KERAS_DIST_SMOKE"] = "1"  # The kernel inherits this process's environment.
    try:
        NotebookClient(
            notebook, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
        ).execute()
    finally:
        os.environ.pop("KERAS_DIST_SMOKE", None)
    return "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name, expected",
    [
        ("mnist_tfds", ["test accuracy:", "global batch size:   128 examples"]),
        ("cifar10_mixed_precision", ["LossScaleOptimizer", "examples_per_second:", "test accuracy:"]),
        ("tpu", ["MirroredStrategy 2 replicas", "final training accuracy:"]),  # No TPU in CI: CPU replicas.
        (
            "text_bucketing",
            [
                "   naive: traces per epoch [2, 0]",
                "bucketed: traces per epoch [2, 0]",
                "of the batched tokens are padding",
                "a plain tf.function traced",
                "test accuracy:",
            ],
        ),
    ],
)
def test_notebook_runs(tmp_path, name, expected):
    output = _run(name, tmp_path, timeout=240)
    for text in expected:
        assert text in output, output[-3000:]


@pytest.mark.multi_worker
@pytest.mark.timeout(300)
def test_multi_worker_notebook_runs_and_the_curves_coincide(tmp_path):
    output = _run("multi_worker", tmp_path, timeout=240)
    assert "largest difference between the workers' losses: 0.0" in output
