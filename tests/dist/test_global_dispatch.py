"""dispatch="global": every sharded Muon param of a step goes, in one ragged all-to-all each way per shard group
and dtype pair, to the owner that LPT on Newton-Schulz FLOPs gives it (muon_dist/paths/global_all_to_all.py);
the step equals muon_ref bitwise, moves exactly the lower bound, and balances no worse than per-shape batches."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import example, given, settings

from muon_check.fixtures import box_of
from muon_dist import Entry, Options, plan
from muon_dist.agreement import CHECKS
from muon_dist.balance import lpt, ns_flops
from tests.conftest import examples

from .batches import layout_1d
from .checks import run_case, run_unchecked, timeout_for
from .test_equivalence import cases
from .workers import Case

GLOBAL = (
    ("dispatch", "global"),
    ("rounds", 1),
)  # one merged batch (rounds: tests/dist/test_plan.py)


def _global(drawn: tuple[int, Case]) -> tuple[int, Case]:
    world_size, case = drawn
    return world_size, dataclasses.replace(case, options=GLOBAL)


def _data_calls(result: dict) -> list[tuple[str, str]]:
    return [
        c for c in result["calls"] if c[0] not in CHECKS
    ]  # the step's checks are not data collectives


@pytest.mark.timeout(timeout_for(60))
@example(
    drawn=(4, Case(((5, 3),) * 2 + ((3, 9),) * 5, ("S0",) * 2 + ("S1",) * 5, options=GLOBAL))
)  # empty box
@example(
    drawn=(
        3,
        Case(
            ((2, 7),) * 4 + ((4, 4),),
            ("S1",) * 4 + ("plain",),
            "bfloat16",
            "keller",
            options=GLOBAL,
        ),
    )
)
@example(
    drawn=(4, Case(((3, 4, 5),) * 5 + ((7, 5),) * 3, ("S0",) * 8, options=GLOBAL))
)  # experts stay local
@example(
    drawn=(4, Case(((6, 5),) * 4, ("S0",) * 4, overrides=(("num_experts", 2),), options=GLOBAL))
)  # fallback
@settings(max_examples=examples(0.75))
@given(drawn=cases().map(_global))
def test_global_dispatch_equals_reference_bitwise_with_two_collectives_per_step(
    drawn: tuple[int, Case],
) -> None:
    world_size, case = drawn
    results = run_case(
        world_size, case
    )  # bitwise params and buffers, paths as planned, bytes == expected_bytes
    for r in (
        results
    ):  # one shard group and one dtype pair per case: 2 data collectives, or none (a group of one)
        moved = any(p == "global_all_to_all" for _, p in r["paths"]) and world_size > 1
        calls = [c for c in _data_calls(r) if c[0] == "global_all_to_all"]
        assert calls == [("global_all_to_all", "all_to_all")] * (2 if moved else 0), calls


def _owners(shapes: list[tuple[int, int]], W: int) -> list[int]:
    """The planner's rule restated: LPT on one NS run per 2-D matrix."""
    return lpt([ns_flops(*s) for s in shapes], W)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 4])
def test_global_dispatch_moves_exactly_the_lower_bound_on_every_rank(world_size: int) -> None:
    """Per param and rank (fp32 both ways): the owner receives what it lacks and sends it back; every other member
    sends its box and receives its box back. 5 rows on 4 ranks hold 2, 2, 1, 0 rows (an empty box)."""
    W = world_size
    shapes = [(2 * W, 3)] * 3 + [(5, 6)] * 2 + [(3, 4 * W)] * 2
    placements = ("S0",) * 5 + ("S1",) * 2
    results = run_case(
        W, Case(tuple(shapes), placements, overrides=(("ns_dtype", None),), options=GLOBAL)
    )
    owners = _owners(shapes, W)
    for rank, r in enumerate(results):
        boxes = [
            box_of(torch.zeros(s), pl, "fsdp", rank, W).numel() for s, pl in zip(shapes, placements)
        ]
        bound = sum(
            math.prod(s) - b if owners[k] == rank else b
            for k, (s, b) in enumerate(zip(shapes, boxes))
        )
        assert r["bytes"]["global_all_to_all"] == (4 * bound, 4 * bound), (rank, r["bytes"], bound)
        assert _data_calls(r) == [("global_all_to_all", "all_to_all")] * 2, _data_calls(r)
    even = (
        3 * 2 * W * 3 + 2 * 3 * 4 * W
    )  # the matrices with even boxes: 2 (W - 1) / W of them over all ranks
    total = sum(r["bytes"]["global_all_to_all"][0] for r in results)
    uneven = sum(
        2 * (30 - box_of(torch.zeros(5, 6), "S0", "fsdp", owners[k], W).numel()) for k in (3, 4)
    )
    assert total == 4 * (2 * (W - 1) * even // W + uneven)


def _entry(rank: int, W: int, shape: tuple[int, int]) -> Entry:
    return Entry(layout_1d(shape, "S0", W, "torch.float32"), 0, "torch.float32", True)


def _loads(step_plan, W: int) -> list[int]:
    """Assigned NS FLOPs per member: owners on global_all_to_all, member k for param k of a batched batch."""
    loads = [0] * W
    for batch in step_plan.batches:
        for k, i in enumerate(batch.params):
            owner = batch.owners[k] if batch.owners else k
            loads[owner] += ns_flops(*step_plan.entries[i].layout.global_shape)
    return loads


@pytest.mark.timeout(30)
def test_lpt_owners_balance_no_worse_than_per_shape_batches() -> None:
    """A transformer-like mix on 4 ranks: per-shape batches put every remainder on members 0..R-1."""
    W = 4
    shapes = (
        [(512, 512)] * 6 + [(512, 2048)] * 3 + [(2048, 512)] * 3 + [(128, 512)] * 2 + [(64, 64)] * 5
    )
    entries = tuple(_entry(0, W, s) for s in shapes)
    batched, glob = plan(entries, Options()), plan(entries, Options(dispatch="global", rounds=1))
    assert [b.path for b in glob.batches] == ["global_all_to_all"]
    assert max(_loads(glob, W)) <= max(_loads(batched, W)), (_loads(glob, W), _loads(batched, W))
    assert max(_loads(glob, W)) < max(_loads(batched, W))  # this mix: strictly better
    again = plan(tuple(_entry(3, W, s) for s in shapes), Options(dispatch="global", rounds=1))
    assert (
        again.batches == glob.batches and again.digest() == glob.digest()
    )  # the same owners on every rank
    assert glob.digest() != batched.digest()


@pytest.mark.timeout(30)
def test_global_dispatch_refuses_a_forced_path_and_unknown_modes() -> None:
    with pytest.raises(ValueError, match="force_path"):
        Options(force_path="agrs", dispatch="global")
    with pytest.raises(ValueError, match="dispatch"):
        Options(dispatch="ragged")


@pytest.mark.timeout(60)
def test_boxes_packed_in_another_order_than_unpacked_fail_the_equality_check() -> None:
    """Two same-shape params per owner, sent forward in the reverse of their travel order (batch.travel_order) and
    received in travel order: each owner runs its kernels on the other param's matrix. (Reversed both ways it would
    only relabel, and stay bitwise.)"""
    case = Case(((4, 3),) * 4, ("S0",) * 4, options=GLOBAL, sabotage="global_send_order")
    results = run_unchecked(2, case)
    assert any(r["differing"] for r in results), (
        "the sabotaged step still equals muon_ref: the check is blind"
    )
