"""The oracle side of a conformance case: muon_ref.Muon on the full tensors, and the comparison.

Contract checked per case (Outcome.status == "bitwise"), for every step s, rank r and parameter i:
    bits(candidate_r,s[i]) == bits(box_r(reference_s[i]))      (bits: -0.0 and +0.0 differ; dtype must match)
and for the final momentum buffers the candidate exposes: the same, against box_r(reference momentum).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

import muon_ref
from muon_ref.presets import preset_defaults

from ..fixtures import same_bits
from . import Adapter
from .cases import Case, gradients, initial_params, local_box

# Hyperparameters every case runs with (values unlike every preset's defaults, so that a dropped or renamed
# argument shows): each goes to the candidate when its adapter accepts it, and always into the claim.
HYPERPARAMETERS: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "nesterov": True}
HP_FIELDS = tuple(HYPERPARAMETERS)


def candidate_hyperparameters(adapter: Adapter) -> dict[str, Any]:
    return {k: v for k, v in HYPERPARAMETERS.items() if k in adapter.hyperparameters}


def claim_of(adapter: Adapter) -> tuple[str | None, dict[str, Any]]:
    """(preset, overrides) of the claim: the adapter's overrides plus the hyperparameters it accepts."""
    return adapter.preset, {**adapter.overrides, **candidate_hyperparameters(adapter)}


@dataclass
class Outcome:
    """status: "bitwise", "differs", "crash" or "hang". param_diffs: max |dP| after each step (over params and
    ranks; inf where shapes differ or NaN appears). state_diff: max |dM| of the exposed momentum buffers."""

    case: Case
    status: str
    param_diffs: tuple[float, ...] = ()
    state_diff: float | None = None
    error: str | None = None
    results: list | None = field(default=None, repr=False, compare=False)

    @property
    def max_diff(self) -> float | None:
        return max(self.param_diffs) if self.param_diffs else None

    @property
    def first_step(self) -> int | None:
        """The first step (1-based) whose parameters differ from the reference (None: none differ)."""
        return next((s + 1 for s, d in enumerate(self.param_diffs) if d != 0), None)

    @property
    def grows(self) -> bool | None:
        """Does the difference grow from its first step to the last (None when nothing differs)?"""
        first = self.first_step
        return None if first is None else self.param_diffs[-1] > self.param_diffs[first - 1]

    def summary(self) -> dict[str, Any]:
        return {"case": self.case.label(), "family": self.case.family, "dtype": self.case.dtype,
                "mode": self.case.mode, "world_size": self.case.world_size, "shapes": self.case.shapes,
                "steps": self.case.steps, "status": self.status, "max_diff": self.max_diff,
                "param_diffs": list(self.param_diffs), "state_diff": self.state_diff,
                "first_step": self.first_step, "grows": self.grows, "error": self.error}


def reference_steps(case: Case, preset: str | None, overrides: dict[str, Any]) -> tuple[list, list]:
    """muon_ref.Muon under (preset, overrides and the case's options) on the full tensors, on the case's device:
    (params after each step, final momentum buffers), as CPU copies."""
    params = initial_params(case)
    groups = [{"params": [p], "flatten": p.ndim >= 4} for p in params]
    opt = muon_ref.Muon(groups, preset=preset, **{**overrides, **dict(case.options)})
    per_step = []
    for step in range(case.steps):
        for p, g in zip(params, gradients(case, step)):
            p.grad = g
        opt.step()
        per_step.append([p.detach().cpu().clone() for p in params])
    return per_step, [opt.state[p]["momentum_buffer"].cpu() for p in params]


def max_abs_diff(a: Tensor, b: Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    d = (a.double() - b.double()).abs().max().item()
    return math.inf if math.isnan(d) else d


def compare(case: Case, results: list[dict], reference: tuple[list, list]) -> Outcome:
    """The outcome of a case whose ranks all answered: bitwise or differs, with the per-step differences."""
    ref_steps, ref_momentum = reference
    bitwise = True
    diffs = [0.0] * case.steps
    state_diff: float | None = None
    for rank, r in enumerate(results):
        for s, (got_step, want_step) in enumerate(zip(r["params"], ref_steps)):
            for got, want in zip(got_step, want_step):
                want = local_box(want, case, rank)
                bitwise &= same_bits(got, want)
                diffs[s] = max(diffs[s], max_abs_diff(got, want))
        for got, want in zip(r["momentum"], ref_momentum):
            if got is not None:
                want = local_box(want, case, rank)
                bitwise &= same_bits(got, want)
                state_diff = max(state_diff or 0.0, max_abs_diff(got, want))
    return Outcome(case, "bitwise" if bitwise else "differs", tuple(diffs), state_diff, results=results)


def matches(outcome: Outcome, preset: str | None, overrides: dict[str, Any]) -> bool:
    """Does muon_ref under (preset, overrides) reproduce the candidate's recorded results bit for bit?"""
    return compare(outcome.case, outcome.results, reference_steps(outcome.case, preset, overrides)).status == "bitwise"


def resolved_hyperparameters(preset: str | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """The claim's lr, weight_decay, momentum and nesterov after the preset's defaults."""
    values = preset_defaults(preset, overrides)
    return {k: values[k] for k in HP_FIELDS}
