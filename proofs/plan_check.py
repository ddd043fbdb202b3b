"""The plan checker: every layout of a bounded space through the real planner and the real paths.

For each case (world size W <= 8, a run of same-layout params of one shape and placement, a batch count that
leaves remainders or not, each remainder option), every rank builds its layouts and runs muon_dist.plan.plan;
then the paths of the plan run on ranks-as-threads (muon_dist.ThreadComm) with *labelled* data: the
direction of param k is the float64 tensor of its global linear indices plus 1 + k * numel (never zero, so
the padded path's zero matrices are told apart), and the kernel records its input and returns 2 x + 1. Invariants checked (proofs/paths.md#plan, #a2a ... #replicated):
    I1  all ranks derive the same plan (equal digests);
    I2  every matrix (every expert of an expert stack) is orthogonalised by exactly one rank (by each member of
        its component on the subgroup_all_gather path, by design), and the only other kernel calls are the
        padded path's zero matrices, as many as the plan pads;
    I3  every kernel input is exactly a run of whole matrices of one param, in place and unpadded (the whole
        param except on the expert paths local and subgroup_all_gather);
    I4  every rank gets back exactly its box of the kernel's output for every param;
    I5  the bytes each rank's comm counted equal the formula of muon_dist.plan.expected_bytes.
Labels are exact in float64 (indices < 2^53), so any misrouted, duplicated or missing element is visible.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from muon_dist import Entry, Group, Options, ParamLayout, ThreadComm, ThreadWorld, expected_bytes
from muon_dist import plan as real_plan
from muon_dist.paths import PATHS

DTYPE = torch.float64
PARTIAL_PATHS = (
    "local",
    "subgroup_all_gather",
)  # their kernel calls see whole experts, not the whole param
ITEMSIZES = {str(DTYPE): 8}


@dataclass(frozen=True)
class Case:
    world_size: int
    shape: tuple[int, ...]
    placement: str  # "S0", "S1" or "R"; expert cases: "S0" on both axes of an (ep, fsdp) mesh
    count: int
    options: Options
    ep: int | None = None  # expert cases: the mesh is (ep, world_size // ep)
    num_experts: int | None = None  # fused [E * m, n] expert bundles

    @property
    def matrix_numel(self) -> int:
        """Elements of one matrix: one expert of an expert stack, else the whole param."""
        if self.num_experts:
            return self.shape[0] * self.shape[1] // self.num_experts
        return (
            self.shape[1] * self.shape[2] if len(self.shape) == 3 else self.shape[0] * self.shape[1]
        )


def cases(max_world: int = 8) -> Iterator[Case]:
    """Dims 1 (empty shards for W > 1), W (even) and W + 1 (uneven; empty shards for W >= 3), counts 1 and
    W + 1 (a remainder alone; a full batch and a remainder), every placement, and both remainder paths."""
    for W in range(1, max_world + 1):
        dims = sorted({1, W, W + 1})
        for shape in itertools.product(dims, dims):
            for placement in ("S0", "S1", "R"):
                for count in sorted({1, W + 1}):
                    remainders = (
                        ("agrs", "padded_all_to_all")
                        if count % W and placement != "R"
                        else ("agrs",)
                    )
                    for remainder in remainders:
                        yield Case(W, shape, placement, count, Options(remainder=remainder))
    yield from expert_cases(max_world)


def expert_cases(max_world: int = 8) -> Iterator[Case]:
    """E in {1, 3, 4, 16} experts of m in {2, 4} rows (3-D [E, m, 2] and fused [E m, 2]) on every (ep, fsdp)
    mesh with ep, fsdp in {1, 2, 4, 8} and ep * fsdp <= max_world, one param or W + 1 of them: every expert path
    (local, subgroup_all_gather, the fallback) and E % ep != 0."""
    for ep, fsdp in itertools.product((1, 2, 4, 8), repeat=2):
        W = ep * fsdp
        if W > max_world or W == 1:
            continue
        for E, m, fused, count in itertools.product(
            (1, 3, 4, 16), (2, 4), (False, True), (1, W + 1)
        ):
            shape = (E * m, 2) if fused else (E, m, 2)
            yield Case(W, shape, "S0", count, Options(), ep=ep, num_experts=E if fused else None)


def layout_for(name: str, case: Case) -> ParamLayout:
    W = case.world_size
    if case.ep is None:
        return ParamLayout(
            name, case.shape, str(DTYPE), tuple(range(W)), (case.placement,), ("fsdp",)
        )
    fsdp = W // case.ep
    mesh = tuple(tuple(range(i * fsdp, (i + 1) * fsdp)) for i in range(case.ep))
    return ParamLayout(
        name, case.shape, str(DTYPE), mesh, ("S0", "S0"), ("ep", "fsdp"), case.num_experts
    )


def label(k: int, shape: tuple[int, ...]) -> torch.Tensor:
    numel = math.prod(shape)
    return (torch.arange(numel, dtype=DTYPE) + 1 + k * numel).reshape(shape)


def whole_matrices(full: torch.Tensor, case: Case) -> tuple[int, range] | None:
    """(param k, the matrices it covers) when `full` is exactly a run of whole matrices of param k, else None."""
    first = int(full.reshape(-1)[0].item()) - 1 if full.numel() else -1
    numel = math.prod(case.shape)
    k, offset = divmod(first, numel) if first >= 0 else (-1, 0)
    unit = case.matrix_numel
    if (
        not 0 <= k < case.count
        or offset % unit
        or full.numel() % unit
        or offset + full.numel() > numel
    ):
        return None
    if not torch.equal(
        full.reshape(-1), label(k, case.shape).reshape(-1)[offset : offset + full.numel()]
    ):
        return None
    return k, range(offset // unit, (offset + full.numel()) // unit)


def box(full: torch.Tensor, layout: ParamLayout, rank: int) -> torch.Tensor:
    geometry = layout.geometry
    return full[geometry.boxes[geometry.member(rank)].index].contiguous()


def _rank_main(
    case: Case, rank: int, world: ThreadWorld, planner: Callable, calls: Counter, out: dict
) -> None:
    comm = ThreadComm(world, rank)
    layouts = [layout_for(f"p{k}", case) for k in range(case.count)]
    step_plan = planner(tuple(Entry(lay, 0, str(DTYPE), True) for lay in layouts), case.options)
    failures, updates = [], {}
    for batch in step_plan.batches:
        lay = layouts[batch.params[0]]
        num_padding = (
            batch.group_size - len(batch.params) if batch.path == "padded_all_to_all" else 0
        )

        def kernel(full: torch.Tensor, frame, batch=batch, num_padding=num_padding) -> torch.Tensor:
            if (
                full.numel() == 0 and batch.path in PARTIAL_PATHS
            ):  # a rank holding no expert of this param
                return 2 * full + 1
            run = whole_matrices(full, case)
            whole = run is not None and (batch.path in PARTIAL_PATHS or full.shape == case.shape)
            if not whole and num_padding and torch.count_nonzero(full) == 0:
                calls["padding"] += 1
            elif not whole or run[0] not in batch.params:
                failures.append(
                    f"I3: rank {rank} ({batch.path}) got {tuple(full.shape)} that is not whole "
                    f"matrices of a param of its batch: {full.reshape(-1)[:8].tolist()}"
                )
            else:
                calls.update((run[0], e, batch.path) for e in run[1])
            return 2 * full + 1

        group = Group(lay.geometry.group_of(rank))
        outs = PATHS[batch.path].run(
            comm,
            group,
            batch,
            [box(label(i, case.shape), layouts[i], rank) for i in batch.params],
            [kernel] * len(batch.params),
        )
        updates.update(zip(batch.params, outs))
    for k, lay in enumerate(layouts):
        if k not in updates or not torch.equal(
            updates[k], box(2 * label(k, case.shape) + 1, lay, rank)
        ):
            failures.append(f"I4: rank {rank} did not get back its box of param {k}")
    want = expected_bytes(step_plan, rank, ITEMSIZES)
    got = {path: (sent, received) for path, (sent, received) in comm.ledger.items()}
    if got != want:
        failures.append(f"I5: rank {rank} counted {got}, the formula says {want}")
    out[rank] = (step_plan.digest(), failures)
    out["num_padding"] = sum(
        b.group_size - len(b.params) for b in step_plan.batches if b.path == "padded_all_to_all"
    )


def check_case(case: Case, planner: Callable = real_plan) -> list[str]:
    """Failures of the invariants I1-I5 for one case (empty: they hold)."""
    world, calls, out = ThreadWorld(case.world_size, timeout_s=20), Counter(), {}
    errors: list[str] = []

    def main(rank: int) -> None:
        try:
            _rank_main(case, rank, world, planner, calls, out)
        except Exception as e:  # noqa: BLE001 - a crash of the planner or a path is a failure of the case
            errors.append(f"rank {rank} raised {type(e).__name__}: {e}")

    threads = [threading.Thread(target=main, args=(r,)) for r in range(case.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        return [f"{case}: {e}" for e in errors]
    ranks = [out[r] for r in range(case.world_size)]
    failures = [f for _, fs in ranks for f in fs]
    if len({digest for digest, _ in ranks}) != 1:
        failures.append("I1: the ranks' plan digests differ")
    padding = calls.pop("padding", 0)
    matrices = case.num_experts or (case.shape[0] if len(case.shape) == 3 else 1)
    per_matrix = Counter()
    for (k, e, path), n in calls.items():
        per_matrix[k, e] += n
        if n != 1 and path != "subgroup_all_gather":
            failures.append(f"I2: matrix {e} of param {k} orthogonalised {n} times on {path}")
    missing = [(k, e) for k in range(case.count) for e in range(matrices) if not per_matrix[k, e]]
    if missing or len(per_matrix) != case.count * matrices:
        failures.append(
            f"I2: matrices never orthogonalised: {missing[:5]} (or foreign ones: {len(per_matrix)})"
        )
    if padding != out.get("num_padding", padding):
        failures.append(
            f"I2: {padding} kernel calls on padding, the plan pads {out['num_padding']}"
        )
    return [f"{case}: {f}" for f in failures]


def check_plans(planner: Callable = real_plan, max_world: int = 8) -> list[str]:
    """Run every case; print a one-line summary; return the failures."""
    failures, n = [], 0
    for case in cases(max_world):
        failures += check_case(case, planner)
        n += 1
    print(
        f"  plan checker: {n} cases (W <= {max_world}; matrices on S0/S1/R with even, uneven and empty shards "
        f"and remainders via agrs and padded_all_to_all; experts E in 1, 3, 4, 16 on (ep, fsdp) meshes, 3-D "
        f"and fused): {len(failures)} failures"
    )
    return failures[:20]


def dropping_remainder_planner(entries: tuple, options: Options):
    """A deliberately broken planner (negative control): the real plan without its remainder batches, built
    without running Plan's own invariant check, so that only the plan checker can catch it."""
    plan = real_plan(entries, options)
    return _unchecked(plan, batches=tuple(b for b in plan.batches if len(b.params) == b.group_size))


def _unchecked(plan, **changes):
    """A copy of a frozen Plan with `changes`, skipping __post_init__."""
    clone = object.__new__(type(plan))
    for name, value in {**vars(plan), **changes}.items():
        object.__setattr__(clone, name, value)
    return clone


BROKEN_CASE = Case(world_size=4, shape=(5, 3), placement="S0", count=5, options=Options())
