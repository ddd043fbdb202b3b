"""The plan checker: every layout of a bounded space through the real planner and the real paths.

For each case (world size W <= 8, a run of same-layout params of one shape and placement, a batch count that
leaves remainders or not, each remainder option), every rank builds its layouts and runs muon_dist.plan.plan;
then the paths of the plan run on ranks-as-threads (muon_dist.ThreadComm) with *labelled* data: the
direction of param k is the float64 tensor of its global linear indices plus 1 + k * numel (never zero, so
the padded path's zero matrices are told apart), and the kernel records its input and returns 2 x + 1. Invariants checked (proofs/paths.md#plan, #a2a ... #replicated):
    I1  all ranks derive the same plan (equal digests);
    I2  every active param is orthogonalised by exactly one rank (one kernel call per param over all ranks),
        and the only other kernel calls are the padded path's zero matrices, as many as the plan pads;
    I3  the owner's kernel input is exactly the global matrix: every element arrives once, in place, unpadded;
    I4  every rank gets back exactly its box of the kernel's output for every param;
    I5  the bytes each rank's comm counted equal the formula of muon_dist.plan.expected_bytes.
Labels are exact in float64 (indices < 2^53), so any misrouted, duplicated or missing element is visible.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from muon_dist import Entry, Group, Options, ParamLayout, ThreadComm, ThreadWorld, expected_bytes
from muon_dist import plan as real_plan
from muon_dist.paths import RUNNERS

DTYPE = torch.float64
ITEMSIZES = {str(DTYPE): 8}


@dataclass(frozen=True)
class Case:
    world_size: int
    shape: tuple[int, int]
    placement: str  # "S0", "S1" or "R"
    count: int
    options: Options


def cases(max_world: int = 8) -> Iterator[Case]:
    """Dims 1 (empty shards for W > 1), W (even) and W + 1 (uneven; empty shards for W >= 3), counts 1 and
    W + 1 (a remainder alone; a full batch and a remainder), every placement, and both remainder paths."""
    for W in range(1, max_world + 1):
        dims = sorted({1, W, W + 1})
        for shape in itertools.product(dims, dims):
            for placement in ("S0", "S1", "R"):
                for count in sorted({1, W + 1}):
                    remainders = ("agrs", "padded_all_to_all") if count % W and placement != "R" else ("agrs",)
                    for remainder in remainders:
                        yield Case(W, shape, placement, count, Options(remainder=remainder))


def layout_for(name: str, shape: tuple[int, int], placement: str, world_size: int, rank: int) -> ParamLayout:
    base = ParamLayout(name, shape, str(DTYPE), tuple(range(world_size)), ("fsdp",), (placement,), None, False,
                       rank, (), ())
    offset, local = base.box(base.group_ranks().index(rank))
    return ParamLayout(*base.signature(), rank, local, offset)


def label(k: int, shape: tuple[int, int]) -> torch.Tensor:
    numel = shape[0] * shape[1]
    return (torch.arange(numel, dtype=DTYPE) + 1 + k * numel).reshape(shape)


def box(full: torch.Tensor, layout: ParamLayout) -> torch.Tensor:
    d = layout.shard_dim
    return full if d is None else full.narrow(d, layout.global_offset[d], layout.local_shape[d])


def _rank_main(case: Case, rank: int, world: ThreadWorld, planner: Callable, calls: Counter, out: dict) -> None:
    comm = ThreadComm(world, rank)
    layouts = [layout_for(f"p{k}", case.shape, case.placement, case.world_size, rank) for k in range(case.count)]
    step_plan = planner(tuple(Entry(lay, 0, str(DTYPE), True) for lay in layouts), case.options)
    failures, updates = [], {}
    for batch in step_plan.batches:
        lay = layouts[batch.params[0]]

        def kernel(full: torch.Tensor, batch=batch) -> torch.Tensor:
            k = next((i for i in batch.params if torch.equal(full, label(i, case.shape))), None)
            if k is None and batch.num_padding and torch.count_nonzero(full) == 0:
                calls["padding"] += 1
            elif k is None:
                failures.append(f"I3: rank {rank} got a matrix that is no param's global matrix: {full.tolist()}")
            else:
                calls[k] += 1
            return 2 * full + 1

        group = Group(lay.group_ranks())
        outs = RUNNERS[batch.path](comm, group, [box(label(i, case.shape), layouts[i]) for i in batch.params],
                                   lay, kernel, DTYPE)
        updates.update(zip(batch.params, outs))
    for k, lay in enumerate(layouts):
        if k not in updates or not torch.equal(updates[k], box(2 * label(k, case.shape) + 1, lay)):
            failures.append(f"I4: rank {rank} did not get back its box of param {k}")
    want = expected_bytes(step_plan, ITEMSIZES)
    got = {path: (sent, received) for path, (sent, received) in comm.ledger.items()}
    if got != want:
        failures.append(f"I5: rank {rank} counted {got}, the formula says {want}")
    out[rank] = (step_plan.digest(), failures)
    out["num_padding"] = sum(b.num_padding for b in step_plan.batches)


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
    if sorted(calls.elements()) != list(range(case.count)):
        failures.append(f"I2: kernel calls per param {dict(calls)}, want one each for {case.count} params")
    if padding != out.get("num_padding", padding):
        failures.append(f"I2: {padding} kernel calls on padding, the plan pads {out['num_padding']}")
    return [f"{case}: {f}" for f in failures]


def check_plans(planner: Callable = real_plan, max_world: int = 8) -> list[str]:
    """Run every case; print a one-line summary; return the failures."""
    failures, n = [], 0
    for case in cases(max_world):
        failures += check_case(case, planner)
        n += 1
    print(f"  plan checker: {n} cases (W <= {max_world}, placements S0/S1/R, even, uneven and empty shards, "
          f"remainders via agrs and padded_all_to_all): {len(failures)} failures")
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
