"""The notebooks under notebooks/: each runs end to end, each .ipynb matches its py:percent source (the
readable diff) and is stored without outputs, and they use only muon_ref's public API.

Execution runs the stored .ipynb in a fresh kernel (nbclient, as nbmake does), from notebooks/, with
MPLBACKEND=Agg; any failing cell, including the notebooks' own asserts on pinned facts, fails the test.
jupytext, nbformat and nbclient are the `notebooks` extra: they are imported by the tests that use them, never
at collection, so `pytest -m gpu` collects on a node that has only the core and dev dependencies.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from types import ModuleType

import pytest

import muon_ref

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = ("ns_schedules", "ns_numerics", "design_a_schedule", "gram_newton_schulz")
# Each notebook takes 10-30 s on an idle 2-core CPU (notebooks/README.md); the limits leave room for a
# loaded machine without letting a hung kernel stall the suite.
CELL_TIMEOUT_S = 240
NOTEBOOK_TIMEOUT_S = 480


def notebook_package(name: str) -> ModuleType:
    """An optional package of the `notebooks` extra, or a skip naming the extra (an environment condition)."""
    return pytest.importorskip(
        name, reason=f"{name} is not installed (pip install -e .[notebooks])"
    )


def execute(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run notebooks/<name>.ipynb in a fresh kernel; raises CellExecutionError naming the failing cell."""
    nbformat, nbclient = notebook_package("nbformat"), notebook_package("nbclient")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    nb = nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    client.execute()


@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_each_notebook_runs_end_to_end(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    execute(name, monkeypatch)


def cells(path: Path) -> list[tuple[str, str]]:
    """(cell type, source) of every cell, as jupytext reads the file."""
    return [
        (cell.cell_type, cell.source.strip())
        for cell in notebook_package("jupytext").read(path).cells
    ]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_each_notebook_has_the_same_cells_as_its_py_percent_source(name: str) -> None:
    ipynb, py = cells(NOTEBOOK_DIR / f"{name}.ipynb"), cells(NOTEBOOK_DIR / f"{name}.py")
    assert len(ipynb) == len(py), (
        f"{name}: {len(ipynb)} cells in .ipynb, {len(py)} in .py; run `jupytext --sync`"
    )
    for index, (got, want) in enumerate(zip(ipynb, py)):
        assert got == want, (
            f"{name}: cell {index} differs between .ipynb and .py; run `jupytext --sync`"
        )


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_each_notebook_is_paired_with_py_percent(name: str) -> None:
    nb = notebook_package("nbformat").read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)
    assert nb.metadata["jupytext"]["formats"] == "ipynb,py:percent"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_each_notebook_is_stored_without_outputs(name: str) -> None:
    nb = notebook_package("nbformat").read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{name}: cell {index} has outputs"
            )


def muon_ref_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) for every `from muon_ref... import name` and (module, "") for `import muon_ref...`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "muon_ref":
            found.extend((node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend(
                (alias.name, "") for alias in node.names if alias.name.split(".")[0] == "muon_ref"
            )
    return found


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebooks_import_only_muon_refs_public_api(name: str) -> None:
    path = NOTEBOOK_DIR / f"{name}.py"
    imports = muon_ref_imports(path)
    assert imports, f"{name} does not import muon_ref"
    for module, imported in imports:
        assert not any(part.startswith("_") for part in module.split(".")), (
            f"{name}: private module {module}"
        )
        assert not imported.startswith("_"), f"{name}: private name {module}.{imported}"
        if module == "muon_ref" and imported:
            assert imported in muon_ref.__all__, f"{name}: {imported} is not in muon_ref.__all__"
    assert "muon_ref._" not in path.read_text(), f"{name} reaches into a private muon_ref module"


def test_the_headless_recipe_writes_each_figure_of_a_notebook_as_a_png(tmp_path: Path) -> None:
    # `make notebooks` (notebooks/run_all.py) on a small notebook: two figures in one cell, none in another
    nbformat = notebook_package("nbformat")
    notebook_package("nbclient")
    notebook_package("matplotlib")
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_all", NOTEBOOK_DIR / "run_all.py")
    run_all = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_all)
    new = nbformat.v4.new_code_cell
    cells = [
        new("import matplotlib.pyplot as plt\nplt.plot([0, 1])\nplt.show()"),
        new("print('no figure')"),
        new("plt.plot([1, 0])\nplt.show()\nplt.plot([0, 0])\nplt.show()"),
    ]
    path = tmp_path / "tiny.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    written = run_all.run(path, tmp_path / "figures", timeout=120)
    assert [p.name for p in written] == ["tiny_cell0_0.png", "tiny_cell2_0.png", "tiny_cell2_1.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)
    assert (
        run_all.main(["no_such_notebook"]) == 2
    )  # an unknown name is refused, listing the valid ones
