"""The suite collects with only the core and dev dependencies: no test module imports an optional package
(the `notebooks` and `triton` extras, or the public Muons that the conformance check runs) at collection time.

GPU nodes run `pytest -m gpu` with the torch their CUDA stack pins and seldom install our extras; a module-level
`import jupytext` stopped that run at collection (docs/gpu.md). Each check collects in a fresh
interpreter in which importing any optional package raises ModuleNotFoundError, as on such a node.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = (
    "jupytext",
    "nbformat",
    "nbclient",
    "ipykernel",
    "matplotlib",
    "nbmake",
    "triton",
    "muon",
    "muon_fsdp2",
    "muonium",
    "llamafactory",
    "veomni",
    "deepspeed",
    "megatron",
    "emerging_optimizers",
    "xtuner",
)
BLOCKER = f"""import sys
class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {set(OPTIONAL)!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
sys.meta_path.insert(0, _Absent())
"""


def collect(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`pytest --collect-only ARGS` in a fresh interpreter without the optional packages."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "--collect-only",
        "-q",
        "-p",
        "no:nbmake",
        "-p",
        "no:cacheprovider",
        *args,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("selection", [(), ("-m", "gpu")], ids=["make test", "pytest -m gpu"])
def test_the_suite_collects_without_any_optional_package(
    tmp_path: Path, selection: tuple[str, ...]
) -> None:
    proc = collect(tmp_path, *selection)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "error" not in proc.stdout.lower().splitlines()[-1]


@pytest.mark.timeout(300)
def test_a_test_module_that_imports_an_optional_package_at_collection_is_caught(
    tmp_path: Path,
) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_notebook_like.py").write_text(
        "import jupytext\n\n\ndef test_nothing():\n    pass\n"
    )
    proc = collect(tmp_path, str(suite))
    assert proc.returncode != 0 and "blocked" in proc.stdout + proc.stderr
