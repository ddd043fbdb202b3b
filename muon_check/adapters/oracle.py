"""The oracle side of a conformance case: muon_ref.Muon on the full tensors, and the comparison.

Contract checked per case (Outcome.status == "bitwise"), for every step s, rank r and compared parameter i:
    bits(candidate_r,s[i]) == bits(box_r(reference_s[i]))      (bits: -0.0 and +0.0 differ; dtype must match)
for one Rounding of ROUNDINGS, the same for every step, rank and param of the case: the reference's elementwise
stages on the whole params (muon_ref.Muon itself) or on each rank's shard as its own tensor (_ShardLocalMuon), with
the update in the claim's layout or the other one (muon_ref.MuonConfig.update_layout), and, on a case with a stack
of matrices in one param, the stack's Newton-Schulz products in the claim's stack mode or the other one
(muon_ref.MuonConfig.ns_stack: each matrix alone, or one batched product over the stack); Outcome.elementwise names
a rounding other than the claim's own: a rounding convention, never a departure.
and for the momentum after every recorded step and at the end, where the View says it is kept (the adapter's
momentum(), or a state tensor found by value: momentum.py): the same, against box_r(reference momentum). Params the
View routes to another optimizer are not compared (routing.py). With a View tolerance (a candidate that differs from
itself), a case within it is "close". The reference steps on cases.oracle_gradients (the sum of the micro-batches,
the mean over ranks in unreduced mode).
Replica agreement, on every case whose ranks hold replicated data (modes replicated and unreduced: every param, and
every momentum buffer the candidate exposes): after every step, every rank's bits equal rank 0's (Outcome.replicas
says where they do not). In dtensor mode the boxes of the ranks are disjoint: there is nothing replicated to agree
on, and the comparison with the oracle's boxes is the whole check.
A checkpoint case has two segments, the save at W and the resume at W' (whose params right after the load must be
the reference's after the last saved step); boxes are taken at each segment's world size. In the families of
cases.STATE_ROUNDTRIP_FAMILIES (saved and resumed at the same W) every rank's optimizer state right after the load
must also equal, entry by entry, what it held at the save: the same keys, and for each tensor the same dtype,
device, shape and bits (Outcome.resumed says where not; no muon_ref convention can explain it: the oracle has no
say in what a candidate keeps, only in keeping it across a resume).
asym_none: a step may raise. Conforming answers: no rank raises and every rank equals the oracle that skips the
params without a gradient on some rank (policy "skip"), or every rank raises the same exception type at that step
and equals the oracle for which the step never happened (policy "raise": nothing was written). Any other pattern
of errors is a crash, named by the ranks that raised and those that did not.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

import muon_ref
from muon_ref.functional import (
    LAYOUT_DEFAULTS,
    MatrixLayout,
    apply_update,
    matrix_layout,
    momentum_direction,
    orthogonalize,
)
from muon_ref.presets import PRESETS, preset_defaults

from ..fixtures import same_bits
from . import Adapter
from .cases import (
    NONE_POLICIES,
    STATE_ROUNDTRIP_FAMILIES,
    Case,
    asym_step,
    initial_params,
    local_box,
    oracle_gradients,
    world_at,
)
from .momentum import momentum_sources

# Hyperparameters every case runs with (values unlike every preset's defaults, so that a dropped or renamed
# argument shows): each goes to the candidate when its adapter accepts it, and always into the claim.
HYPERPARAMETERS: dict[str, Any] = {
    "lr": 0.02,
    "weight_decay": 0.1,
    "momentum": 0.9,
    "nesterov": True,
}
HP_FIELDS = tuple(HYPERPARAMETERS)


def candidate_hyperparameters(adapter: Adapter) -> dict[str, Any]:
    return {k: v for k, v in HYPERPARAMETERS.items() if k in adapter.hyperparameters}


def claim_of(adapter: Adapter) -> tuple[str | None, dict[str, Any]]:
    """(preset, overrides) of the claim: the adapter's overrides plus the hyperparameters it accepts."""
    return adapter.preset, {**adapter.overrides, **candidate_hyperparameters(adapter)}


@dataclass
class Outcome:
    """status: "bitwise", "close" (within `tolerance`: a candidate that differs from itself), "differs", "crash",
    "hang", "unsupported" (its constructor refused the case's params: `error`) or "routed" (every param sent to
    another optimizer). param_diffs: max |dP| after each step (over compared params and ranks; inf where shapes
    differ or NaN appears); max_ulps: the largest difference in units in the last place (oracle.max_ulps).
    state_diff: max |dM| of the compared momentum at the end; momentum_diffs: after each recorded step (None: not
    recorded). replicas: where replicated bits differ across ranks (None: they agree, or nothing is replicated).
    policy: how an asym_none case answered ("skip", or "raise" with the exception type). resumed: where the
    optimizer state right after a load differs from the state at the save (None: it does not, or the family does not
    compare it). routed: param index -> why the candidate sends it elsewhere (not compared); momentum_sources: per
    param, where its momentum was read (View.labels). stage, stage_detail: where a departure starts (stages.py).
    view: what was compared (View); updates: the first step's update of each param, read (routing.Update).
    vacuous: why the case cannot show what its family targets under this claim (None: it can)."""

    case: Case
    status: str
    param_diffs: tuple[float, ...] = ()
    state_diff: float | None = None
    error: str | None = None
    results: list | None = field(default=None, repr=False, compare=False)
    replicas: str | None = None
    policy: str | None = None
    elementwise: str | None = None
    unmapped: tuple[str, ...] = ()
    resumed: str | None = None
    max_ulps: float | None = None
    momentum_diffs: tuple[float | None, ...] = ()
    routed: dict[int, str] = field(default_factory=dict)
    momentum_sources: tuple[str, ...] = ()
    stage: str | None = None
    stage_detail: str | None = None
    stage_exact: bool = False
    tolerance: float | None = None
    view: Any = field(default=None, repr=False, compare=False)
    updates: dict[int, Any] = field(default_factory=dict, repr=False, compare=False)
    vacuous: str | None = None

    @property
    def max_diff(self) -> float | None:
        return max(self.param_diffs) if self.param_diffs else None

    @property
    def first_step(self) -> int | None:
        """The first step (1-based) whose parameters or recorded momentum differ from the reference (None: none
        differ; a momentum that differs only after the last recorded step counts at the last step)."""
        params = next((s + 1 for s, d in enumerate(self.param_diffs) if d != 0), None)
        momentum = next((s + 1 for s, d in enumerate(self.momentum_diffs) if d), None)
        if params is None and momentum is None and self.state_diff:
            return len(self.param_diffs) or None
        return min((s for s in (params, momentum) if s is not None), default=None)

    @property
    def grows(self) -> bool | None:
        """Does the difference grow from its first step to the last (None when nothing differs)?"""
        first = self.first_step
        return None if first is None else self.param_diffs[-1] > self.param_diffs[first - 1]

    def summary(self) -> dict[str, Any]:
        return {
            "case": self.case.label(),
            "family": self.case.family,
            "dtype": self.case.dtype,
            "mode": self.case.mode,
            "world_size": self.case.world_size,
            "resume_world_size": self.case.resume_world_size,
            "shapes": self.case.shapes,
            "steps": self.case.steps,
            "status": self.status,
            "max_diff": self.max_diff,
            "param_diffs": list(self.param_diffs),
            "state_diff": self.state_diff,
            "first_step": self.first_step,
            "grows": self.grows,
            "error": self.error,
            "replicas": self.replicas,
            "policy": self.policy,
            "elementwise": self.elementwise or "whole",
            "momentum_not_compared": list(self.unmapped),
            "resumed": self.resumed,
            "max_ulps": self.max_ulps,
            "routed": {str(i): why for i, why in self.routed.items()},
            "momentum_read_from": list(self.momentum_sources),
            "stage": self.stage,
            "stage_detail": self.stage_detail,
            "tolerance": self.tolerance,
            "vacuous": self.vacuous,
        }


@dataclass(frozen=True)
class RefRun:
    """muon_ref's run of a case under one policy: the params after each step and the momentum buffers after each
    step (zeros for a param that has not stepped), as CPU copies."""

    params: list[list[Tensor]]
    momenta: list[list[Tensor]]

    @property
    def final_momenta(self) -> list[Tensor]:
        return self.momenta[-1]


Reference = dict[str, RefRun]  # policy -> the reference's run
Segment = tuple[int, list[dict]]  # (world size, each rank's result: muon_check/adapters/workers.py)


@dataclass(frozen=True)
class Rounding:
    """Where the reference's elementwise stages round, and in which memory order its update meets the params.

    momentum_local / update_local: the momentum stage / the decay and update stage on each rank's shard as its own
    tensor ("shard-local": on CPU a bf16 elementwise op rounds an element differently in the vectorised body and in
    the scalar tail of its loop, so the bits depend on where the shard boundaries fall; muon_dist/elementwise.py).
    other_layout: the update in the other update_layout than the claim's (muon_ref.MuonConfig.update_layout: the
    kernel's own memory order or row-major; on CPU a bf16 op on P and O rounds by the order). other_stack: a stack's
    Newton-Schulz in the other ns_stack than the claim's (each matrix alone, or the stack as one batch: a batched
    product may round some inputs otherwise than single ones; tried only on cases with a stack: has_stacks). All are
    correct; the check names the one a candidate uses."""

    name: str
    momentum_local: bool = False
    update_local: bool = False
    other_layout: bool = False
    other_stack: bool = False

    @property
    def local(self) -> bool:
        return self.momentum_local or self.update_local


_SHARD_LOCAL = (
    Rounding("shard-local", True, True),
    Rounding("shard-local momentum", True, False),
    Rounding("shard-local update", False, True),
)
WHOLE = Rounding("whole")
# in the order judge tries them: the claim's own layout first, shard-local roundings only off a single device, the
# claim's stack mode before the other, which only cases with a stack try
_CLAIMED_STACK: tuple[Rounding, ...] = (
    WHOLE,
    *_SHARD_LOCAL,
    Rounding("whole", other_layout=True),
    *(Rounding(r.name, r.momentum_local, r.update_local, True) for r in _SHARD_LOCAL),
)
ROUNDINGS: tuple[Rounding, ...] = (
    *_CLAIMED_STACK,
    *(dataclasses.replace(r, other_stack=True) for r in _CLAIMED_STACK),
)
ELEMENTWISE: dict[str, tuple[bool, bool]] = {
    "whole": (False, False),
    **{r.name: (r.momentum_local, r.update_local) for r in _SHARD_LOCAL},
}


def claimed_layout(preset: str | None, overrides: dict[str, Any]) -> str:
    """The update_layout of the claim (preset and overrides)."""
    return preset_defaults(preset, overrides)["update_layout"]


def other_layout(preset: str | None, overrides: dict[str, Any]) -> str:
    return "contiguous" if claimed_layout(preset, overrides) == "kernel" else "kernel"


def other_stack(preset: str | None, overrides: dict[str, Any]) -> str:
    """The ns_stack that is not the claim's (muon_ref.MuonConfig.ns_stack)."""
    claimed = preset_defaults(preset, overrides)["ns_stack"]
    return "batched" if claimed == "per_matrix" else "per_matrix"


def is_stack(layout: MatrixLayout) -> bool:
    """A shared layout of two or more matrices: where Newton-Schulz's stack mode (ns_stack) can change a bit."""
    return not layout.separate and layout.matrices_shape[0] > 1


def has_stacks(case: Case, options: dict[str, Any]) -> bool:
    """Does some param of the case reach Newton-Schulz as a stack under these options? Each shape read as the
    reference reads it (muon_ref.matrix_layout with the options' layout keys and reference_groups' flatten); a
    shape the reference refuses is no stack."""
    keys = {k: options[k] for k in LAYOUT_DEFAULTS if k in options}
    for shape in case.shapes:
        flatten = options["flatten"] if "flatten" in options else len(shape) >= 4
        try:
            if is_stack(matrix_layout(shape, flatten=flatten, **keys)):
                return True
        except ValueError:
            continue
    return False


def tried(case: Case, rounding: Rounding, preset: str | None, overrides: dict[str, Any]) -> bool:
    """Whether judge tries `rounding` on the case: shard-local roundings off a single device, the other stack mode
    on cases with a stack."""
    if rounding.local and case.mode == "single":
        return False
    return not rounding.other_stack or has_stacks(case, {**overrides, **dict(case.options)})


def shard_ranges(case: Case, step: int) -> list[list[tuple[int, int]]]:
    """Per param, the flat element ranges [a, b) of the ranks' shards at `step` (world_at(case, step) ranks): in
    dtensor mode torch.chunk's boxes along dim 0 (whole rows); in replicated and unreduced modes ZeRO-1/2's flat
    partitions (the params' concatenation cut into W parts of ceil(total / W) elements, DeepSpeed
    stage_1_and_2.py), each cut to the param. Empty ranges are left out; the ranges tile each param."""
    W = world_at(case, step)
    sizes = [math.prod(s) for s in case.shapes]
    if case.mode == "dtensor":
        out = []
        for shape, numel in zip(case.shapes, sizes):
            per_row, rows = numel // shape[0], shape[0]
            c = math.ceil(rows / W)
            out.append(
                [
                    (k * c * per_row, min(rows, (k + 1) * c) * per_row)
                    for k in range(W)
                    if k * c < rows
                ]
            )
        return out
    part, start, out = math.ceil(sum(sizes) / W), 0, []
    for numel in sizes:
        cuts = sorted(
            {start, start + numel}
            | {k * part for k in range(W) if start < k * part < start + numel}
        )
        out.append([(a - start, b - start) for a, b in zip(cuts, cuts[1:])])
        start += numel
    return out


def elementwise_label(case: Case, elementwise: str) -> str:
    """'shard-local, boundaries [0:3 | 3:5] of (5, 5) at W=2' (each distinct shape once; rows in dtensor mode,
    flat elements in ZeRO partitions)."""
    if elementwise == "whole":
        return "whole"
    seen, parts = set(), []
    for step in sorted({0, case.steps - 1}):
        for shape, ranges in zip(case.shapes, shard_ranges(case, step)):
            per = math.prod(shape) // shape[0] if case.mode == "dtensor" else 1
            key = (shape, tuple(ranges))
            if key in seen:
                continue
            seen.add(key)
            unit = "rows" if case.mode == "dtensor" else "elements"
            cuts = " | ".join(f"{a // per}:{b // per}" for a, b in ranges)
            parts.append(f"{unit} [{cuts}] of {tuple(shape)} at W={world_at(case, step)}")
    return f"{elementwise}, boundaries {'; '.join(parts)}"


class _ShardLocalMuon(muon_ref.Muon):
    """muon_ref.Muon whose elementwise stages run on each of `ranges[id(p)]` (flat element ranges) as its own
    contiguous tensor, the way a candidate applies them to its shard; Newton-Schulz on the whole matrices.
    Reference equation, per range R of a param:  (M'[R], D[R]) = momentum_direction(G[R], M[R]),
    O = orthogonalize(D),  P'[R] = apply_update(P[R], O[R])  (either stage on the whole param when not local)."""

    def configure(self, ranges: dict[int, list[tuple[int, int]]], local: tuple[bool, bool]) -> None:
        self.ranges, self.local = ranges, local

    def param_step(self, p, grad, buf, cfg, layout):
        if layout.separate:  # blocks stepped as separate params: no conformance family has them
            return super().param_step(p, grad, buf, cfg, layout)
        ranges = self.ranges[id(p)]
        local_momentum, local_update = self.local
        if local_momentum:
            new_buf, direction = _per_range(
                lambda g, m: momentum_direction(g, m, cfg), ranges, grad, buf
            )
        else:
            new_buf, direction = momentum_direction(grad, buf, cfg)
        update = orthogonalize(direction, layout, cfg)
        if not local_update:
            return apply_update(p, update, layout, cfg), new_buf
        (new_p,) = _per_range(lambda q, u: (apply_update(q, u, layout, cfg),), ranges, p, update)
        return new_p, new_buf


def _per_range(stage, ranges: list[tuple[int, int]], *tensors: Tensor) -> tuple[Tensor, ...]:
    """stage on each flat range of the tensors, as fresh contiguous 1-D tensors, written back whole."""
    outs: list[Tensor] = []
    for a, b in ranges:
        results = stage(*(t.reshape(-1)[a:b].clone() for t in tensors))
        if not outs:
            outs = [
                torch.empty(tensors[0].numel(), dtype=r.dtype, device=r.device) for r in results
            ]
        for out, r in zip(outs, results):
            out[a:b] = r
    return tuple(out.reshape(tensors[0].shape) for out in outs)


def reference_steps(
    case: Case,
    preset: str | None,
    overrides: dict[str, Any],
    rounding: Rounding | str = WHOLE,
) -> Reference:
    """muon_ref.Muon under (preset, overrides and the case's options) on the full tensors, on the case's device, for
    each policy the case's family admits, with its elementwise stages rounding as `rounding` says (a Rounding, or
    a name of ELEMENTWISE)."""
    if isinstance(rounding, str):
        rounding = next(r for r in ROUNDINGS if r.name == rounding and not r.other_layout)
    return {
        policy: _reference_run(case, preset, overrides, policy, rounding)
        for policy in (NONE_POLICIES if case.family == "asym_none" else NONE_POLICIES[:1])
    }


def claim_options(case: Case, preset: str | None, overrides: dict[str, Any], rounding: Rounding):
    """The options the reference runs a case with: the claim's overrides, the case's options over them, and the
    rounding's update layout."""
    options = {**overrides, **dict(case.options)}
    if rounding.other_layout:
        options["update_layout"] = other_layout(preset, options)
    if rounding.other_stack:
        options["ns_stack"] = other_stack(preset, options)
    return options


def reference_groups(params: list[Tensor], options: dict[str, Any]) -> list[dict[str, Any]]:
    """One group per param. Every option of the claim reaches the reference as the optimizer's defaults; flatten
    is set per group only where the claim leaves it out (4-D conv weights read as (out, in * kh * kw), as every
    origin that takes them reads them), so a claim's flatten=True reaches 3-D params too."""
    if "flatten" in options:
        return [{"params": [p]} for p in params]
    return [{"params": [p], "flatten": p.ndim >= 4} for p in params]


def reference_optimizer(
    params: list[Tensor],
    case: Case,
    preset: str | None,
    overrides: dict[str, Any],
    rounding: Rounding = WHOLE,
) -> muon_ref.Muon:
    options = claim_options(case, preset, overrides, rounding)
    cls = _ShardLocalMuon if rounding.local else muon_ref.Muon
    return cls(reference_groups(params, options), preset=preset, **options)


# muon_ref's runs kept for the life of the process, the least recently used dropped beyond REFERENCE_RUNS_KEPT: a
# check's search for the nearest configuration, and the planted suite's candidates one after another, ask for the
# same (case, claim, rounding) runs many times. A run is a function of its key alone, muon_ref's code being fixed
# for the process: the case fixes its params and gradients (seeded), the claim (the preset's options as they are
# now, and the overrides) and the rounding its options, and torch's intra-op thread count, part of the key, where on
# CPU its bf16 elementwise ops round (muon_dist/elementwise.py). Callers only read a run's tensors.
REFERENCE_RUNS_KEPT = 4096
_kept_runs: OrderedDict[tuple, RefRun] = OrderedDict()


def _frozen(value: Any) -> Any:
    """A hashable stand-in for an option's value (dicts, lists and sets by their items); TypeError if none."""
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _frozen(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_frozen(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(map(repr, value))))
    hash(value)
    return value


def _reference_run(
    case: Case,
    preset: str | None,
    overrides: dict[str, Any],
    policy: str,
    rounding: Rounding,
    steps: int | None = None,
) -> RefRun:
    """_run_reference's run, kept (_kept_runs) where its key is hashable."""
    steps = case.steps if steps is None else steps
    try:
        claim = (preset, _frozen(PRESETS.get(preset or "", {})), _frozen(overrides))
        key = (case, claim, policy, rounding, torch.get_num_threads())
        key = key if steps == case.steps else (*key, steps)
        hash(key)
    except TypeError:  # an option without a hashable value: run it each time
        return _run_reference(case, preset, overrides, policy, rounding, steps)
    run = _kept_runs.get(key)
    if run is None:
        run = _kept_runs[key] = _run_reference(case, preset, overrides, policy, rounding, steps)
        if len(_kept_runs) > REFERENCE_RUNS_KEPT:
            _kept_runs.popitem(last=False)
    else:
        _kept_runs.move_to_end(key)
    return run


def _run_reference(
    case: Case,
    preset: str | None,
    overrides: dict[str, Any],
    policy: str,
    rounding: Rounding,
    steps: int | None = None,
) -> RefRun:
    """muon_ref.Muon under the claim (reference_optimizer, with the rounding's elementwise stages) on the case's full
    initial params, stepped on oracle_gradients(case, step, policy) for case.steps steps (or the first `steps`: a
    prefix of the whole run, since nothing of a step depends on the steps after it): the params and momentum
    buffers after each step, as CPU copies."""
    params = initial_params(case)
    opt = reference_optimizer(params, case, preset, overrides, rounding)
    per_step, momenta = [], []
    for step in range(case.steps if steps is None else steps):
        if rounding.local:
            ranges = shard_ranges(case, step)
            opt.configure(
                {id(p): r for p, r in zip(params, ranges)},
                (rounding.momentum_local, rounding.update_local),
            )
        for p, g in zip(params, oracle_gradients(case, step, policy)):
            p.grad = g
        opt.step()
        per_step.append([p.detach().cpu().clone() for p in params])
        momenta.append(
            [opt.state[p].get("momentum_buffer", torch.zeros_like(p)).cpu().clone() for p in params]
        )
    return RefRun(per_step, momenta)


def judge(
    case: Case,
    segments: list[Segment],
    preset: str | None,
    overrides: dict[str, Any],
    reference: Reference | None = None,
    view: View | None = None,
) -> Outcome:
    """The case's outcome. Compared first against the reference under the claim (`reference`, when already
    computed); where that is not bitwise, against each other Rounding (shard-local ones off a single device, then
    the other update layout): the first bitwise one is the outcome, named in Outcome.elementwise (a rounding
    convention, never a departure). `view` says what is compared (momentum sources, routed params, a tolerance);
    by default it is read from the segments (View.of)."""
    reference = reference or reference_steps(case, preset, overrides)
    view = view or View.of(case, segments, reference)
    first = compare(case, segments, reference, view)
    first.unmapped, first.momentum_sources, first.view = view.unmapped, view.labels, view
    if first.status != "differs" or first.replicas or first.resumed:
        return first
    for rounding in ROUNDINGS[1:]:
        if not tried(case, rounding, preset, overrides):
            continue
        trial = compare(case, segments, reference_steps(case, preset, overrides, rounding), view)
        if trial.status in ("bitwise", "close"):
            trial.elementwise = rounding_label(case, rounding, preset, overrides)
            trial.unmapped, trial.momentum_sources = first.unmapped, first.momentum_sources
            trial.view = view
            return trial
    return first


def rounding_label(case: Case, rounding: Rounding, preset: str | None, overrides: dict) -> str:
    """elementwise_label, and the update layout and the stack mode where each is the other one than the claim's."""
    parts = [elementwise_label(case, rounding.name)] if rounding.local else []
    if rounding.other_layout:
        layout = other_layout(preset, {**overrides, **dict(case.options)})
        parts.append(f"update layout {layout!r} (the claim's is the other)")
    if rounding.other_stack:
        stack = other_stack(preset, {**overrides, **dict(case.options)})
        how = "one batched product over each stack" if stack == "batched" else "each matrix alone"
        parts.append(f"ns_stack {stack!r} ({how}; the claim's is the other)")
    return "; ".join(parts)


@dataclass(frozen=True)
class View:
    """What compare() reads of a case besides the params.

    sources: per param, where the candidate keeps its momentum: ("adapter", None) for the adapter's momentum(),
    ("state", path) for a state tensor found by value (momentum.find), ("none", why) for a momentum not compared
    (routed, none kept, left out by --state-map none), ("unmapped", keys) for param-sized state none of which is
    the momentum. routed: param index -> why the candidate sends it to another optimizer (not compared).
    tolerance: compare params and momentum at this max |d| instead of bits (a candidate that differs from itself),
    None: bits."""

    sources: tuple[tuple[str, Any], ...]
    routed: dict[int, str] = field(default_factory=dict)
    tolerance: float | None = None

    @staticmethod
    def of(
        case: Case,
        segments: list[Segment],
        reference: Reference,
        routed: dict[int, str] | None = None,
        tolerance: float | None = None,
        search: bool = True,
    ) -> View:
        """search False: a momentum the adapter does not expose is left out (--state-map none)."""
        routed = routed or {}
        sources = momentum_sources(case, segments, reference, routed, search)
        return View(sources, routed, tolerance)

    @property
    def unmapped(self) -> tuple[str, ...]:
        return tuple(sorted({k for kind, keys in self.sources if kind == "unmapped" for k in keys}))

    @property
    def labels(self) -> tuple[str, ...]:
        out = []
        for kind, detail in self.sources:
            if kind == "adapter":
                out.append("the adapter's momentum()")
            elif kind == "state":
                out.append(f"state[p]{detail} (found by value after the first step)")
            elif kind == "unmapped":
                out.append(f"not found among state keys {list(detail)}")
            else:
                out.append(f"not compared: {detail}")
        return tuple(out)

    def momentum(self, result: dict, index: int, step: int | None = None) -> Tensor | None:
        """A rank's momentum of param `index` at the end (step None) or after a recorded step, per its source."""
        kind, detail = self.sources[index] if index < len(self.sources) else ("adapter", None)
        if kind == "adapter":
            if step is None:
                return result["momentum"][index]
            rec = result.get("recorded", {}).get(step)
            return None if rec is None else rec["momentum"][index]
        if kind == "state":
            recorded = result.get("recorded", {})
            key = max(recorded) if step is None and recorded else step
            rec = recorded.get(key)
            return None if rec is None else rec["state"][index].get(detail)
        return None


def max_abs_diff(a: Tensor, b: Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    d = (a.double() - b.double()).abs().max().item()
    return math.inf if math.isnan(d) else d


def _policy(case: Case, segments: list[Segment]) -> tuple[str, str | None]:
    """(policy, None), or ("", the crash message) when the ranks' errors are not a conforming answer."""
    raised = {}  # (segment, step) -> {rank: error}
    for k, (_, results) in enumerate(segments):
        for rank, r in enumerate(results):
            for offset, error in enumerate(r["errors"]):
                raised.setdefault((k, r["first_step"] + offset), {})[rank] = error
    answers = {key: errs for key, errs in raised.items() if any(errs.values())}
    if not answers:
        return "skip", None
    (k, step), errs = next(iter(answers.items()))
    types = {e.split(":")[0] for e in errs.values() if e}
    if len(answers) == 1 and step == asym_step(case) and all(errs.values()) and len(types) == 1:
        return "raise", None
    quiet = sorted(r for r, e in errs.items() if not e)
    rank, error = next((r, e) for r, e in sorted(errs.items()) if e)
    return "", (
        f"at step {step + 1} rank {rank} raised {error[:200]}"
        + (f"; ranks {quiet} did not" if quiet else "; the ranks raised different errors")
    )


def max_ulps(got: Tensor, want: Tensor) -> float:
    """The largest difference in units in the last place of `want`'s dtype, at want's value or at want's RMS where
    that is larger (so that an element near zero, whose own unit is tiny, does not stand for the whole tensor); inf
    where shapes or dtypes differ or NaN appears; 0 for equal bits."""
    if got.shape != want.shape or got.dtype != want.dtype or not got.is_floating_point():
        return math.inf
    if got.numel() == 0:
        return 0.0
    rms = want.double().pow(2).mean().sqrt().to(want.dtype)
    w = torch.maximum(want.abs(), rms)
    spacing = torch.nextafter(w, torch.full_like(w, math.inf)) - w
    d = (got.double() - want.double()).abs() / spacing.double()
    value = d.max().item()
    return math.inf if math.isnan(value) else value


def compare(
    case: Case, segments: list[Segment], reference: Reference, view: View | None = None
) -> Outcome:
    """The outcome of a case whose ranks all answered (module docstring): bitwise, close (within the view's
    tolerance) or differs, with the per-step differences and replica agreement, or a crash when the ranks answered
    asym_none's step inconsistently. Routed params (view.routed) are left out."""
    view = view or View.of(case, segments, reference)
    policy, crash = _policy(case, segments)
    if crash:
        return Outcome(case, "crash", error=crash, results=segments)
    tally = _Tally.of(case, segments, reference[policy], view)
    replicas = _disagreement(case, segments)
    resumed = _state_change(case, segments)
    bitwise = tally.bitwise and not replicas and not resumed
    status = "bitwise" if bitwise else "differs"
    close = (
        max([*tally.diffs, tally.state_diff or 0.0]) <= view.tolerance if view.tolerance else False
    )
    if status == "differs" and close and not replicas and not resumed:
        status = "close"
    answer = _policy_label(policy, segments, bitwise) if case.family == "asym_none" else None
    return Outcome(
        case,
        status,
        tuple(tally.diffs),
        tally.state_diff,
        results=segments,
        replicas=replicas,
        policy=answer,
        resumed=resumed,
        max_ulps=tally.ulps,
        momentum_diffs=tuple(tally.momentum_diffs),
        routed=dict(view.routed),
        tolerance=view.tolerance,
    )


@dataclass
class _Tally:
    """What compare() gathers over the ranks' results against the reference's run (routed params left out):
    whether every compared tensor has its bits, the largest |d| of the params per step and in units in the last
    place, of the momentum per recorded step (None: none compared) and of the final momentum (None: none)."""

    case: Case
    run: RefRun
    view: View
    diffs: list[float]
    momentum_diffs: list[float | None]
    bitwise: bool = True
    ulps: float = 0.0
    state_diff: float | None = None

    @staticmethod
    def of(case: Case, segments: list[Segment], run: RefRun, view: View) -> _Tally:
        """The tally of every segment's ranks: their params and recorded momenta, and the last segment's final
        momenta."""
        tally = _Tally(case, run, view, [0.0] * case.steps, [None] * case.steps)
        for world, results in segments:
            for rank, r in enumerate(results):
                tally.add_params(r, rank, world)
                tally.add_recorded_momenta(r, rank, world)
        world, results = segments[-1]
        for rank, r in enumerate(results):
            tally.add_final_momenta(r, rank, world)
        return tally

    def add_params(self, r: dict, rank: int, world: int) -> None:
        """A rank's params after each step it ran (and the ones it loaded, as of the step before its first)
        against the reference's: bits, |d| and units in the last place."""
        first = r["first_step"]
        checked = [(first + k, got) for k, got in enumerate(r["params"])]
        if "loaded" in r and first > 0:
            checked.append((first - 1, r["loaded"]))
        for s, got_step in checked:
            for i, (got, want) in enumerate(zip(got_step, self.run.params[s])):
                if i in self.view.routed:
                    continue
                want = local_box(want, self.case, rank, world)
                self.bitwise &= same_bits(got, want)
                self.diffs[s] = max(self.diffs[s], max_abs_diff(got, want))
                self.ulps = max(self.ulps, max_ulps(got, want))

    def add_recorded_momenta(self, r: dict, rank: int, world: int) -> None:
        """A rank's momentum after each step it recorded against the reference's: |d| only (at least 1e-300
        where the bits differ)."""
        for s in r.get("recorded", {}):
            for i in range(len(self.case.shapes)):
                got = None if i in self.view.routed else self.view.momentum(r, i, s)
                if got is not None:
                    want = local_box(self.run.momenta[s][i], self.case, rank, world)
                    d = 0.0 if same_bits(got, want) else max(max_abs_diff(got, want), 1e-300)
                    self.momentum_diffs[s] = max(self.momentum_diffs[s] or 0.0, d)

    def add_final_momenta(self, r: dict, rank: int, world: int) -> None:
        """A rank's momentum at the end against the reference's final momentum: bits and |d|."""
        for i, want in enumerate(self.run.final_momenta):
            got = None if i in self.view.routed else self.view.momentum(r, i)
            if got is not None:
                want = local_box(want, self.case, rank, world)
                self.bitwise &= same_bits(got, want)
                self.state_diff = max(self.state_diff or 0.0, max_abs_diff(got, want))


def _policy_label(policy: str, segments: list[Segment], bitwise: bool) -> str:
    """ "raise <exception type>", "skip" (no rank raised, and the oracle that skips agrees), or "no error raised"."""
    if policy == "raise":
        error = next(e for _, results in segments for r in results for e in r["errors"] if e)
        return f"raise {error.split(':')[0]}"
    return "skip" if bitwise else "no error raised"


def _state_change(case: Case, segments: list[Segment]) -> str | None:
    """Where a rank's optimizer state right after the load differs from its state at the save (families of
    STATE_ROUNDTRIP_FAMILIES: the first segment's final "state" against the last's "loaded_state"), or None."""
    if case.family not in STATE_ROUNDTRIP_FAMILIES or len(segments) < 2:
        return None
    (_, saved), (world, resumed) = segments[0], segments[-1]
    for rank, (before, after) in enumerate(zip(saved, resumed)):
        for i, (was, now) in enumerate(zip(before["state"], after["loaded_state"])):
            for key in sorted(set(was) | set(now)):
                a, b = was.get(key), now.get(key)
                if a is None or b is None:
                    gone = "lost by the load" if b is None else "not there at the save"
                    return f"param {i} state {key!r} on rank {rank}: {gone} (W={world})"
                if isinstance(a, str) or isinstance(b, str):
                    same = a == b
                else:
                    same = a[:2] == b[:2] and same_bits(a[2], b[2])
                if not same:
                    return (
                        f"param {i} state {key!r} on rank {rank}: saved {_entry(a)}, loaded "
                        f"{_entry(b)} (W={world})"
                    )
    return None


def _entry(e: Any) -> str:
    """'float32 cpu 257.0' for a scalar tensor entry, 'bfloat16 cpu (3, 3)' for a larger one, a repr as it is."""
    if isinstance(e, str):
        return e
    dtype, device, t = e
    return f"{dtype} {device} {t.item() if t.numel() == 1 else tuple(t.shape)}"


def _disagreement(case: Case, segments: list[Segment]) -> str | None:
    """Where replicated bits differ across ranks (modes replicated and unreduced), or None."""
    if case.mode not in ("replicated", "unreduced"):
        return None
    for world, results in segments:
        for k in range(len(results[0]["params"])):
            step = results[0]["first_step"] + k
            for i in range(len(case.shapes)):
                differ = [
                    rank
                    for rank, r in enumerate(results[1:], 1)
                    if not same_bits(r["params"][k][i], results[0]["params"][k][i])
                ]
                if differ:
                    return f"param {i} after step {step + 1}: ranks {differ} differ from rank 0 (W={world})"
    world, results = segments[-1]
    for i in range(len(case.shapes)):
        held = [
            (rank, r["momentum"][i])
            for rank, r in enumerate(results)
            if r["momentum"][i] is not None
        ]
        differ = [rank for rank, m in held[1:] if not same_bits(m, held[0][1])]
        if differ:
            return f"momentum of param {i} at the end: ranks {differ} differ from rank {held[0][0]} (W={world})"
    return None


def matches(outcome: Outcome, preset: str | None, overrides: dict[str, Any]) -> bool:
    """Does muon_ref under (preset, overrides) reproduce the candidate's recorded results bit for bit (or within
    the outcome's tolerance), under any Rounding (judge), comparing what the outcome compared (its view)?"""
    return trial(outcome, preset, overrides).status in ("bitwise", "close")


def may_match(outcome: Outcome, preset: str | None, overrides: dict[str, Any]) -> bool:
    """False only where trial(outcome, preset, overrides) is certainly neither bitwise nor close, found at a
    fraction of its cost: the ranks' answers are a crash, or under no Rounding judge tries does muon_ref's first
    step (a one-step prefix of its run) give the params that the first rank recorded after step 1 (bits, or the
    view's tolerance), while a match needs every recorded step of every rank to. True where it cannot tell
    cheaply (no results, no view, no rank that recorded step 1)."""
    if outcome.results is None or outcome.view is None:
        return True
    case, segments, view = outcome.case, outcome.results, outcome.view
    policy, crash = _policy(case, segments)
    if crash:
        return False
    world, results = segments[0]
    first = next(
        ((rank, r) for rank, r in enumerate(results) if r["first_step"] == 0 and r["params"]), None
    )
    if first is None:
        return True
    rank, r = first
    for rounding in ROUNDINGS:
        if not tried(case, rounding, preset, overrides):
            continue
        run = _reference_run(case, preset, overrides, policy, rounding, steps=1)
        tally = _Tally(case, run, view, [0.0], [None])
        tally.add_params({"first_step": 0, "params": r["params"][:1]}, rank, world)
        if tally.bitwise or (view.tolerance and tally.diffs[0] <= view.tolerance):
            return True
    return False


def trial(outcome: Outcome, preset: str | None, overrides: dict[str, Any]) -> Outcome:
    """The outcome's case judged against muon_ref under (preset, overrides), with the outcome's view (the outcome
    itself where it kept no results: nothing to judge again)."""
    if outcome.results is None:
        return outcome
    return judge(outcome.case, outcome.results, preset, overrides, view=outcome.view)


def resolved_hyperparameters(preset: str | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """The claim's lr, weight_decay, momentum and nesterov after the preset's defaults."""
    values = preset_defaults(preset, overrides)
    return {k: values[k] for k in HP_FIELDS}
