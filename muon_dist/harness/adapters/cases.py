"""Conformance cases: families of parameter sets, each a function of the world size, and the predicate that
keeps a shrunk case inside its family.

Single device (plain tensors): tall, wide, square, row (1 x n), primes, experts3d ([E, m, n]), conv4d
(4-D, read as (out, in*kh*kw) by the reference: flatten=True); experts_fused ([E * m, n] with the param-group
key num_experts = E, xtuner's layout: only for adapters that list it).
DTensor Shard(0) over W ranks, torch.chunk boxes (5 rows on 4 ranks: 2, 2, 1, 0), the Hypothesis suite's
families: even (rows % W == 0, W params), uneven (rows % W != 0, no empty box; rows and cols chosen so that
padding rows to a multiple of W would flip the transpose decision), empty (rows < W: some rank holds nothing),
remainder (more params than W and not a multiple), experts (3-D [E, m, n], E % W != 0).
Replicated (the same plain tensor on every rank): even (W params), remainder (W + 1), mixed (W + 1 of one
shape, W - 1 of another: a batch of W holds both), experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..fixtures import box_of, seeded

SINGLE_FAMILIES = frozenset({"tall", "wide", "square", "row", "primes", "experts3d", "conv4d"})
MATRIX_FAMILIES = frozenset({"tall", "wide", "square", "row", "primes"})  # 2-D params only
FUSED_FAMILIES = frozenset({"experts_fused"})
DIST_FAMILIES = frozenset({"even", "uneven", "empty", "remainder", "experts"})
REPLICATED_FAMILIES = frozenset({"even", "remainder", "mixed", "experts"})

_SINGLE_SHAPES = {
    "tall": ((12, 6),), "wide": ((6, 12),), "square": ((8, 8),), "row": ((1, 10),), "primes": ((13, 7),),
    "experts3d": ((3, 6, 4),), "conv4d": ((4, 3, 2, 2),), "experts_fused": ((4 * 3, 5),),
}
# options a family sets on both sides (param-group keys of muon_ref; the adapter maps them to its own)
_FAMILY_OPTIONS: dict[str, tuple[tuple[str, object], ...]] = {"experts_fused": (("num_experts", 4),)}


@dataclass(frozen=True)
class Case:
    """mode: "single" (plain tensors, one rank), "dtensor" or "replicated" (world_size ranks). device: where the
    candidate and the reference run ("cuda": ranks share the node's GPUs, gloo carrying CUDA tensors). options:
    hyperparameters and muon_ref options that the case sets on both sides, over the check's defaults (an adapter's
    variant, a family's num_experts)."""

    family: str
    mode: str
    world_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtype: str = "float32"
    steps: int = 3
    seed: int = 0
    device: str = "cpu"
    options: tuple[tuple[str, object], ...] = ()

    def label(self) -> str:
        shapes = _shapes_label(self.shapes)
        where = "1 device" if self.mode == "single" else f"W={self.world_size} {self.mode}"
        on = "" if self.device == "cpu" else f" {self.device}"
        opts = "".join(f" {k}={v}" for k, v in self.options)
        return f"{self.family} {shapes} {self.dtype} {where}{on}{opts} {self.steps} steps"


def _shapes_label(shapes: tuple[tuple[int, ...], ...]) -> str:
    runs: list[list] = []
    for s in shapes:
        if runs and runs[-1][0] == s:
            runs[-1][1] += 1
        else:
            runs.append([s, 1])
    return " + ".join(f"{n}x{tuple(s)}" if n > 1 else str(tuple(s)) for s, n in runs)


def family_shapes(family: str, mode: str, W: int) -> tuple[tuple[int, ...], ...] | None:
    """The family's parameter shapes on W ranks (None when the family cannot exist on W ranks)."""
    if mode == "single":
        return _SINGLE_SHAPES[family]
    if family == "even":
        return ((2 * W, 5),) * W
    if family == "remainder":
        return ((2 * W, 5),) * (W + 1) if W > 1 else None
    if family == "experts":
        return ((W + 1, 4, 3),) * W
    if mode == "replicated":
        # a batch of W straddles the two shapes when W > 1
        return ((6, 4),) * (W + 1) + ((3, 5),) * max(W - 1, 1) if family == "mixed" else None
    if family == "uneven":  # (2W-1) x (2W-1): no empty box; padded to 2W rows it would be transposed
        return ((2 * W - 1, 2 * W - 1),) * W if W > 1 else None
    if family == "empty":
        return ((W - 1, 4),) * W if W > 1 else None
    raise ValueError(f"unknown case family {family!r}")


def in_family(case: Case) -> bool:
    """Does the case still exercise its family (the shrinker keeps only cases that do)?"""
    W, shapes, fam = case.world_size, case.shapes, case.family
    if not shapes or any(d < 1 for s in shapes for d in s):
        return False
    rows = [s[0] for s in shapes]
    if case.mode == "single":
        experts = dict(case.options).get("num_experts", 1)
        return {"tall": shapes[0][0] > shapes[0][1], "wide": shapes[0][0] < shapes[0][1],
                "square": shapes[0][0] == shapes[0][1], "row": shapes[0][0] == 1,
                "primes": all(_prime(d) for d in shapes[0]), "experts3d": len(shapes[0]) == 3,
                "conv4d": len(shapes[0]) == 4,
                "experts_fused": len(shapes[0]) == 2 and shapes[0][0] % experts == 0}[fam]
    if fam == "even":
        return all(r % W == 0 for r in rows)
    if fam == "remainder":
        return len(shapes) > W and len(shapes) % W != 0
    if fam == "uneven":
        return all(r % W != 0 and r > math.ceil(r / W) * (W - 1) for r in rows)
    if fam == "empty":
        return any(math.ceil(r / W) * (W - 1) >= r for r in rows)
    if fam == "experts":
        return all(len(s) == 3 for s in shapes)
    return fam == "mixed" and len(set(shapes)) > 1


def _prime(n: int) -> bool:
    return n > 1 and all(n % k for k in range(2, int(n**0.5) + 1))


def default_cases(families: frozenset[str], mode: str | None, world_sizes: tuple[int, ...],
                  dtypes: tuple[str, ...], steps: int, device: str = "cpu",
                  variants: tuple[dict[str, object], ...] = ({},)) -> list[Case]:
    """Every supported single-device family, then every distributed family on every world size; each in every
    dtype and every variant (options over the check's defaults)."""
    def made(family: str, mode: str, W: int, shapes: tuple) -> list[Case]:
        return [Case(family, mode, W, shapes, d, steps, device=device,
                     options=_FAMILY_OPTIONS.get(family, ()) + tuple(v.items())) for v in variants for d in dtypes]

    cases = [c for f in sorted(families & (SINGLE_FAMILIES | FUSED_FAMILIES)) for c in made(f, "single", 1,
                                                                                          _SINGLE_SHAPES[f])]
    if mode is None:
        return cases
    dist = sorted(families & (DIST_FAMILIES if mode == "dtensor" else REPLICATED_FAMILIES))
    for W in world_sizes:
        for f in dist:
            shapes = family_shapes(f, mode, W)
            if shapes is not None:
                cases += made(f, mode, W, shapes)
    return cases


def initial_params(case: Case) -> list[torch.Tensor]:
    """The full initial parameters on the case's device: the same on every rank and in the parent (seeded per
    param, drawn on the CPU)."""
    return [seeded(s, case.seed * 7919 + i, case.dtype, case.device) for i, s in enumerate(case.shapes)]


def gradients(case: Case, step: int) -> list[torch.Tensor]:
    """The full gradients of a step: the same on every rank and in the parent (seeded per step and param)."""
    return [seeded(s, case.seed * 104729 + 1000 * step + i + 1, case.dtype, case.device)
            for i, s in enumerate(case.shapes)]


def placement(case: Case) -> str:
    """The fixtures' placement of every param of the case, on a 1-D "fsdp" mesh of case.world_size ranks."""
    return "S0" if case.mode == "dtensor" else "plain"


def local_box(full: torch.Tensor, case: Case, rank: int) -> torch.Tensor:
    """What `rank` holds of `full` in the case: torch.chunk's chunk along dim 0 for dtensor, else all of it."""
    return box_of(full, placement(case), "fsdp", rank, case.world_size)


def smaller(case: Case) -> list[Case]:
    """Candidates one shrinking move away, simplest first: fewer steps, fewer params, smaller dims."""
    out = [replace(case, steps=s) for s in range(1, case.steps)]
    if len(case.shapes) > 1:
        out += [replace(case, shapes=case.shapes[:-1]), replace(case, shapes=case.shapes[1:])]
    for dim in range(len(case.shapes[0]) if case.shapes else 0):
        for shrink in (lambda d: d // 2, lambda d: d - 1):
            shapes = tuple(s[:dim] + (shrink(s[dim]),) + s[dim + 1:] if s == case.shapes[0] else s
                           for s in case.shapes)
            out.append(replace(case, shapes=shapes))
    return [c for c in out if c != case and in_family(c)]
