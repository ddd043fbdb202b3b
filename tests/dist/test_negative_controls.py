"""Negative controls: deliberately broken distributed steps are caught by the bitwise equality check."""

from __future__ import annotations

import pytest

from muon_dist.agreement import CHECKS

from .checks import run_case, run_unchecked
from .workers import Case


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "world_size, case",
    [
        # Dion's bug: rows padded to a multiple of W inside NS; (5, 6) padded to (8, 6) flips the transpose
        (4, Case(((5, 6),) * 5, ("S0",) * 5, sabotage="ns_on_padded")),
        # a remainder batch that is never orthogonalised
        (
            4,
            Case(
                ((5, 3),) * 5,
                ("S0",) * 5,
                sabotage="drop_remainder",
                options=(("dispatch", "batched"),),
            ),
        ),
        # bf16 momentum/update run on the shard as if it were the whole tensor (vector body vs scalar tail)
        (
            3,
            Case(
                ((2, 40),) * 3,
                ("S1",) * 3,
                dtype="bfloat16",
                preset="keller",
                sabotage="naive_elementwise",
            ),
        ),
    ],
    ids=["ns_on_padded", "drop_remainder", "naive_elementwise"],
)
def test_a_broken_path_fails_the_equality_check(world_size: int, case: Case) -> None:
    results = run_unchecked(world_size, case)
    assert any(r["differing"] for r in results), (
        "the sabotaged step still equals muon_ref: the check is blind"
    )


@pytest.mark.timeout(60)
def test_kernel_work_beyond_the_plan_fails_the_flops_check() -> None:
    """The plan's per-rank Newton-Schulz FLOPs (muon_dist.expected_flops, from each path's work) are checked against
    the kernel calls each rank makes in every run_case: a backend that runs each kernel twice keeps the bits and
    the bytes, and only that check catches it."""
    case = Case(((5, 3),) * 5, ("S0",) * 5, sabotage="ns_twice")
    results = run_unchecked(4, case)
    assert not any(r["differing"] for r in results)
    assert all(r["flops"] == 2 * r["expected_flops"] for r in results)
    assert any(r["expected_flops"] for r in results)
    with pytest.raises(AssertionError, match="NS FLOPs"):
        run_case(4, case)


@pytest.mark.timeout(60)
def test_a_collective_beyond_the_plan_fails_the_collectives_check() -> None:
    """Each path's record states its data collectives per batch (Path.collectives) and every run_case checks each
    rank's logged calls against the plan's count (muon_dist.expected_collectives): a path that calls one empty
    all-to-all more keeps the bits and the bytes, and only that check catches it."""
    case = Case(((5, 3),) * 5, ("S0",) * 5, sabotage="extra_collective")
    results = run_unchecked(4, case)
    assert not any(r["differing"] for r in results)
    assert all(
        {k: v for k, v in r["bytes"].items() if k not in CHECKS} == r["expected"] for r in results
    )
    assert all(r["expected_collectives"].get("global_all_to_all") for r in results)
    with pytest.raises(AssertionError, match="data collectives"):
        run_case(4, case)
