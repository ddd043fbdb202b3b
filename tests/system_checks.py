"""What the system tests (tests/test_system_*.py) share: the check's run of a few families of one adapter, and the
skip of a test whose system is not present, naming the variable to set and what it should hold."""

from __future__ import annotations

import pytest

from muon_check import conformance
from muon_check.adapters import Adapter
from muon_check.adapters.systems import checkout_path


def run_families(
    adapter: Adapter,
    families: tuple[str, ...],
    world_sizes: tuple[int, ...],
    steps: int = 2,
    timeout: float = 240.0,
) -> list[dict]:
    """The outcomes of float32 `steps` of `families` through the conformance check (no shrinking, silent)."""
    report = conformance.check(
        adapter,
        world_sizes,
        steps=steps,
        timeout=timeout,
        shrink_budget=0.0,
        families=families,
        dtypes=("float32",),
        log=lambda *_: None,
    )
    return report["outcomes"]


def by_family(outcomes: list[dict]) -> dict[str, dict]:
    """The outcomes keyed by family (one case per family at one world size and dtype)."""
    return {o["family"]: o for o in outcomes}


def require_checkout(env: str, inner: str, holds: str) -> str:
    """The folder $env names; skips, naming the variable and what it should hold, when it is unset or does not
    hold `inner`."""
    try:
        return checkout_path(env, None, inner)
    except ValueError as e:
        pytest.skip(f"{e}: {holds}")
