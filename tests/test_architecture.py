"""The architecture of README.md ("Design: the parts and who may import whom"), enforced on every module.

Each module of muon_ref, muon_dist, muon_check, benchmarks and proofs is read with ast; each of its
imports (absolute, relative, at module level or inside functions) is mapped to the repository part it reaches;
a part not in the importer's row of RULES fails the test. torch.distributed counts as a part of its own, so that
the oracle's "never torch.distributed" is a rule like the others.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = (
    "comm",
    "geometry",
    "layout",
    "batch",
    "runtime",
    "balance",
    "paths",
    "plan",
    "agreement",
    "elementwise",
    "kernels",
    "step",
    "optim",
    "checkpoint",
)
DIST = "torch.distributed"

# importer part -> the parts it may import (a part always may import itself)
RULES: dict[str, set[str]] = {
    "muon_ref": set(),
    "muon_dist.comm": {DIST},
    "muon_dist.geometry": {"muon_ref"},
    "muon_dist.layout": {"muon_ref", "muon_dist.geometry"},
    "muon_dist.batch": {"muon_dist.geometry"},
    "muon_dist.runtime": set(),
    "muon_dist.balance": set(),
    "muon_dist.paths": {
        "muon_dist.batch",
        "muon_dist.comm",
        "muon_dist.geometry",
        "muon_dist.runtime",
    },
    "muon_dist.plan": {
        "muon_ref",
        "muon_dist.balance",
        "muon_dist.batch",
        "muon_dist.geometry",
        "muon_dist.layout",
        "muon_dist.paths",
    },
    "muon_dist.agreement": {
        "muon_ref",
        "muon_dist.batch",
        "muon_dist.comm",
        "muon_dist.geometry",
        "muon_dist.plan",
    },
    "muon_dist.elementwise": {"muon_ref", "muon_dist.geometry"},
    "muon_dist.kernels": {"muon_ref"},
    "muon_dist.step": {
        "muon_ref",
        "muon_dist.agreement",
        "muon_dist.batch",
        "muon_dist.comm",
        "muon_dist.elementwise",
        "muon_dist.geometry",
        "muon_dist.kernels",
        "muon_dist.plan",
        "muon_dist.paths",
        "muon_dist.runtime",
    },
    "muon_dist.optim": {
        "muon_ref",
        "muon_dist.batch",
        "muon_dist.comm",
        "muon_dist.geometry",
        "muon_dist.kernels",
        "muon_dist.layout",
        "muon_dist.plan",
        "muon_dist.step",
        DIST,
    },
    "muon_dist.checkpoint": {"muon_ref", "muon_dist.optim", DIST},
    "muon_dist": {f"muon_dist.{m}" for m in CORE},  # the package's __init__: its public names
    "muon_check": {"muon_ref", "muon_dist", *(f"muon_dist.{m}" for m in CORE), DIST},
    "benchmarks": {
        "muon_ref",
        "muon_dist",
        "muon_check",
        *(f"muon_dist.{m}" for m in CORE),
        DIST,
    },
    "proofs": {"muon_ref", "muon_dist", *(f"muon_dist.{m}" for m in CORE)},
}


def part_of(module: str) -> str | None:
    """The part a dotted module name belongs to (None: outside the rules, e.g. torch or the standard library)."""
    if module == DIST or module.startswith(DIST + "."):
        return DIST
    top, *rest = module.split(".")
    if top in ("muon_ref", "muon_check", "benchmarks", "proofs", "tests"):
        return top
    if top != "muon_dist":
        return None
    if not rest or rest[0] == "__init__":
        return "muon_dist"
    return f"muon_dist.{rest[0]}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool) -> set[str]:
    """Every module the source imports, relative imports resolved against `module`."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found |= {f"{base}.{alias.name}" if not node.module else base for alias in node.names}
    return found


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports of `source` (as module `module`) that its part may not make."""
    importer = part_of(module)
    allowed = RULES[importer] | {importer}
    bad = []
    for target in sorted(imports_of(source, module, is_package)):
        part = part_of(target)
        if part is not None and part not in allowed:
            bad.append(f"{module} imports {target} (part {part})")
    return bad


def python_files() -> list[Path]:
    return sorted(
        p
        for top in ("muon_ref", "muon_dist", "muon_check", "benchmarks", "proofs")
        for p in (ROOT / top).rglob("*.py")
    )


@pytest.mark.parametrize("path", python_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_imports_only_what_its_part_may(path: Path) -> None:
    assert violations(path.read_text(), module_name(path), path.name == "__init__.py") == []


def test_every_part_of_the_repository_has_a_rule() -> None:
    parts = {part_of(module_name(p)) for p in python_files()}
    assert parts <= set(RULES), parts - set(RULES)


FORBIDDEN = [  # negative controls: one forbidden import per rule of the issue
    (
        "import torch.distributed as dist",
        "muon_ref.functional",
    ),  # the oracle imports no distribution
    ("from muon_dist import DistributedMuon", "muon_ref.optim"),  # ... and no muon_dist
    ("from muon_check.fixtures import bits", "muon_dist.plan"),  # the optimizer imports no checker
    ("import muon_check", "muon_dist"),  # ... not even its package __init__
    ("from muon_check import api", "muon_ref.optim"),  # the oracle imports no checker
    ("from tests.conftest import examples", "muon_dist.step"),  # ... no tests
    ("import benchmarks.run", "muon_dist.optim"),  # ... no benchmarks
    ("from .layout import ParamLayout", "muon_dist.comm"),  # comm imports no layout
    ("from .paths import PATHS", "muon_dist.comm"),  # ... and no path
    ("from ..optim import DistributedMuon", "muon_dist.paths.agrs"),  # paths import no optimizer
    ("from .. import step", "muon_dist.paths.agrs"),  # ... nor the step
    ("from .step import ParamInput", "muon_dist.agreement"),  # the protocol knows no step
    ("from .paths import PATHS", "muon_dist.runtime"),  # the runtime knows no path
    ("from .agreement import guarded", "muon_dist.elementwise"),  # box work knows no protocol
]


@pytest.mark.parametrize("source, module", FORBIDDEN, ids=[m for _, m in FORBIDDEN])
def test_a_forbidden_import_is_caught(source: str, module: str) -> None:
    assert violations(source, module), (source, module)


def test_allowed_imports_pass() -> None:
    assert (
        violations(
            "from ..comm import Comm\nfrom .shards import cut\nimport torch", "muon_dist.paths.agrs"
        )
        == []
    )
    assert violations("from muon_ref import newton_schulz", "muon_dist.kernels.triton_ns") == []
