"""Conformance cases: families of parameter sets, each a function of the world size, what each rank feeds
as gradients, and the predicate that keeps a shrunk case inside its family.

Modes (how the candidate sees its parameters; Adapter.distributed):
    single      plain tensors, one process (Adapter.distributed None; also run for distributed adapters)
    dtensor     DTensor Shard(0) over W ranks, torch.chunk boxes (5 rows on 4 ranks: 2, 2, 1, 0), as FSDP2 holds them
    replicated  the same plain tensor on every rank, and the same (already reduced) gradient: DDP after its all-reduce
    unreduced   the same plain tensor on every rank, and each rank's own gradient: the candidate owns the reduction
                (the mean over ranks, as DDP and ZeRO-1/2 compute it)

Families, each with the modes it applies to and the field bug it targets (docs/field-bugs.md):
    single: tall, wide, square, row (1 x n), primes, experts3d ([E, m, n]), conv4d (4-D, read as (out, in*kh*kw)
        by the reference: flatten=True); experts_fused ([E * m, n] with the param-group key num_experts = E, xtuner's
        layout: only for adapters that list it); nesterov_off (nesterov=False on both sides, for adapters that take
        it; bug 11: torch.optim.Muon 2.13 normalises its bf16 momentum buffer in place); micro_batches
        (MICRO_BATCHES micro-batches through autograd, then one step; bug 7); tiny (gradients times TINY = 2**-40:
        ||X|| below Newton-Schulz's eps, so a scale bug reaches the update).
    dtensor, the Hypothesis suite's families: even (rows % W == 0, W params), uneven (rows % W != 0, no empty box;
        rows and cols chosen so that padding rows to a multiple of W would flip the transpose decision), empty
        (rows < W: some rank holds nothing; bug 1), remainder (more params than W and not a multiple), experts (3-D
        [E, m, n], E % W != 0); and padded_scale (tall, rows % W != 0, no empty box: the lr scale of the rows padded
        to a multiple of W differs from the true one for every scale but "none"; bugs 4 and 5).
    replicated: even (W params), remainder (W + 1), mixed (W + 1 of one shape, W - 1 of another: a batch of W
        holds both; bug 3), experts.
    unreduced: the replicated families with per-rank gradients, and straddle (every boundary of W equal partitions
        of the params' concatenation falls inside a param: ZeRO-1/2's flat partitions; bug 6). Only for W a power of
        two, so that the mean is exact whatever the order of sums and the place of the division by W.
    dtensor, replicated, unreduced: badly_scaled (len(BADLY_SCALED) params, param i's gradients times
        BADLY_SCALED[i]: from 2**-40 to 2**16; a scale bug that Newton-Schulz's normalisation cancels at ordinary
        scales, e.g. a sum over W = 2 ranks taken for their mean, shows on the tiny ones).
    dtensor, replicated: asym_none (at step asym_step, param i < W - 1 has no gradient on rank (i + 1) % W only; bug 2).
    dtensor, replicated, unreduced: accumulation (micro_batches on W ranks; bug 7); checkpoint (save_step steps, a
        torch.distributed.checkpoint save at W, a fresh candidate loaded at W' = case.resume_world_size, the
        remaining steps; bug 8) and checkpoint_unstepped (the same, and the last param has no gradient on any rank
        before the save, as an expert that got no tokens yet: lazily created state has no keys for it; Dion #18).
    dtensor, the newer classes (14-27): row_sharded ([1, N] params at W >= 2: every rank but rank 0 holds an empty
        box, and dim 0 is shorter than the mesh; bug 25, vllm-project/speculators #821); resume_long (a
        torch.distributed.checkpoint save after LONG_SAVE = 257 steps and a resume at the same W <= 2, then one step;
        besides the params, every state tensor right after the load must have the dtype, device, shape and bits it
        had at the save: a step counter recast to bf16 on load reads 256 there, bug 18; a state reset on load,
        bug 17, fails it too); and, only for adapters that list it, fused_sharded (xtuner's fused experts
        [E * m, n] with num_experts = E on DTensor Shard(0), at world sizes whose torch.chunk boxes cut through an
        expert: NS run on each rank's box as if it held whole experts runs on slabs of them; bug 23).
(A family name belongs to one mode on one device and to the distributed modes, as experts3d and experts: an
adapter's `families` then says in which modes it runs.)
Gradients: seeded normal draws, the same on every rank (`gradients`), except where gradients are summed
(micro-batches, the ranks of unreduced mode): small integers times 2**-3 (`exact_gradient`), whose sums are exact
in bf16 and fp32, so that no order of summation can change a bit and the comparison stays bitwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..fixtures import box_of, seeded

SINGLE_FAMILIES = frozenset(
    {
        "tall",
        "wide",
        "square",
        "row",
        "primes",
        "experts3d",
        "conv4d",
        "micro_batches",
        "nesterov_off",
        "tiny",
    }
)
MATRIX_FAMILIES = frozenset({"tall", "wide", "square", "row", "primes", "tiny"})  # 2-D params only
FUSED_FAMILIES = frozenset({"experts_fused"})
DIST_FAMILIES = frozenset(
    {
        "badly_scaled",
        "even",
        "uneven",
        "empty",
        "remainder",
        "experts",
        "padded_scale",
        "asym_none",
        "accumulation",
        "checkpoint",
        "checkpoint_unstepped",
        "row_sharded",
        "resume_long",
    }
)
# dtensor families only for adapters that list them (their layout needs a param-group key: num_experts)
FUSED_DIST_FAMILIES = frozenset({"fused_sharded"})
REPLICATED_FAMILIES = frozenset(
    {
        "badly_scaled",
        "even",
        "remainder",
        "mixed",
        "experts",
        "asym_none",
        "accumulation",
        "checkpoint",
        "checkpoint_unstepped",
    }
)
UNREDUCED_FAMILIES = frozenset(
    {
        "badly_scaled",
        "even",
        "remainder",
        "mixed",
        "experts",
        "straddle",
        "accumulation",
        "checkpoint",
        "checkpoint_unstepped",
    }
)
CHECKPOINT_FAMILIES = frozenset({"checkpoint", "checkpoint_unstepped", "resume_long"})
# families whose state must survive the save and load unchanged (oracle.compare: Outcome.resumed)
STATE_ROUNDTRIP_FAMILIES = frozenset({"resume_long"})
ACCUMULATION_FAMILIES = frozenset({"micro_batches", "accumulation"})
MODE_FAMILIES = {
    "dtensor": DIST_FAMILIES | FUSED_DIST_FAMILIES,
    "replicated": REPLICATED_FAMILIES,
    "unreduced": UNREDUCED_FAMILIES,
}

# resume_long: the number of steps before its save. bf16 holds every integer up to 256 and then every second one,
# so a step counter cast to bf16 on load reads 256 for 257 (and stays there: 256 + 1 rounds back to 256).
LONG_SAVE = 257
# fused_sharded: experts of FUSED_ROWS rows (num_experts FUSED_EXPERTS); [10, 3] on W = 2 is cut 5 | 5, inside
# expert 2; on W = 4, 3 | 3 | 3 | 1 (W = 3 cuts 4 | 4 | 2, on expert boundaries: no case there)
FUSED_EXPERTS, FUSED_ROWS = 5, 2

# DeepSpeed #8443 compared 1 with 4 micro-batches (1.3e-1 relative difference under ZeRO-3)
MICRO_BATCHES = 4

_SINGLE_SHAPES = {
    "tall": ((12, 6),),
    "wide": ((6, 12),),
    "square": ((8, 8),),
    "row": ((1, 10),),
    "primes": ((13, 7),),
    "experts3d": ((3, 6, 4),),
    "conv4d": ((4, 3, 2, 2),),
    "experts_fused": ((4 * 3, 5),),
    "micro_batches": ((6, 4),),
    "nesterov_off": ((6, 8),),  # wide: not torch.optim.Muon's bf16 tall-matrix ulp
    "tiny": ((8, 6),),
}
# Gradient scales (powers of two: exact in every dtype) of the families whose gradients are tiny or badly scaled.
# Newton-Schulz divides by max(||X||, eps): for ordinary gradients a candidate that scales its gradient by a
# power of two (a sum over W = 2 or 4 ranks taken for their mean) gets the same update bits, and only its
# momentum shows it; at ||X|| < eps (eps 1e-7 or 1e-8 in every preset) the scale reaches the update.
TINY = 2.0**-40
BADLY_SCALED = (2.0**-40, 2.0**-24, 1.0, 2.0**16)
# options a family sets on both sides (param-group keys and hyperparameters of muon_ref; the adapter maps them to
# its own; a family whose option is a hyperparameter the adapter does not take is not run for it)
FAMILY_OPTIONS: dict[str, tuple[tuple[str, object], ...]] = {
    "experts_fused": (("num_experts", 4),),
    "nesterov_off": (("nesterov", False),),
    "fused_sharded": (("num_experts", FUSED_EXPERTS),),
}


@dataclass(frozen=True)
class Case:
    """mode: "single", or a key of MODE_FAMILIES (module docstring). device: where the candidate and the reference
    run ("cuda": ranks share the node's GPUs, gloo carrying CUDA tensors). options: hyperparameters and muon_ref
    options that the case sets on both sides, over the check's defaults (an adapter's variant, a family's options).
    resume_world_size: the checkpoint families' W' (the save is at world_size)."""

    family: str
    mode: str
    world_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtype: str = "float32"
    steps: int = 3
    seed: int = 0
    device: str = "cpu"
    options: tuple[tuple[str, object], ...] = ()
    resume_world_size: int | None = None

    def label(self) -> str:
        shapes = _shapes_label(self.shapes)
        ranks = (
            f"{self.world_size}->{self.resume_world_size}"
            if self.resume_world_size
            else f"{self.world_size}"
        )
        where = "1 device" if self.mode == "single" else f"W={ranks} {self.mode}"
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
    """The family's parameter shapes on W ranks (None when the family cannot exist on W ranks in this mode)."""
    if mode == "single":
        return _SINGLE_SHAPES[family]
    if family not in MODE_FAMILIES[mode] or (mode == "unreduced" and W & (W - 1)):
        return None
    if family in ("even", "accumulation"):
        return ((2 * W, 5),) * W
    if family == "badly_scaled":  # one param per scale of BADLY_SCALED, uneven boxes where W > 1
        return ((2 * W + 1, 4),) * len(BADLY_SCALED)
    if family == "remainder":
        return ((2 * W, 5),) * (W + 1) if W > 1 else None
    if family == "experts":
        return ((W + 1, 4, 3),) * W
    if family == "mixed":  # a batch of W straddles the two shapes when W > 1
        return ((6, 4),) * (W + 1) + ((3, 5),) * max(W - 1, 1)
    if family == "resume_long":
        # one small param, uneven boxes at W = 2; W <= 2 only: its 258 steps make it the slowest family
        return ((W + 1, 3),) if W <= 2 else None
    if family == "fused_sharded":
        shapes = ((FUSED_EXPERTS * FUSED_ROWS, 3),)
        return shapes if _boxes_cut_an_expert(shapes[0][0], FUSED_ROWS, W) else None
    if (
        family in CHECKPOINT_FAMILIES
    ):  # uneven boxes at W; tall at any W' even if padded; no remainder batch
        return ((2 * W + 1, 2),) * max(W, 2)
    if W == 1:  # the families below need several ranks
        return None
    return {
        "uneven": ((2 * W - 1, 2 * W - 1),)
        * W,  # no empty box; padded to 2W rows it would be transposed
        "empty": ((W - 1, 4),) * W,
        "padded_scale": ((3 * W - 1, 3),) * W,
        "asym_none": ((2 * W, 5),) * W,
        "straddle": ((3, 5),) * (W + 1),
        "row_sharded": ((1, 6),) * 2,
    }[family]


def in_family(case: Case) -> bool:
    """Does the case still exercise its family (the shrinker keeps only cases that do)?"""
    W, shapes, fam = case.world_size, case.shapes, case.family
    if not shapes or any(d < 1 for s in shapes for d in s):
        return False
    rows = [s[0] for s in shapes]
    if case.mode == "single":
        experts = dict(case.options).get("num_experts", 1)
        return {
            "tall": shapes[0][0] > shapes[0][1],
            "wide": shapes[0][0] < shapes[0][1],
            "square": shapes[0][0] == shapes[0][1],
            "row": shapes[0][0] == 1,
            "primes": all(_prime(d) for d in shapes[0]),
            "experts3d": len(shapes[0]) == 3,
            "conv4d": len(shapes[0]) == 4,
            "experts_fused": len(shapes[0]) == 2 and shapes[0][0] % experts == 0,
            "micro_batches": True,
            "nesterov_off": True,
            "tiny": True,
        }[fam]
    if case.mode == "unreduced" and W & (W - 1):
        return False
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
    if fam == "padded_scale":
        return all(
            len(s) == 2 and s[0] > s[1] and s[0] % W != 0 and s[0] > math.ceil(s[0] / W) * (W - 1)
            for s in shapes
        )
    if fam == "straddle":
        return W > 1 and _every_partition_boundary_inside_a_param(shapes, W)
    if fam == "asym_none":
        return W > 1
    if fam == "checkpoint_unstepped":
        return len(shapes) > 1
    if fam == "row_sharded":
        return W > 1 and all(len(s) == 2 and s[0] == 1 for s in shapes)
    if fam == "resume_long":
        return case.steps > LONG_SAVE and case.resume_world_size == W <= 2
    if fam == "fused_sharded":
        experts = dict(case.options).get("num_experts", 1)
        return all(
            len(s) == 2 and s[0] % experts == 0 and _boxes_cut_an_expert(s[0], s[0] // experts, W)
            for s in shapes
        )
    if fam == "badly_scaled":
        return len(shapes) > 1
    return fam in ("accumulation", "checkpoint") or (fam == "mixed" and len(set(shapes)) > 1)


def _every_partition_boundary_inside_a_param(shapes: tuple[tuple[int, ...], ...], W: int) -> bool:
    """The params flattened and concatenated, cut into W partitions of ceil(total / W) elements (ZeRO-1/2's flat
    partitions, DeepSpeed stage_1_and_2.py): every cut lies strictly inside one param."""
    ends = [0]
    for s in shapes:
        ends.append(ends[-1] + math.prod(s))
    part = math.ceil(ends[-1] / W)
    return all(any(a < k * part < b for a, b in zip(ends, ends[1:])) for k in range(1, W))


def _boxes_cut_an_expert(rows: int, expert_rows: int, W: int) -> bool:
    """Does some boundary of torch.chunk's W row boxes of `rows` rows fall inside an expert of `expert_rows` rows?"""
    c = math.ceil(rows / W)
    return any(0 < k * c < rows and (k * c) % expert_rows for k in range(1, W))


def _prime(n: int) -> bool:
    return n > 1 and all(n % k for k in range(2, int(n**0.5) + 1))


def default_cases(
    families: frozenset[str],
    mode: str | None,
    world_sizes: tuple[int, ...],
    dtypes: tuple[str, ...],
    steps: int,
    device: str = "cpu",
    variants: tuple[dict[str, object], ...] = ({},),
) -> list[Case]:
    """Every supported single-device family, then every family of the adapter's mode on every world size; each in
    every dtype and every variant (options over the check's defaults). A checkpoint case saved at W resumes at the
    next world size of the list (the first after the last; W itself when there is one); resume_long resumes at W
    and runs LONG_SAVE + 1 steps whatever `steps` says."""

    def made(
        family: str, mode: str, W: int, shapes: tuple, resume: int | None = None
    ) -> list[Case]:
        return [
            Case(
                family,
                mode,
                W,
                shapes,
                d,
                LONG_SAVE + 1 if family == "resume_long" else steps,
                device=device,
                resume_world_size=resume,
                options=FAMILY_OPTIONS.get(family, ()) + tuple(v.items()),
            )
            for v in variants
            for d in dtypes
        ]

    cases = [
        c
        for f in sorted(families & (SINGLE_FAMILIES | FUSED_FAMILIES))
        for c in made(f, "single", 1, _SINGLE_SHAPES[f])
    ]
    if mode is None:
        return cases
    for i, W in enumerate(world_sizes):
        for f in sorted(families & MODE_FAMILIES[mode]):
            shapes = family_shapes(f, mode, W)
            resume = world_sizes[(i + 1) % len(world_sizes)] if f in CHECKPOINT_FAMILIES else None
            resume = W if f == "resume_long" else resume  # the state is compared box by box
            if shapes is not None and (
                resume is None or family_shapes(f, mode, resume) is not None
            ):
                cases += made(f, mode, W, shapes, resume)
    return cases


def initial_params(case: Case) -> list[torch.Tensor]:
    """The full initial parameters on the case's device: the same on every rank and in the parent (seeded per
    param, drawn on the CPU)."""
    return [
        seeded(s, case.seed * 7919 + i, case.dtype, case.device) for i, s in enumerate(case.shapes)
    ]


def gradient_scale(case: Case, index: int) -> float:
    """The power of two that param `index`'s gradients are drawn times: TINY for tiny, BADLY_SCALED in turn for
    badly_scaled, 1 elsewhere."""
    if case.family == "tiny":
        return TINY
    if case.family == "badly_scaled":
        return BADLY_SCALED[index % len(BADLY_SCALED)]
    return 1.0


def gradients(case: Case, step: int) -> list[torch.Tensor]:
    """The full gradients of a step: the same on every rank and in the parent (seeded per step and param, times
    gradient_scale: exact)."""
    return [
        seeded(s, case.seed * 104729 + 1000 * step + i + 1, case.dtype, case.device)
        * gradient_scale(case, i)
        for i, s in enumerate(case.shapes)
    ]


def exact_gradient(
    shape: tuple[int, ...], seed: int, dtype: str, device: str = "cpu"
) -> torch.Tensor:
    """Integers in [-8, 8] times 2**-3, drawn from a generator seeded with `seed` on the CPU. Any partial sum of up
    to 32 of them (W <= 8 ranks of MICRO_BATCHES) is k * 2**-3 with |k| <= 256, exact in bf16 (every integer up to
    256 is one) and fp32, and so is its division by a power of two."""
    ints = torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(seed))
    return (ints.to(torch.float64) * 2.0**-3).to(device, getattr(torch, dtype))


def asym_step(case: Case) -> int:
    """The step of the asym_none family at which some ranks have no gradient (the second, when there is one)."""
    return min(1, case.steps - 1)


def save_step(case: Case) -> int:
    """The number of steps before the checkpoint families' save (the rest run after the resume): LONG_SAVE for
    resume_long, else half (rounded up)."""
    return LONG_SAVE if case.family == "resume_long" else (case.steps + 1) // 2


def world_at(case: Case, step: int) -> int:
    """The number of ranks that run `step`: resume_world_size after the checkpoint family's save, else world_size."""
    return (
        case.resume_world_size
        if case.family in CHECKPOINT_FAMILIES and step >= save_step(case)
        else case.world_size
    )


def _missing(case: Case, step: int, rank: int) -> set[int]:
    """The params without a gradient on `rank` at `step` (module docstring: asym_none, checkpoint_unstepped)."""
    if case.family == "asym_none" and step == asym_step(case):
        return {
            i
            for i in range(min(len(case.shapes), case.world_size - 1))
            if rank == (i + 1) % case.world_size
        }
    if case.family == "checkpoint_unstepped" and step < save_step(case):
        return {len(case.shapes) - 1}
    return set()


def _summed(case: Case) -> bool:
    return case.mode == "unreduced" or case.family in ACCUMULATION_FAMILIES


def rank_gradients(case: Case, step: int, rank: int) -> list[list[torch.Tensor | None]]:
    """What `rank` feeds at `step`: per micro-batch, per param, the full gradient (None: this rank has none).

    One micro-batch, except MICRO_BATCHES for micro_batches and accumulation. The same full gradient on every rank,
    except in unreduced mode, where each rank draws its own (the candidate reduces them: oracle_gradients).
    """
    missing = _missing(case, step, rank)
    if not _summed(case):
        return [[None if i in missing else g for i, g in enumerate(gradients(case, step))]]
    drawer = rank if case.mode == "unreduced" else 0
    return [
        [
            None
            if i in missing
            else exact_gradient(s, _seed(case, step, micro, drawer, i), case.dtype, case.device)
            * gradient_scale(case, i)
            for i, s in enumerate(case.shapes)
        ]
        for micro in range(MICRO_BATCHES if case.family in ACCUMULATION_FAMILIES else 1)
    ]


def _seed(case: Case, step: int, micro: int, rank: int, index: int) -> int:
    return case.seed * 104729 + 1000 * step + 100 * micro + 10_000_000 * (rank + 1) + index + 1


NONE_POLICIES = ("skip", "raise")


def oracle_gradients(case: Case, step: int, policy: str = "skip") -> list[torch.Tensor | None]:
    """The full gradient muon_ref steps on (None: the param does not step).

    Equations, per param i: the sum of its micro-batches, and in unreduced mode the mean over the world_at(step)
    ranks' sums (exact: exact_gradient). A param without a gradient on some rank at this step has none here under
    policy "skip" (the step skips it on every rank); under "raise" no param has one (the step raised on every rank
    before writing anything, so nothing changed).
    """
    ranks = range(world_at(case, step)) if case.mode == "unreduced" else range(1)
    fed = [rank_gradients(case, step, r) for r in ranks]
    missing = set().union(*(_missing(case, step, r) for r in range(world_at(case, step))))
    if policy == "raise" and missing:
        return [None] * len(case.shapes)
    out = []
    for i in range(len(case.shapes)):
        terms = [micro[i] for per_rank in fed for micro in per_rank]
        if i in missing:
            out.append(None)
        elif len(terms) == 1:
            out.append(terms[0])
        else:
            out.append(torch.stack(terms).sum(0) / len(ranks))
    return out


def placement(case: Case) -> str:
    """The fixtures' placement of every param of the case, on a 1-D "fsdp" mesh of case.world_size ranks."""
    return "S0" if case.mode == "dtensor" else "plain"


def local_box(
    full: torch.Tensor, case: Case, rank: int, world_size: int | None = None
) -> torch.Tensor:
    """What `rank` of `world_size` (default: the case's) holds of `full`: torch.chunk's chunk along dim 0 for
    dtensor, else all of it."""
    return box_of(full, placement(case), "fsdp", rank, world_size or case.world_size)


def smaller(case: Case) -> list[Case]:
    """Candidates one shrinking move away, simplest first: fewer steps, fewer params, smaller dims."""
    out = [replace(case, steps=s) for s in range(1, case.steps)]
    if len(case.shapes) > 1:
        out += [replace(case, shapes=case.shapes[:-1]), replace(case, shapes=case.shapes[1:])]
    for dim in range(len(case.shapes[0]) if case.shapes else 0):
        for shrink in (lambda d: d // 2, lambda d: d - 1):
            shapes = tuple(
                s[:dim] + (shrink(s[dim]),) + s[dim + 1 :] if s == case.shapes[0] else s
                for s in case.shapes
            )
            out.append(replace(case, shapes=shapes))
    return [c for c in out if c != case and in_family(c)]
