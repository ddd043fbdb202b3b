"""Diagnosis of a departure from the claim: a convention (some muon_ref configuration reproduces every case
that ran, bit for bit) or a bug (none does; named by the case families that depart). Replicas that disagree
(oracle.py: replicated bits that differ across ranks) are a bug whatever the configuration (muon_ref gives every
rank the same answer), named "replicas disagree on" their families; so is optimizer state that a save and load
changed (oracle.py: Outcome.resumed), named "the resume changes the optimizer state on" its families; crashes and
hangs are named by their families too. A conforming adapter's answer to gradients missing on some ranks only (asym_none) is named with it.

Search, in order (the first configuration that matches every completed case wins):
    1. the claimed preset with one convention option changed (CONVENTION_OPTIONS), the claim's other
       overrides kept;
    2. every other preset, with the claim's lr, weight_decay, momentum and nesterov;
    3. every other preset with one option changed.
A configuration is tried on the departing cases first (most fail at their first step), then on the cases
that were bitwise (a convention must keep those too).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch

from muon_ref.presets import PRESETS, preset_defaults

from .oracle import Outcome, matches, resolved_hyperparameters

# One option (or a pair that only makes sense together) per entry; values found in the field
# (docs/conventions.md; muon_ref/config.py documents each).
CONVENTION_OPTIONS: list[dict[str, Any]] = [
    {"momentum_style": "ema", "nesterov_form": "lerp"},
    {"momentum_style": "sum", "nesterov_form": "add_alpha"},
    {"momentum_style": "sum", "nesterov_form": "mul_add"},
    {"nesterov": True},
    {"nesterov": False},
    {"weight_decay_form": "mul"},
    {"weight_decay_form": "add_self"},
    *(
        {"lr_scale": s}
        for s in ("original", "match_rms_adamw", "spectral_norm", "spectral", "none")
    ),
    {"scale_sqrt": "sqrt"},
    {"scale_sqrt": "pow"},
    *({"scale_apply": s} for s in ("alpha", "update", "update_lr", "update_lr_cast")),
    {"update_dtype": None},
    {"update_dtype": torch.float32},
    *({"schedule": s} for s in ("keller", "you5", "polar_express", "polar_express_modded")),
    *({"step_form": s} for s in ("addmm", "keller", "dion")),
    {"eps_mode": "add"},
    {"eps_mode": "clamp"},
    *({"eps": e} for e in (1e-6, 1e-7, 1e-8)),
    {"normalize_before_cast": True},
    {"normalize_before_cast": False},
    {"ns_dtype": torch.float32},
]


def _valid(preset: str | None, overrides: dict[str, Any]) -> bool:
    try:
        preset_defaults(preset, overrides)
        return True
    except ValueError:
        return False


def _changes(
    preset: str | None, overrides: dict[str, Any]
) -> list[tuple[dict[str, Any], str | None, dict]]:
    """(the change, preset, overrides) for each option that changes this configuration."""
    current = preset_defaults(preset, overrides)
    out = []
    for option in CONVENTION_OPTIONS:
        if all(current.get(k) == v for k, v in option.items()):
            continue
        trial = {**overrides, **option}
        if _valid(preset, trial):
            out.append((option, preset, trial))
    return out


def alternatives(preset: str | None, overrides: dict[str, Any]):
    """Yield (description, preset, overrides) in search order (module docstring)."""
    claimed = f"claimed preset {preset!r}" if preset else "the claimed configuration"
    for option, p, trial in _changes(preset, overrides):
        yield f"matches {claimed} with {_fmt(option)}", p, trial
    hp = resolved_hyperparameters(preset, overrides)
    others = [p for p in PRESETS if p != preset]
    for other in others:
        yield f"matches preset {other!r}", other, dict(hp)
    for other in others:
        for option, p, trial in _changes(other, dict(hp)):
            yield f"matches preset {other!r} with {_fmt(option)}", p, trial


def _fmt(option: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={str(v).replace('torch.', '') if isinstance(v, torch.dtype) else repr(v)}"
        for k, v in option.items()
    )


def find_convention(
    outcomes: list[Outcome],
    preset: str | None,
    overrides: dict[str, Any],
    match: Callable[[Outcome, str | None, dict[str, Any]], bool] = matches,
) -> str | None:
    """The first configuration of the search that reproduces every completed case; None if none does."""
    found = search(outcomes, preset, overrides, match)
    return found[0] if found else None


def search(
    outcomes: list[Outcome],
    preset: str | None,
    overrides: dict[str, Any],
    match: Callable[[Outcome, str | None, dict[str, Any]], bool] = matches,
) -> tuple[str, str | None, dict[str, Any]] | None:
    """(description, preset, overrides) of the first configuration that reproduces every completed case."""
    departing = [o for o in outcomes if o.status == "differs"]
    kept = [o for o in outcomes if o.status == "bitwise"]
    if not departing:
        return None
    for description, p, trial in alternatives(preset, overrides):
        if all(match(o, p, trial) for o in departing) and all(match(o, p, trial) for o in kept):
            return description, p, trial
    return None


def _memo() -> Callable[[Outcome, str | None, dict[str, Any]], bool]:
    """matches, remembered per (outcome, configuration): the partitions of one diagnosis ask again."""
    seen: dict[tuple, bool] = {}

    def match(o: Outcome, p: str | None, trial: dict[str, Any]) -> bool:
        key = (id(o), p, repr(sorted(trial.items())))
        if key not in seen:
            seen[key] = matches(o, p, trial)
        return seen[key]

    return match


# Partitions of the cases, coarsest first: a convention is searched on all cases, then per dtype, then per dtype
# and mode (one device, or the adapter's distributed mode). Not per family or world size: there a configuration
# matches by coincidence (a scale computed from the shard's shape equals lr_scale="none" on a family whose
# shards are square), and a convention is a property of the candidate's arithmetic, not of a parameter set. The
# departures no partition explains are the bug, located by family, world size and dtype (by_family).
PARTITIONS: tuple[tuple[str, ...], ...] = ((), ("dtype",), ("dtype", "mode"))


def _key(o: Outcome, fields: tuple[str, ...]) -> tuple:
    return tuple(getattr(o.case, f) for f in fields)


def _partition_label(fields: tuple[str, ...], key: tuple) -> str:
    return " ".join("1 device" if v == "single" else str(v) for v in key) or "all cases"


def explain(
    outcomes: list[Outcome], preset: str | None, overrides: dict[str, Any]
) -> tuple[list[tuple[str, str]], list[Outcome]]:
    """(the conventions found, each with the partition it explains, coarsest first; the departing cases that no
    convention of any partition explains). A partition is explained when one configuration of the search
    reproduces every completed case in it (the departing and the bitwise ones). A departing case of an unexplained
    partition that a convention found elsewhere reproduces is explained too: the bug is located in the cases no
    found convention reproduces."""
    match = _memo()
    found: list[tuple[str, str]] = []
    configs: list[tuple[str | None, dict[str, Any]]] = []
    open_cases = [o for o in outcomes if o.status == "differs"]
    for fields in PARTITIONS:
        if not open_cases:
            break
        keys = list(dict.fromkeys(_key(o, fields) for o in open_cases))
        for key in keys:
            part = [o for o in outcomes if _key(o, fields) == key]
            convention = search(part, preset, overrides, match)
            if convention:
                found.append((_partition_label(fields, key), convention[0]))
                configs.append(convention[1:])
                open_cases = [o for o in open_cases if _key(o, fields) != key]
    return found, [o for o in open_cases if not any(match(o, p, t) for p, t in configs)]


def by_family(outcomes: list[Outcome], hit: Callable[[Outcome], bool]) -> str:
    """'uneven (2/4: W=2, W=4; bfloat16 only)' for the families with cases that `hit` selects."""
    parts = []
    for family in dict.fromkeys(o.case.family for o in outcomes):
        mine = [o for o in outcomes if o.case.family == family]
        hits = [o for o in mine if hit(o)]
        if not hits:
            continue
        dtypes = sorted({o.case.dtype for o in hits})
        note = (
            f"{dtypes[0]} only"
            if len(dtypes) == 1 and len({o.case.dtype for o in mine}) > 1
            else ""
        )
        where = sorted(
            {("1 device" if o.case.mode == "single" else f"W={o.case.world_size}") for o in hits}
        )
        parts.append(
            f"{family} ({len(hits)}/{len(mine)}: {', '.join(where)}{'; ' + note if note else ''})"
        )
    return ", ".join(parts)


def _status(status: str) -> Callable[[Outcome], bool]:
    return lambda o: o.status == status


# Collectives that gloo refuses where NCCL accepts the call (docs/field-systems.md): a candidate that crashes only
# there has not been shown wrong. Gloo's error names the collective ("ProcessGroupGloo::alltoall: invalid tensor
# size at index 1 (expected (2, 3), got (1, 3))", list-form with tensors of unequal shapes), or, for
# reduce_scatter_tensor, states the shape check NCCL does not make (NCCL compares element counts).
GLOO_REFUSALS = {
    "all_to_all": "list-form, tensors of unequal shapes",
    "all_gather": "list-form, tensors of unequal shapes",
    "reduce_scatter_tensor": "output rows * W != input rows, equal element counts",
}
_GLOO_NAMES = {"alltoall": "all_to_all", "allgather": "all_gather"}


def gloo_refusal(error: str | None) -> str | None:
    """The collective whose call gloo refused (a key of GLOO_REFUSALS) when `error` is that refusal, else None."""
    if not error:
        return None
    named = re.search(r"ProcessGroupGloo::(\w+): invalid tensor size", error)
    if named and named.group(1) in _GLOO_NAMES:
        return _GLOO_NAMES[named.group(1)]
    if "ProcessGroupGloo" in error and "outputShape[0] * worldSize == inputShape[0]" in error:
        return "reduce_scatter_tensor"
    return None


def diagnose(outcomes: list[Outcome], preset: str | None, overrides: dict[str, Any]) -> str:
    """One line: conforms, the conventions that explain the departures (with the partition each explains when
    no single one explains all), or a bug named by the partition it lives in (the families, world sizes and
    dtypes of the departures no convention explains); replicas that disagree, crashes and hangs after; the
    elementwise rounding of the cases that needed a shard-local one."""
    parts = []
    departing = [o for o in outcomes if o.status == "differs"]
    if departing:
        disagree = any(o.replicas or o.resumed for o in departing)
        found, unexplained = ([], departing) if disagree else explain(outcomes, preset, overrides)
        if found and found[0][0] == "all cases":
            parts.append(f"convention: {found[0][1]}")
        elif found:
            parts.append(
                "conventions by partition: " + "; ".join(f"{where}: {c}" for where, c in found)
            )
        if unexplained:
            bitwise = sorted(
                {o.case.family for o in outcomes if o.status == "bitwise"}
                - {o.case.family for o in unexplained}
            )
            kind = "bug" if bitwise or found else "departs everywhere"
            ids = {id(o) for o in unexplained}
            departs = by_family(outcomes, lambda o: id(o) in ids)
            parts.append(
                f"{kind}: no muon_ref convention explains it; departs on {departs}"
                + (f"; bitwise on {', '.join(bitwise)}" if bitwise else "")
            )
        if any(o.replicas for o in departing):
            parts.append(f"replicas disagree on {by_family(outcomes, lambda o: bool(o.replicas))}")
        if any(o.resumed for o in departing):
            parts.append(
                "the resume changes the optimizer state on "
                + by_family(outcomes, lambda o: bool(o.resumed))
            )
    refused = {id(o): gloo_refusal(o.error) for o in outcomes if o.status == "crash"}
    for collective in sorted({c for c in refused.values() if c}):
        parts.append(
            f"could not run on gloo ({collective}: {GLOO_REFUSALS[collective]}) on "
            f"{by_family(outcomes, lambda o: refused.get(id(o)) == collective)}"
        )
    if any(o.status == "crash" and not refused[id(o)] for o in outcomes):
        parts.append(
            f"crashes on {by_family(outcomes, lambda o: o.status == 'crash' and not refused[id(o)])}"
        )
    if any(o.status == "hang" for o in outcomes):
        parts.append(f"hangs on {by_family(outcomes, _status('hang'))}")
    verdict = "; ".join(parts) or "conforms: every case bitwise equal to the claim"
    local = [o for o in outcomes if o.elementwise]
    if local:
        verdict += (
            f" (elementwise stages shard-local, a rounding convention, on "
            f"{by_family(outcomes, lambda o: bool(o.elementwise))})"
        )
    answers = sorted({o.policy for o in outcomes if o.policy})
    return verdict + (
        f" (gradients missing on some ranks only: {', '.join(answers)})" if answers else ""
    )


__all__ = [
    "CONVENTION_OPTIONS",
    "GLOO_REFUSALS",
    "alternatives",
    "by_family",
    "diagnose",
    "explain",
    "find_convention",
    "gloo_refusal",
]
