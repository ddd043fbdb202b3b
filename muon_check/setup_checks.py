"""The setup-level checks from the command line and in the planted suite.

    python -m muon_check --audit MODULE:SETUP [--world-sizes 4] [--micro-batches 2]
    python -m muon_check --invariance MODULE:SETUP [--world-sizes 1 2 4] [--steps 2]

A setup is an audit.Setup subclass (or instance) named by import path, as adapters are. The planted suite
(`--planted`) runs `setup_suite`: the project's own setups and a correct control must draw no finding and be
invariant; each planted setup bug (adapters/planted_setups.py) must draw the finding that names it, and the ones
that change the update across configurations must break the invariance they break.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from .adapters import import_module_as_python_m
from .audit import Setup, audit, print_audit
from .invariance import invariance, print_invariance

if TYPE_CHECKING:
    from .adapters.planted_setups import PlantedSetup


def load_setup(spec: str) -> Setup:
    """MODULE:NAME of a Setup subclass or instance."""
    if spec.count(":") != 1:
        raise ValueError(f"setup {spec!r} must be MODULE:NAME (a muon_check.audit.Setup)")
    module, name = spec.split(":")
    obj = getattr(import_module_as_python_m(module), name)
    setup = obj() if isinstance(obj, type) else obj
    if not isinstance(setup, Setup):
        raise ValueError(
            f"setup {spec!r} is a {type(setup).__name__}, not a muon_check.audit.Setup"
        )
    return setup


def as_setup(setup: Any) -> Setup:
    """A Setup from a subclass, an instance or a 'module:Name' string."""
    if isinstance(setup, str):
        return load_setup(setup)
    if isinstance(setup, type) and issubclass(setup, Setup):
        return setup()
    if isinstance(setup, Setup):
        return setup
    raise ValueError(
        f"setup must be a muon_check.audit.Setup (class, instance or 'module:Name'), got {setup!r}"
    )


def run_audit(
    spec: str, world_sizes: list[int], micro_batches: int, log=print, sharding: str | None = None
) -> int:
    """--audit: one audit per world size (under `sharding`, one of the setup's layouts, where given); exit 0
    without findings, 1 with."""
    setup = load_setup(spec)
    if sharding is not None:
        valid = tuple(setup.shardings) or (setup.sharding,)
        if sharding not in valid:
            raise ValueError(
                f"--sharding {sharding!r} is not a layout of {setup.name}; valid: {', '.join(map(str, valid))}"
            )
        setup.sharding = sharding
    found = 0
    for w in world_sizes:
        rep = audit(setup, w, micro_batches)
        print_audit(rep, log)
        found += len(rep["findings"])
    return 1 if found else 0


def run_invariance(
    spec: str, world_sizes: list[int], micro_batches: int, steps: int, log=print
) -> int:
    """--invariance: exit 0 when every configuration equals its reference, 1 when one differs, 3 when one could
    not run (and none differs)."""
    rep = invariance(load_setup(spec), tuple(world_sizes), micro_batches, steps)
    print_invariance(rep, log)
    return 1 if rep["broken"] else 3 if rep["could_not_run"] else 0


def setup_suite(log: Callable[..., Any] = print) -> dict[str, Any]:
    """Controls (no finding, invariant) and planted setup bugs (the named finding; the named invariance)."""
    from .adapters import setups
    from .adapters.planted_setups import CONTROL_SETUPS, PLANTED_SETUPS

    started = time.monotonic()
    own = {
        "DistributedMuonFSDP": (setups.DistributedMuonFSDP, 4, 2),
        "DistributedMuonHSDP": (setups.DistributedMuonHSDP, 4, 1),
        "MuonWithAdamWSingle": (setups.MuonWithAdamWSingle, 1, 1),
        "MuonWithAdamWDDP": (setups.MuonWithAdamWDDP, 2, 2),
        **CONTROL_SETUPS,
    }
    controls = _audited_controls(own, log) + _invariant_controls(own, log)
    planted = [_planted_row(name, plant, log) for name, plant in PLANTED_SETUPS.items()]
    return {
        "controls": controls,
        "false_positives": sum(not c["right"] for c in controls),
        "planted": planted,
        "caught": sum(p["caught"] for p in planted),
        "right": sum(p["caught"] and p["right"] for p in planted),
        "total": len(planted),
        "wall_s": round(time.monotonic() - started, 1),
    }


def _audited_controls(
    own: dict[str, tuple[type[Setup], int, int]], log: Callable[..., Any]
) -> list[dict[str, Any]]:
    """One audit per control setup (class, world size, micro-batches), each right when it draws no finding;
    logs a line per control and one per finding."""
    controls: list[dict[str, Any]] = []
    for name, (cls, w, k) in own.items():
        rep = audit(cls(), w, k)
        ok = not rep["findings"]
        controls.append(
            {"control": name, "check": "audit", "right": ok, "findings": rep["findings"]}
        )
        log(
            f"setup control {name:<22} audit W={w} k={k}: {'no finding' if ok else 'FALSE POSITIVE'}"
        )
        for f in rep["findings"]:
            log(f"     [{f['kind']}] {f['param']}: {f['text']}")
    return controls


def _invariant_controls(
    own: dict[str, tuple[type[Setup], int, int]], log: Callable[..., Any]
) -> list[dict[str, Any]]:
    """The invariance check (W = 1, 2, 4) of two control setups, each right when nothing is broken; logs a line
    per control."""
    controls: list[dict[str, Any]] = []
    for name in ("DistributedMuonFSDP", "ReducingMuon"):
        cls = own[name][0]
        inv = invariance(cls(), (1, 2, 4), 2, 2)
        ok = not inv["broken"]
        controls.append(
            {"control": name, "check": "invariance", "right": ok, "verdict": inv["verdict"]}
        )
        log(
            f"setup control {name:<22} invariance: {inv['verdict']}{'' if ok else ' (FALSE POSITIVE)'}"
        )
    return controls


def _planted_row(name: str, plant: PlantedSetup, log: Callable[..., Any]) -> dict[str, Any]:
    """A planted setup bug's audit (and invariance, where it breaks one): the finding kinds drawn, right when
    they include the expected one (and the expected invariance is broken); logs one line."""
    rep = audit(plant.setup(), plant.world_size, plant.micro_batches)
    kinds = sorted({f["kind"] for f in rep["findings"]})
    row = {
        "planted": name,
        "field_bug": plant.field_bug,
        "source": plant.source,
        "expected": plant.finding,
        "found": kinds,
        "caught": bool(kinds),
        "right": plant.finding in kinds,
    }
    if plant.breaks:
        inv = invariance(plant.setup(), (1, 2, 4), 2, 2)
        row["invariance"] = inv["verdict"]
        row["right"] = row["right"] and plant.breaks in inv["broken"]
    wrong = f" (WRONG: expected {plant.finding}" + (
        f" and {plant.breaks} broken)" if plant.breaks else ")"
    )
    log(
        f"#{plant.field_bug:<3} {plant.source:<34} setup {name:<20} audit W={plant.world_size} "
        f"k={plant.micro_batches}: {', '.join(kinds) or 'nothing'}"
        + (f"; invariance: {row['invariance']}" if "invariance" in row else "")
        + ("" if row["right"] else wrong)
    )
    return row
