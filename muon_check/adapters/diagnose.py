"""Diagnosis: what a candidate computes where it is not its claim, in the words a maintainer would accept.

Findings, each with its own word (docs/conformance.md, "Diagnosis: the words"):
    not a Muon     every compared param is sent elsewhere or not orthogonalised (routing.py); its singular values
    convention     some muon_ref configuration reproduces every case of a partition bit for bit (the search below)
    bug            the departing stage (stages.py) on a partition where other families of the same dtype conform
                   (the departure depends on the layout, world size, accumulation or scale), or replicas that
                   disagree, or state that a save and load changed
    departs        the departing stage where every family of that dtype departs (the arithmetic itself differs),
                   with the nearest configuration of the search and its distance (cases bitwise, units in the last
                   place)
    rounding       a departure of at most one unit in the last place at the update's application that no muon_ref
                   rounding reproduces (not a bug: the ops' order, dtype or memory layout)
    routing        params the candidate sends to another optimizer, the rule inferred from their shapes, not
                   compared (a claim may state its rule)
    unsupported input   families whose params the candidate refuses at construction (one line, its error)
    non-deterministic   the candidate differs from itself on the same inputs: compared at a stated tolerance
    crashes, hangs, could not run on gloo: as the ranks answered
A convention, a named rounding (oracle.Rounding) and routing are never called a bug.

Search for a configuration, in order (the first that reproduces every completed case of a partition wins):
    1. the claimed preset with one convention option changed (CONVENTION_OPTIONS), the claim's other overrides kept;
    2. every other preset, with the claim's lr, weight_decay, momentum and nesterov;
    3. every other preset with one option changed;
    4. the claimed preset with two options of different keys changed, those of the located stage first;
bounded by a time budget (--search-budget; where it runs out first, the departures' findings end with a note
saying so: Search.stopped). A configuration is tried on the departing cases first (most fail at
their first step), then on the cases that were bitwise (a convention must keep those too). The nearest
configuration is the one of steps 1-3 with the most departing cases bitwise, then the fewest units in the last
place, reported where no configuration is exact.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from muon_ref.presets import PRESETS, preset_defaults

from .oracle import Outcome, may_match, resolved_hyperparameters, trial
from .routing import infer_rule
from .stages import STAGES, locate

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
    {"flatten": True},
    {"flatten": False},
]
# the stage (stages.STAGES) each option acts at: the pairs search tries the located stage's options first
STAGE_OF: dict[str, str] = {
    "momentum_style": "momentum",
    "nesterov": "Nesterov input",
    "nesterov_form": "Nesterov input",
    "eps": "Newton-Schulz input and normalisation",
    "eps_mode": "Newton-Schulz input and normalisation",
    "normalize_before_cast": "Newton-Schulz input and normalisation",
    "ns_dtype": "Newton-Schulz input and normalisation",
    "schedule": "orthogonalised direction",
    "step_form": "orthogonalised direction",
    "flatten": "orthogonalised direction",
    "lr_scale": "shape scale",
    "scale_sqrt": "shape scale",
    "weight_decay_form": "weight decay",
    "scale_apply": "application",
    "update_dtype": "application",
}
SEARCH_BUDGET_S = 60.0  # seconds of configuration search per diagnosis, in all (--search-budget)
# a nearest configuration is named where it reproduces a departing case, or comes within this many ulps
NEAR_ULPS = 16.0


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
    current = {**preset_defaults(preset, overrides), **overrides}
    out = []
    for option in CONVENTION_OPTIONS:
        if all(current.get(k) == v for k, v in option.items()):
            continue
        trial_overrides = {**overrides, **option}
        if _valid(preset, trial_overrides):
            out.append((option, preset, trial_overrides))
    return out


def alternatives(
    preset: str | None, overrides: dict[str, Any], stage: str | None = None, pairs: bool = True
) -> Iterator[tuple[str, str | None, dict[str, Any]]]:
    """Yield (description, preset, overrides) in search order (module docstring)."""
    claimed = f"claimed preset {preset!r}" if preset else "the claimed configuration"
    singles = _changes(preset, overrides)
    for option, p, t in singles:
        yield f"matches {claimed} with {_fmt(option)}", p, t
    hp = resolved_hyperparameters(preset, overrides)
    others = [p for p in PRESETS if p != preset]
    for other in others:
        yield f"matches preset {other!r}", other, dict(hp)
    for other in others:
        for option, p, t in _changes(other, dict(hp)):
            yield f"matches preset {other!r} with {_fmt(option)}", p, t
    if not pairs:
        return
    ranked = sorted(singles, key=lambda c: not any(STAGE_OF.get(k) == stage for k in c[0]))
    for (a, _, _), (b, _, _) in itertools.combinations(ranked, 2):
        if set(a) & set(b):
            continue
        both = {**overrides, **a, **b}
        if _valid(preset, both):
            yield f"matches {claimed} with {_fmt({**a, **b})}", preset, both


def _fmt(option: dict[str, Any]) -> str:
    return ", ".join(
        f"{k}={str(v).replace('torch.', '') if isinstance(v, torch.dtype) else repr(v)}"
        for k, v in option.items()
    )


@dataclass
class Nearest:
    """The configuration nearest a partition's departing cases: how many of them it reproduces, and the largest
    distance of the others in units in the last place."""

    description: str
    bitwise: int
    total: int
    ulps: float

    def describe(self) -> str:
        rest = f", the others within {_ulps(self.ulps)}" if self.bitwise < self.total else ""
        return f"{self.description.removeprefix('matches ')} ({self.bitwise}/{self.total} departing cases bitwise{rest})"


def _ulps(value: float) -> str:
    return (
        "inf units in the last place"
        if math.isinf(value)
        else f"{value:.3g} units in the last place"
    )


class Search:
    """The configuration search of one diagnosis, memoised per (outcome, configuration) and bounded in time:
    `stopped` once the budget ran out before the search had tried every configuration it was asked to (then a
    departure it leaves unexplained may still be a convention it did not reach, and the diagnosis says so)."""

    def __init__(self, budget_s: float = SEARCH_BUDGET_S) -> None:
        self.budget_s = budget_s
        self.deadline = time.monotonic() + budget_s
        self.seen: dict[tuple, Outcome] = {}
        # the keys whose first step already rules a match out (may_match)
        self.ruled_out: set[tuple] = set()
        self.stopped = False

    @staticmethod
    def _key(o: Outcome, p: str | None, t: dict[str, Any]) -> tuple:
        return (id(o), p, repr(sorted(t.items(), key=lambda kv: kv[0])))

    def judged(self, o: Outcome, p: str | None, t: dict[str, Any]) -> Outcome:
        key = self._key(o, p, t)
        if key not in self.seen:
            self.seen[key] = trial(o, p, t)
        return self.seen[key]

    def match(self, o: Outcome, p: str | None, t: dict[str, Any]) -> bool:
        """trial's answer (bitwise or close), ruled out first by its first step where that suffices (may_match)."""
        key = self._key(o, p, t)
        if key not in self.seen:
            if key in self.ruled_out:
                return False
            if not may_match(o, p, t):
                self.ruled_out.add(key)
                return False
        return self.judged(o, p, t).status in ("bitwise", "close")

    def out_of_time(self) -> bool:
        if time.monotonic() > self.deadline:
            self.stopped = True
        return self.stopped

    def stopped_note(self) -> str:
        """What a departure's finding adds where the search stopped at its budget ("" where it did not)."""
        if not self.stopped:
            return ""
        return (
            f"; the configuration search stopped at its {self.budget_s:g} s budget (--search-budget), so a "
            "convention it did not reach is not ruled out"
        )

    def find(
        self,
        outcomes: list[Outcome],
        preset: str | None,
        overrides: dict[str, Any],
        stage: str | None,
    ) -> tuple[str, str | None, dict[str, Any]] | None:
        """The first configuration that reproduces every completed case of `outcomes`."""
        departing = [o for o in outcomes if o.status == "differs"]
        kept = [o for o in outcomes if o.status in ("bitwise", "close")]
        if not departing:
            return None
        for description, p, t in alternatives(preset, overrides, stage):
            if self.out_of_time():
                return None
            if all(self.match(o, p, t) for o in departing) and all(
                self.match(o, p, t) for o in kept
            ):
                return description, p, t
        return None

    def nearest(
        self, departing: list[Outcome], preset: str | None, overrides: dict[str, Any]
    ) -> Nearest | None:
        """The nearest configuration of search steps 1-3 (module docstring), as far as time allows, where it is
        nearer than the claim itself (more departing cases bitwise, or fewer units in the last place)."""
        claim_ulps = max((o.max_ulps or 0.0 for o in departing), default=0.0)
        best: Nearest | None = None
        for description, p, t in alternatives(preset, overrides, pairs=False):
            if self.out_of_time():
                break
            results = [self.judged(o, p, t) for o in departing]
            exact = sum(r.status in ("bitwise", "close") for r in results)
            ulps = max((r.max_ulps or 0.0 for r in results if r.status == "differs"), default=0.0)
            trial_near = Nearest(description, exact, len(departing), ulps)
            if best is None or (exact, -ulps) > (best.bitwise, -best.ulps):
                best = trial_near
        if best is None or (best.bitwise == 0 and best.ulps >= claim_ulps):
            return None
        return best


# Partitions of the cases, coarsest first: a convention is searched on all cases, then per dtype, then per dtype
# and mode (one device, or the adapter's distributed mode). Not per family or world size: there a configuration
# matches by coincidence (a scale computed from the shard's shape equals lr_scale="none" on a family whose
# shards are square), and a convention is a property of the candidate's arithmetic, not of a parameter set. The
# departures no partition explains are located by stage, family, world size and dtype.
PARTITIONS: tuple[tuple[str, ...], ...] = ((), ("dtype",), ("dtype", "mode"))


def _key(o: Outcome, fields: tuple[str, ...]) -> tuple:
    return tuple(getattr(o.case, f) for f in fields)


def _partition_label(fields: tuple[str, ...], key: tuple) -> str:
    return " ".join("1 device" if v == "single" else str(v) for v in key) or "all cases"


def explain(
    outcomes: list[Outcome],
    preset: str | None,
    overrides: dict[str, Any],
    search: Search | None = None,
) -> tuple[list[tuple[str, str]], list[Outcome]]:
    """(the conventions found, each with the partition it explains, coarsest first; the departing cases that no
    convention of any partition explains). A partition is explained when one configuration of the search
    reproduces every completed case in it (the departing and the bitwise ones). A departing case of an unexplained
    partition that a convention found elsewhere reproduces is explained too: the departure is located in the cases
    no found convention reproduces."""
    found, rest, _ = _explain(outcomes, preset, overrides, search or Search())
    return found, rest


def _explain(
    outcomes: list[Outcome], preset: str | None, overrides: dict[str, Any], search: Search
) -> tuple[list[tuple[str, str]], list[Outcome], list[tuple[str | None, dict[str, Any]]]]:
    """explain, and the configurations found (preset, overrides) in the order of the conventions."""
    found: list[tuple[str, str]] = []
    configs: list[tuple[str | None, dict[str, Any]]] = []
    open_cases = [o for o in outcomes if o.status == "differs"]
    for fields in PARTITIONS:
        if not open_cases:
            break
        keys = list(dict.fromkeys(_key(o, fields) for o in open_cases))
        for key in keys:
            part = [o for o in outcomes if _key(o, fields) == key]
            stage = next((o.stage for o in part if o.stage), None)
            convention = search.find(part, preset, overrides, stage)
            if convention:
                found.append((_partition_label(fields, key), convention[0]))
                configs.append(convention[1:])
                open_cases = [o for o in open_cases if _key(o, fields) != key]
    rest = [o for o in open_cases if not any(search.match(o, p, t) for p, t in configs)]
    return found, rest, configs


def find_convention(
    outcomes: list[Outcome],
    preset: str | None,
    overrides: dict[str, Any],
    match: Callable[[Outcome, str | None, dict[str, Any]], bool] | None = None,
) -> str | None:
    """The first configuration of the search that reproduces every completed case; None if none does."""
    found = Search().find(outcomes, preset, overrides, None)
    return found[0] if found else None


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


@dataclass(frozen=True)
class Context:
    """What a diagnosis needs besides the outcomes: the candidate's run-to-run differences per dtype (empty: it
    did not differ from itself) and the tolerance they set, the routing rule the claim states, and the time the
    configuration search may take."""

    self_differences: dict[str, float] | None = None
    tolerance: float | None = None
    stated_routing: str | None = None
    search_budget_s: float = SEARCH_BUDGET_S


@dataclass(frozen=True)
class Finding:
    """kind: one of the module docstring's words; text: the finding, as the diagnosis line carries it."""

    kind: str
    text: str


def _compared(o: Outcome) -> bool:
    return o.status in ("bitwise", "close", "differs")


def findings(
    outcomes: list[Outcome],
    preset: str | None,
    overrides: dict[str, Any],
    context: Context | None = None,
) -> list[Finding]:
    """Every finding of a run, in the order the diagnosis line gives them (module docstring)."""
    context = context or Context()
    out: list[Finding] = []
    if _not_a_muon(outcomes):
        out.append(Finding("not a Muon", _not_a_muon_text(outcomes)))
    departing = [o for o in outcomes if o.status == "differs"]
    disagree = [o for o in departing if o.replicas or o.resumed]
    search = Search(context.search_budget_s)
    if departing and not out:
        out += _departures(outcomes, disagree, preset, overrides, search)
    out += _disagreements(outcomes, departing)
    out += _failures(outcomes)
    out += _routing(outcomes, context.stated_routing)
    out += _unsupported(outcomes)
    out += _non_deterministic(context)
    return out


def _departures(
    outcomes: list[Outcome],
    disagree: list[Outcome],
    preset: str | None,
    overrides: dict[str, Any],
    search: Search,
) -> list[Finding]:
    """The convention that explains the departures (for all cases or by partition), then where each departure
    it leaves unexplained is located; the outcomes whose replicas or resume disagree are left out."""
    out: list[Finding] = []
    found, unexplained, configs = _explain(
        [o for o in outcomes if o not in disagree], preset, overrides, search
    )
    _relocate(unexplained, [(c, *config) for (_, c), config in zip(found, configs)])
    if found and found[0][0] == "all cases":
        out.append(Finding("convention", found[0][1]))
    elif found:
        out.append(
            Finding("convention", "by partition: " + "; ".join(f"{w}: {c}" for w, c in found))
        )
    located = _located(
        outcomes, [o for o in unexplained if o not in disagree], preset, overrides, search
    )
    last = max((i for i, f in enumerate(located) if f.kind in ("bug", "departs")), default=None)
    note = search.stopped_note()
    if last is not None and note:  # said once, after the departures it qualifies
        located[last] = Finding(located[last].kind, located[last].text + note)
    return out + located


def _disagreements(outcomes: list[Outcome], departing: list[Outcome]) -> list[Finding]:
    """A bug where the replicas of a departing case disagree, and one where the resume changes its optimizer
    state, each with the families it happens on."""
    out: list[Finding] = []
    if any(o.replicas for o in departing):
        out.append(
            Finding(
                "bug", f"replicas disagree on {by_family(outcomes, lambda o: bool(o.replicas))}"
            )
        )
    if any(o.resumed for o in departing):
        out.append(
            Finding(
                "bug",
                "the resume changes the optimizer state on "
                + by_family(outcomes, lambda o: bool(o.resumed)),
            )
        )
    return out


def _unsupported(outcomes: list[Outcome]) -> list[Finding]:
    """The cases the candidate refused at construction (with their errors), where there are any."""
    unsupported = [o for o in outcomes if o.status == "unsupported"]
    if not unsupported:
        return []
    errors = sorted({o.error or "" for o in unsupported})
    return [
        Finding(
            "unsupported input",
            f"refused at construction on {by_family(outcomes, _status('unsupported'))} "
            f"({'; '.join(errors)[:300]}): not run",
        )
    ]


def _non_deterministic(context: Context) -> list[Finding]:
    """Where the candidate differs from itself: its run-to-run differences and the tolerance it is compared at."""
    if not context.self_differences:
        return []
    diffs = ", ".join(f"{d:.3g} ({dt})" for dt, d in sorted(context.self_differences.items()))
    return [
        Finding(
            "non-deterministic",
            f"two runs on the same inputs differ by up to {diffs}; compared at tolerance "
            f"{context.tolerance:.3g} (twice its own difference) instead of bits",
        )
    ]


def _relocate(
    unexplained: list[Outcome], configs: list[tuple[str, str | None, dict[str, Any]]]
) -> None:
    """Locate each unexplained departure again under every configuration found for another partition
    (description, preset, overrides), and keep the latest stage: where the candidate's conventions differ from the
    claim everywhere (its momentum form, say), the departure to name is the one after them ("weight decay departs
    in bf16; momentum and direction equal")."""
    for o in unexplained:
        for description, p, t in configs:
            located = locate(o, p, t)
            if located is not None and (
                o.stage is None or STAGES.index(located.stage) > STAGES.index(o.stage)
            ):
                o.stage, o.stage_exact = located.stage, located.exact
                o.stage_detail = f"{located.describe()}; where the candidate {description}"


# Families in which a Muon's direction cannot show a convention: a 1 x n row is orthogonalised to a multiple of
# itself by every schedule, and gradients below Newton-Schulz's eps stay in its linear range. Their conforming says
# nothing about a departure elsewhere (bug or departs).
DEGENERATE = frozenset({"row", "tiny", "row_sharded"})


def _conforming(outcomes: list[Outcome], mine: list[Outcome]) -> set[str]:
    """The families (not degenerate, not among the departing ones) that conform in every dtype the departing
    cases have: a departure that these families do not show depends on the family (a bug)."""
    departing = {o.case.family for o in mine}
    per_dtype = [
        {o.case.family for o in outcomes if o.status in ("bitwise", "close") and o.case.dtype == d}
        for d in {o.case.dtype for o in mine}
    ]
    return set.intersection(*per_dtype) - departing - DEGENERATE if per_dtype else set()


def _located(
    outcomes: list[Outcome],
    unexplained: list[Outcome],
    preset: str | None,
    overrides: dict[str, Any],
    search: Search,
) -> list[Finding]:
    """A finding per departing stage of the cases no convention explains: rounding, bug or departs (module
    docstring), with the partition, the stage's detail and, for a departure, the nearest configuration."""
    out = []
    said = False  # the families that conform are said once, with the first bug
    stages = sorted(
        {o.stage for o in unexplained}, key=lambda s: (s is None, STAGES.index(s) if s else 0)
    )
    for stage in stages:
        mine = [o for o in unexplained if o.stage == stage]
        where = by_family(outcomes, lambda o, ids={id(x) for x in mine}: id(o) in ids)
        detail = mine[0].stage_detail
        if stage == "application" and all(
            (o.stage_detail or "").startswith("a rounding") for o in mine
        ):
            out.append(
                Finding(
                    "rounding",
                    f"the update's application rounds differently on {where} ({detail}); no muon_ref "
                    "rounding reproduces it, and it is not a bug",
                )
            )
            continue
        conforming = _conforming(outcomes, mine)
        if stage is None and all(o.tolerance for o in mine):
            out.append(
                Finding(
                    "departs",
                    f"drifts beyond the stated tolerance on {where}, though no single step departs by more "
                    "than it from the candidate's own state",
                )
            )
            continue
        kind = "bug" if conforming else "departs"
        what = (
            f"{stage} departs on {where}"
            if stage
            else f"no muon_ref configuration explains it; departs on {where}"
        )
        text = what + (f" ({detail})" if detail else "")
        if conforming and not said:
            text += f"; bitwise on {', '.join(sorted(conforming))}"
            said = True
        named = all(o.stage_exact for o in mine)  # a named variant already says what it computes
        near = None if named or kind != "departs" else search.nearest(mine, preset, overrides)
        if near is not None and (near.bitwise or near.ulps <= NEAR_ULPS):
            text += f"; nearest configuration: {near.describe()}"
        out.append(Finding(kind, text))
    return out


# A resume that torch.distributed.checkpoint refuses because the saved optimizer never created a param's state
# (state created lazily, at a param's first step with a gradient; the fresh optimizer's template has it): the
# checkpoint_unstepped family's target (Dion #18), shared by every lazily-initialising torch.optim optimizer.
LAZY_STATE = "Missing key in checkpoint state_dict: optim.state"
# get_optimizer_state_dict creates an empty optimizer's state with a step(closure=...) of zero gradients
NO_CLOSURE = "step() got an unexpected keyword argument 'closure'"
RESUME_FAILURES = (
    (
        LAZY_STATE,
        "(state created lazily: a param that never stepped has no momentum in the checkpoint, and "
        "torch.distributed.checkpoint's load expects one)",
    ),
    (
        NO_CLOSURE,
        "(its step() takes no closure, which torch.distributed.checkpoint's get_optimizer_state_dict passes to "
        "create an empty optimizer's state)",
    ),
)


def _failures(outcomes: list[Outcome]) -> list[Finding]:
    """Crashes (gloo's refusals and resumes of lazily created state apart) and hangs."""
    out = []
    resumes: set[int] = set()  # crashes that are a resume failing, named as such
    for marker, why in RESUME_FAILURES:
        ids = {id(o) for o in outcomes if o.status == "crash" and marker in (o.error or "")}
        if ids:
            out.append(
                Finding("resume fails", f"{why} on {by_family(outcomes, lambda o: id(o) in ids)}")
            )
        resumes |= ids
    refused = {
        id(o): gloo_refusal(o.error)
        for o in outcomes
        if o.status == "crash" and id(o) not in resumes
    }
    for collective in sorted({c for c in refused.values() if c}):
        out.append(
            Finding(
                "could not run on gloo",
                f"({collective}: {GLOO_REFUSALS[collective]}) on "
                f"{by_family(outcomes, lambda o: refused.get(id(o)) == collective)}",
            )
        )
    plain = {id(o) for o in outcomes if id(o) in refused and not refused[id(o)]}
    if plain:
        out.append(Finding("crashes", f"on {by_family(outcomes, lambda o: id(o) in plain)}"))
    if any(o.status == "hang" for o in outcomes):
        out.append(Finding("hangs", f"on {by_family(outcomes, _status('hang'))}"))
    return out


def _not_a_muon(outcomes: list[Outcome]) -> bool:
    """No case conforms, and of the params whose first update could be read (routing.Update), none is
    orthogonalised and some are not: the candidate orthogonalises nothing (sends everything elsewhere, or steps
    like SGD)."""
    if any(o.status in ("bitwise", "close") for o in outcomes):
        return False
    answers = [u.orthogonalised for o in outcomes for u in o.updates.values()]
    return False in answers and True not in answers


def _not_a_muon_text(outcomes: list[Outcome]) -> str:
    updates = [u for o in outcomes for u in o.updates.values() if u.orthogonalised is False]
    routed = sorted({u.routed.split(":")[0] for u in updates if u.routed})
    where = f"; routed as {', '.join(routed)}" if routed else ""
    return f"no param's update is orthogonalised in any case ({updates[0].describe()}{where})"


def _routing(outcomes: list[Outcome], stated: str | None) -> list[Finding]:
    """The params the candidate sends to another optimizer, the rule inferred from their shapes (module
    docstring); empty where it sends none, or where it is not a Muon (said there)."""
    routed, kept = set(), set()
    for o in outcomes:
        if not (_compared(o) or o.status == "routed"):
            continue
        for i, shape in enumerate(o.case.shapes):
            (routed if i in o.routed else kept).add(tuple(shape))
    if not routed or _not_a_muon(outcomes):
        return []
    rule = infer_rule(routed, kept)
    reasons = sorted({why.split(":")[0] for o in outcomes for why in o.routed.values()})
    text = (
        f"params of shape {', '.join(map(str, sorted(routed)))} go to another optimizer "
        f"({'; '.join(reasons)}), not compared; "
        + (
            f"rule inferred: {rule}"
            if rule
            else "no rule of one or two terms separates them from the compared shapes"
        )
    )
    if stated:
        text += f"; the claim states: {stated}"
    return [Finding("routing", text)]


def diagnose(
    outcomes: list[Outcome],
    preset: str | None,
    overrides: dict[str, Any],
    context: Context | None = None,
    found: list[Finding] | None = None,
) -> str:
    """One line: the findings (module docstring; `found` when already made) joined, or conforms; the roundings
    the conforming cases needed (shard-local, update layout, stack mode) and an asym_none answer after it."""
    found = findings(outcomes, preset, overrides, context) if found is None else found
    parts = [phrase(f) for f in found]
    if not any(f.kind not in ("routing", "unsupported input", "non-deterministic") for f in found):
        within = " (within the stated tolerance)" if context and context.tolerance else ""
        parts.insert(0, f"conforms: every compared case equal to the claim{within}")
    verdict = "; ".join(parts)
    local = [o for o in outcomes if o.elementwise]
    if local:
        # a stack mode is a rounding of Newton-Schulz's products, not of an elementwise op
        arithmetic = "elementwise arithmetic"
        if any("ns_stack" in o.elementwise for o in local):
            arithmetic = "Newton-Schulz products and elementwise arithmetic"
        verdict += (
            f" (named roundings, conventions of the candidate's {arithmetic}, on "
            f"{by_family(outcomes, lambda o: bool(o.elementwise))}: "
            f"{'; '.join(sorted({_rounding_name(o.elementwise) for o in local}))})"
        )
    answers = sorted({o.policy for o in outcomes if o.policy})
    return verdict + (
        f" (gradients missing on some ranks only: {', '.join(answers)})" if answers else ""
    )


def phrase(f: Finding) -> str:
    """A finding as the diagnosis line says it: "KIND: TEXT", with the forms the line has always used for
    conventions by partition, crashes, hangs and gloo's refusals."""
    if f.kind == "convention" and f.text.startswith("by partition: "):
        return f"conventions {f.text}"
    if f.kind in ("crashes", "hangs", "could not run on gloo", "resume fails"):
        return f"{f.kind} {f.text}"
    return f"{f.kind}: {f.text}"


def _rounding_name(label: str) -> str:
    """'shard-local', 'update layout 'contiguous'' ...: a rounding label without its boundaries."""
    return "; ".join(part.split(", boundaries")[0] for part in label.split("; "))


__all__ = [
    "CONVENTION_OPTIONS",
    "Context",
    "Finding",
    "Search",
    "findings",
    "phrase",
    "GLOO_REFUSALS",
    "alternatives",
    "by_family",
    "diagnose",
    "explain",
    "find_convention",
    "gloo_refusal",
]
