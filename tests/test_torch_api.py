"""The code runs on every supported torch (2.9 and newer): it calls no torch name that torch 2.9 lacks.

tests/data/torch_2_9_api.json lists the names of the torch modules we reach into, as torch 2.9.1 has them
(made by tests/data/torch_api.py under torch 2.9.1). Every name our code takes from those modules, through an
import alias (`dist.all_to_all_single`, `self.dist.x` where `dist` is such an alias, `torch.distributed.x`) or a
`from torch... import name`, must be in that list. Names that the installed torch has and 2.9 lacks are the
ones this can catch (torch 2.13 added all_gather_single and reduce_scatter_single: GPU nodes on torch 2.11 crashed
on them, docs/gpu.md).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
API = json.loads((ROOT / "tests" / "data" / "torch_2_9_api.json").read_text())
NAMES: dict[str, set[str]] = {module: set(names) for module, names in API["names"].items()}
SCANNED = ("muon_ref", "muon_dist", "muon_check", "benchmarks", "proofs", "tests")


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> torch module it is bound to (`import torch.distributed as dist`, `from torch import nn`)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    out[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.module in NAMES:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in NAMES:
                    out[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return out


def _chain(node: ast.Attribute) -> list[str]:
    """`a.b.c` -> ["a", "b", "c"]; the part before the first name that is not an attribute or a Name is dropped."""
    parts: list[str] = [node.attr]
    value = node.value
    while isinstance(value, ast.Attribute):
        parts.append(value.attr)
        value = value.value
    if isinstance(value, ast.Name):
        parts.append(value.id)
    return parts[::-1]


def unknown_names(source: str) -> set[str]:
    """Every `module.name` the source takes from a tracked torch module and torch 2.9 does not have."""
    tree = ast.parse(source)
    aliases, missing = _aliases(tree), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in NAMES:
            missing |= {
                f"{node.module}.{a.name}" for a in node.names if a.name not in NAMES[node.module]
            }
        elif isinstance(node, ast.Attribute):  # every prefix of a chain too: each is checked alike
            parts = _chain(node)
            # start at the last part that is an alias (`self.dist.x` starts at `dist`)
            starts = [i for i, part in enumerate(parts[:-1]) if part in aliases]
            if not starts:
                continue
            module, rest = aliases[parts[starts[-1]]], parts[starts[-1] + 1 :]
            while (
                rest and f"{module}.{rest[0]}" in NAMES
            ):  # torch.distributed.tensor.x: descend the modules
                module, rest = f"{module}.{rest[0]}", rest[1:]
            if (
                rest and rest[0] not in NAMES[module] and not rest[0].startswith("__")
            ):  # dunders: every module
                missing.add(f"{module}.{rest[0]}")
    return missing


def python_files() -> list[Path]:
    return sorted(p for top in SCANNED for p in (ROOT / top).rglob("*.py"))


def test_the_name_list_is_torch_2_9s() -> None:
    assert API["torch"].startswith("2.9.")
    distributed = NAMES["torch.distributed"]
    assert {
        "all_to_all_single",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "new_group",
    } <= distributed
    assert not {"all_gather_single", "reduce_scatter_single"} & distributed  # torch 2.13 names


@pytest.mark.parametrize("path", python_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_code_uses_only_torch_names_that_exist_in_torch_2_9(path: Path) -> None:
    assert unknown_names(path.read_text()) == set(), (
        f"{path.relative_to(ROOT)} calls names newer than torch 2.9"
    )


NEWER_ONLY = [  # negative controls: each line uses a name torch 2.9 lacks (2.13 has each)
    "import torch.distributed as dist\ndist.all_gather_single(out, x)",
    "import torch.distributed as dist\nclass C:\n    def f(self, x):\n        self.dist.reduce_scatter_single(x, x)",
    "import torch\ntorch.distributed.all_gather_single(out, x)",
    "from torch.distributed.tensor import _StridedShard",  # 2.9 has it in torch.distributed.tensor.placement_types
    "from torch.distributed import tensor\ntensor._StridedShard(0, split_factor=2)",
]


@pytest.mark.parametrize("source", NEWER_ONLY)
def test_a_name_newer_than_torch_2_9_is_caught(source: str) -> None:
    assert unknown_names(source)


def test_names_torch_2_9_has_pass() -> None:
    source = (
        "import torch\nimport torch.distributed as dist\n"
        "from torch.distributed.tensor.placement_types import _StridedShard\n"
        "dist.all_gather_into_tensor(out, x)\ntorch.distributed.tensor.DTensor.from_local\n[1].index(1)"
    )
    assert unknown_names(source) == set()
