"""The check as a Python API, for a project's own test suite.

    from muon_check.api import check

    report = check(MyMuon, claim="keller", families=("tall", "square"), world_sizes=(1,))
    report.assert_conforms()          # AssertionError with the verdict, the diagnosis and the failing cases
    report.verdict, report.cases, report.json()

`candidate`: an optimizer class (checked by import path, its constructor keywords mapped by signature, as
`--adapter module:Class` does), an Adapter subclass or instance (muon_check.adapters), or an adapter spec
string ("module:Name", "checkout_dir:module:Class"). `claim`: a muon_ref preset name, a dict {"preset": name,
**muon_ref options}, or None (the adapter's own claim). The other arguments are the command line's
(`python -m muon_check --help`). The verdict and every case are the command line's, bit for bit:
the same `conformance.check` runs them.

A training setup (audit.Setup) is checked with `audit_setup` (the routing audit) and `setup_invariance` (the
invariance families); their reports have the same `assert_...` methods. pytest users get all three as the
`muon_check` fixture (muon_check.pytest_plugin, named in a conftest's `pytest_plugins`).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from .adapters import Adapter, ImportPath, load_adapter
from .adapters.cases import (
    DIST_FAMILIES,
    FUSED_DIST_FAMILIES,
    REPLICATED_FAMILIES,
    SINGLE_FAMILIES,
    UNREDUCED_FAMILIES,
)

FAMILIES = frozenset(
    SINGLE_FAMILIES | DIST_FAMILIES | FUSED_DIST_FAMILIES | REPLICATED_FAMILIES | UNREDUCED_FAMILIES
)
DEVICES = ("cpu", "cuda")


@dataclass
class Report:
    """A conformance report: `verdict` (the command line's words), `conforms`, `diagnosis`, `cases` (one dict
    per case: family, world size, dtype, status, ...) and `raw` (the whole --json report of the adapter)."""

    verdict: str
    conforms: bool
    diagnosis: str
    cases: list[dict[str, Any]]
    raw: dict[str, Any] = field(repr=False)

    def json(self) -> str:
        return json.dumps(self.raw, indent=1, default=str)

    def summary(self) -> str:
        bitwise = sum(c.get("status") == "bitwise" for c in self.cases)
        lines = [
            f"{self.raw.get('claim', self.raw.get('adapter'))}: {self.verdict} "
            f"({bitwise}/{len(self.cases)} cases bitwise)",
            f"diagnosis: {self.diagnosis}",
        ]
        for c in self.cases:
            if c.get("status") not in ("bitwise", "close"):
                what = c.get("error") or (
                    f"max |dP| {c['max_diff']:.3g} from step {c.get('first_step')}, stage {c.get('stage')}"
                    if c.get("max_diff") is not None
                    else ""
                )
                lines.append(
                    f"  {c.get('family')} W={c.get('world_size')} {c.get('dtype')}: {c.get('status')}"
                    + (f" ({str(what).splitlines()[0][:160]})" if what else "")
                )
        return "\n".join(lines)

    def assert_conforms(self) -> None:
        if not self.conforms:
            raise AssertionError(self.summary())


def _adapter(candidate: Any, claim: Any, distributed: str | None) -> Adapter:
    if isinstance(candidate, str):
        adapter = load_adapter(candidate, distributed=distributed)
    elif isinstance(candidate, type) and issubclass(candidate, Adapter):
        adapter = candidate()
    elif isinstance(candidate, Adapter):
        adapter = copy.copy(candidate)
    elif isinstance(candidate, type) and issubclass(candidate, torch.optim.Optimizer):
        adapter = ImportPath(
            f"{candidate.__module__}:{candidate.__qualname__}", distributed=distributed
        )
    else:
        raise ValueError(
            f"candidate must be an optimizer class, an Adapter (class or instance) or a 'module:Name' string, "
            f"got {candidate!r}"
        )
    if claim is None:
        return adapter
    from muon_ref import PRESETS

    if isinstance(claim, str):
        preset, overrides = claim, {}
    elif isinstance(claim, dict) and "preset" in claim:
        preset, overrides = claim["preset"], {k: v for k, v in claim.items() if k != "preset"}
    else:
        raise ValueError(
            f"claim must be a preset name or a dict with a 'preset' key, got {claim!r}; "
            f"presets: {', '.join(sorted(PRESETS))}"
        )
    if preset not in PRESETS:
        raise ValueError(f"claim preset {preset!r} is unknown; valid: {', '.join(sorted(PRESETS))}")
    adapter.preset, adapter.overrides = preset, dict(overrides)
    return adapter


def check(
    candidate: Any,
    claim: Any = None,
    *,
    families: tuple[str, ...] | None = None,
    world_sizes: tuple[int, ...] = (1, 2),
    dtypes: tuple[str, ...] | None = None,
    steps: int = 3,
    timeout: float = 120.0,
    device: str = "cpu",
    seed: int = 0,
    distributed: str | None = None,
    shrink_budget: float = 0.0,
) -> Report:
    """The conformance check of one candidate (module docstring); ValueError on bad arguments."""
    from . import conformance

    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if not world_sizes or any(not isinstance(w, int) or w < 1 for w in world_sizes):
        raise ValueError(f"world_sizes must be positive ints, got {world_sizes!r}")
    unknown = sorted(set(families or ()) - FAMILIES)
    if unknown:
        raise ValueError(f"families {unknown} are unknown; valid: {', '.join(sorted(FAMILIES))}")
    bad = sorted(set(dtypes or ()) - {"float32", "bfloat16"})
    if bad:
        raise ValueError(f"dtypes {bad} are unknown; valid: float32, bfloat16")
    if distributed not in (None, "dtensor", "replicated", "unreduced"):
        raise ValueError(
            f"distributed must be None, 'dtensor', 'replicated' or 'unreduced', got {distributed!r}"
        )
    adapter = _adapter(candidate, claim, distributed)
    if families and not set(families) & set(adapter.families):
        raise ValueError(
            f"families {list(families)} select no case of {adapter.name}; valid: "
            f"{', '.join(sorted(adapter.families))}"
        )
    raw = conformance.check(
        adapter,
        tuple(world_sizes),
        steps,
        timeout,
        shrink_budget,
        tuple(families) if families else None,
        tuple(dtypes) if dtypes else None,
        log=lambda *_: None,
        device=device,
        seed=seed,
    )
    return Report(raw["verdict"], bool(raw["conforms"]), raw["diagnosis"], raw["outcomes"], raw)


@dataclass
class SetupReport:
    """An audit or invariance report (`raw`: its dict) with its own assertion."""

    kind: str
    raw: dict[str, Any]

    def json(self) -> str:
        return json.dumps(self.raw, indent=1, default=str)

    def summary(self) -> str:
        import io
        from contextlib import redirect_stdout

        from .audit import print_audit
        from .invariance import print_invariance

        out = io.StringIO()
        with redirect_stdout(out):
            (print_audit if self.kind == "audit" else print_invariance)(self.raw)
        return out.getvalue()

    @property
    def clean(self) -> bool:
        if self.kind == "audit":
            return not self.raw["findings"]
        return not self.raw["broken"] and not self.raw.get("could_not_run")

    def assert_clean(self) -> None:
        """No finding (audit), or every configuration run and equal to its reference (invariance)."""
        if not self.clean:
            raise AssertionError(self.summary())


def audit_setup(setup: Any, world_size: int = 4, micro_batches: int = 1) -> SetupReport:
    """The routing audit of a setup (an audit.Setup subclass, instance or 'module:Name')."""
    from .audit import audit
    from .setup_checks import as_setup

    return SetupReport("audit", audit(as_setup(setup), world_size, micro_batches))


def setup_invariance(
    setup: Any, world_sizes: tuple[int, ...] = (1, 2, 4), micro_batches: int = 2, steps: int = 2
) -> SetupReport:
    """The invariance families of a setup."""
    from .invariance import invariance
    from .setup_checks import as_setup

    return SetupReport("invariance", invariance(as_setup(setup), world_sizes, micro_batches, steps))
