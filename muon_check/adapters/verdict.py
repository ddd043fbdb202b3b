"""The verdict of a check and what goes with it: the verdict's word and exit status, the failure a shrunk case must
keep, the run-to-run difference of a candidate that differs from itself, what was not compared, and when a run
cannot go on (an import failure, a candidate that cannot be built, one that looks distributed).

    verdict(outcomes)   could not run   no case ran to completion (every one crashed, hung or was refused)
                        not a Muon      diagnose found no param orthogonalised
                        incomplete      momentum the check could not find (unmapped state)
                        departs         a case differs, crashed or hung
                        conforms within tolerance   every compared case bitwise or close (a non-deterministic one)
                        conforms        every compared case bitwise
EXIT maps each to the CLI's exit status; PRECEDENCE orders them for a run of several adapters.
"""

from __future__ import annotations

import math
import re

from ..fixtures import same_bits
from . import Adapter, ImportPath
from .cases import Case
from .momentum import state_paths
from .oracle import Outcome, max_abs_diff

# Verdicts of one adapter and the exit status of a run (the worst of its adapters' in this order of precedence:
# a departure is the finding a user must see first).
EXIT = {
    "conforms": 0,
    "conforms within tolerance": 0,
    "departs": 1,
    "not a Muon": 1,
    "incomplete": 2,
    "refused": 2,
    "could not build": 2,
    "could not run": 3,
}
PRECEDENCE = (
    "departs",
    "not a Muon",
    "refused",
    "could not build",
    "incomplete",
    "could not run",
    "conforms within tolerance",
    "conforms",
)

# Errors of a candidate that uses torch.distributed in ranks without a process group (a non-distributed adapter)
LOOKS_DISTRIBUTED = (
    "Default process group has not been initialized",
    "init_process_group",
    "environment variable RANK",
    "environment variable MASTER_ADDR",
    "DeviceMesh",
)
IMPORT_ERRORS = ("ModuleNotFoundError", "ImportError")


def verdict(outcomes: list[Outcome], adapter: Adapter, not_a_muon: bool = False) -> str:
    """could not run (no case ran to completion: every one crashed, hung or was refused at construction), not a
    Muon (diagnose: no param orthogonalised), incomplete (momentum the check could not find: unmapped state),
    conforms (every compared case bitwise; "within tolerance" where some case was compared at the candidate's
    run-to-run tolerance), or departs. Params sent to another optimizer and cases refused at construction are
    listed apart (the report's not_compared), never a departure."""
    ran = [o for o in outcomes if o.status not in ("crash", "hang", "unsupported")]
    if not ran:
        return "could not run"
    if not_a_muon:
        return "not a Muon"
    if adapter.state_key is not None and any(o.unmapped for o in outcomes):
        return "incomplete"
    if any(o.status in ("differs", "crash", "hang") for o in outcomes):
        return "departs"
    return "conforms within tolerance" if any(o.status == "close" for o in outcomes) else "conforms"


def failure_kind(o: Outcome) -> tuple:
    """The failure a shrunk case must keep: status, the exception type of a crash, the departing stage, the dtype
    and mode, and whether the candidate routes some of its params (a smaller case counts only if it fails the same
    way, for the same cause)."""
    error = o.error.split(":")[1].strip() if o.status == "crash" and o.error else None
    return o.status, error, o.stage, o.case.dtype, o.case.mode, bool(o.routed)


def first_of_each_failure(outcomes: list[Outcome]) -> list[Outcome]:
    """One failing case per failure kind and mode (and family, off a single device), for the shrinker: departures,
    crashes and hangs (not a refusal at construction, a routed case or one within tolerance)."""
    firsts: dict[tuple, Outcome] = {}
    for o in outcomes:
        if o.status in ("differs", "crash", "hang"):
            firsts.setdefault(
                (o.case.mode, failure_kind(o), o.case.family if o.case.mode != "single" else ""), o
            )
    return list(firsts.values())


def self_difference(a: list, b: list) -> float:
    """max |dP| between two runs' results (every segment, rank, step and param; inf where shapes differ)."""
    d = 0.0
    for (_, ra), (_, rb) in zip(a, b):
        for x, y in zip(ra, rb):
            for step_a, step_b in zip(x["params"], y["params"]):
                for p, q in zip(step_a, step_b):
                    if not same_bits(p, q):
                        d = max(d, max_abs_diff(p, q) or math.inf)
    return d


# A candidate that differs from itself is compared at this multiple of its own largest run-to-run difference
TOLERANCE_FACTOR = 2.0


def not_compared(outcomes: list[Outcome], adapter: Adapter) -> list[str]:
    """Every quantity the check did not compare, each once with where: params sent to another optimizer, cases
    refused at construction, momentum not kept or left out, and param-sized state that is not the momentum."""
    out: dict[str, set[str]] = {}
    for o in outcomes:
        where = o.case.family
        for i, why in o.routed.items():
            kind = why.split(":")[0]
            out.setdefault(f"param of shape {o.case.shapes[i]}: routed ({kind})", set()).add(where)
        if o.status == "unsupported":
            out.setdefault(f"every param: refused at construction ({o.error})", set()).add(where)
        for label in o.momentum_sources:
            if label.startswith("not compared: ") and "routed" not in label:
                out.setdefault(f"momentum: {label.removeprefix('not compared: ')}", set()).add(
                    where
                )
        if o.vacuous:
            out.setdefault(f"what the family targets: {o.vacuous}", set()).add(where)
        for path in _other_state(o, adapter):
            out.setdefault(f"state[p]{path} (param-sized, not the momentum)", set()).add(where)
    return [f"{what} [{', '.join(sorted(fams))}]" for what, fams in out.items()]


def _other_state(o: Outcome, adapter: Adapter) -> list[str]:
    """Paths of param-sized state tensors that are not the momentum the check read, over the case's params."""
    if o.results is None or o.view is None:
        return []
    out = set()
    for i in range(len(o.case.shapes)):
        if i in o.routed:
            continue
        kind, path = o.view.sources[i] if i < len(o.view.sources) else ("adapter", None)
        for p in state_paths(o.results, i):
            if kind == "state" and p == path:
                continue
            if kind == "adapter" and p == f"[{adapter.state_key!r}]":
                continue
            out.add(p)
    return sorted(out)


def stop(adapter: Adapter, o: Outcome) -> tuple[str, str] | None:
    """(verdict, diagnosis) when the run cannot go on: the candidate does not import (could not run), its
    constructor refuses a plain matrix (could not build: no case can run; with a hint, never shrunk), or a
    candidate not declared distributed calls torch.distributed (refused, with the fix)."""
    if o.status == "unsupported" and plain_matrices(o.case):
        return "could not build", (
            f"could not build: {adapter.name}'s constructor raised on {o.case.label()}: {o.error}; "
            f"{construction_hint(adapter, o.error or '')}"
        )
    if o.status != "crash" or not o.error:
        return None
    if any(e in o.error for e in IMPORT_ERRORS):
        return "could not run", f"could not run: {o.error}"
    if adapter.distributed is None and any(e in o.error for e in LOOKS_DISTRIBUTED):
        return "refused", (
            f"refused: {adapter.name} looks distributed (it uses torch.distributed: {o.error[:160]}); "
            "rerun with --distributed dtensor, replicated or unreduced"
        )
    return None


def plain_matrices(case: Case) -> bool:
    """Every param of the case is a 2-D matrix with both sides >= 2: a Muon that refuses these refuses everything."""
    return all(len(s) == 2 and min(s) >= 2 for s in case.shapes)


def construction_hint(adapter: Adapter, error: str) -> str:
    """One line: what the constructor seems to need (a quoted name in its error; keywords of its signature
    without a default) and how to give it (--group, --kwargs, or an adapter)."""
    named = re.findall(r"[`'\"]([A-Za-z_]\w*)[`'\"]", error)
    needs = []
    if isinstance(adapter, ImportPath):
        needs = adapter.required_keywords()
    parts = []
    if named:
        parts.append(
            f"it names {', '.join(dict.fromkeys(named))}: a param-group key goes in with "
            f"--group '{{\"{named[0]}\": ...}}', a constructor keyword with --kwargs"
        )
    if needs:
        parts.append(
            f"its constructor has keywords without a default: {', '.join(needs)} (--kwargs)"
        )
    parts.append(
        ("or " if parts else "")
        + 'write an adapter whose build() makes the optimizer as its users do (README, "Check your own Muon")'
    )
    return "hint: " + "; ".join(parts)
