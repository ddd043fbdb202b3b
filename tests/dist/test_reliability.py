"""Reliability on gloo: every failure mode behaves the same way on every rank, promptly, and never hangs.

Policies (docs/distributed.md, "Guarantees"): a non-finite gradient on any rank raises on every rank (nonfinite="raise") or
skips that param on every rank ("skip"); zero gradients give a zero update; a grad that is None on some ranks
only is a ValueError on every rank, None on all ranks skips the param; params may join or leave groups between
steps; a rank whose local work raises mid-step makes every rank raise RuntimeError within seconds (an all-gather
of failure flags before each write group, not the pool's timeout), and every rank writes exactly the write groups
before the failing one (none with atomic=True); runs repeat bitwise.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from muon_check.fixtures import same_bits

from .ckpt_workers import (
    groups_change_between_steps,
    none_on_some_ranks_then_recover,
    nonfinite_on_one_rank,
    raise_in_a_later_write_group,
    raise_mid_step,
    zero_gradients,
)
from .conftest import get_pool
from .workers import Case, distributed_steps

CASE = Case(shapes=((6, 4), (5, 3), (3, 6), (4, 4)), placements=("S0", "S0", "S1", "plain"))
PROMPT_S = 5.0  # a failed step ends this fast on every rank; the pool's own timeout below is 30 s


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_nonfinite_gradient_on_one_rank_follows_the_policy_on_every_rank(
    value: float, policy: str
) -> None:
    results = get_pool(4).run(nonfinite_on_one_rank, CASE, value, policy, timeout=30)
    assert [r["sees"] for r in results] == [
        False,
        False,
        True,
        False,
    ]  # rows 4-5 of param 0 live on rank 2
    for rank, r in enumerate(results):
        if policy == "raise":
            assert (
                "p0 of shape (6, 4) has a non-finite gradient" in r["error"] and r["unchanged"]
            ), (rank, r)
        else:
            assert r["error"] == "no error" and not r["unchanged"], (rank, r)
        assert r["differing"] == {} and r["keys"] == results[0]["keys"], (rank, r)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_zero_gradients_give_a_zero_update(weight_decay: float) -> None:
    case = replace(CASE, overrides=(("weight_decay", weight_decay),))
    for rank, r in enumerate(get_pool(4).run(zero_gradients, case, timeout=30)):
        assert r["vs_reference"] == {} and r["buffers_nonzero"] == 0, (rank, r)
        assert (r["vs_initial"] == {}) == (weight_decay == 0.0), (rank, r)  # only weight decay acts


@pytest.mark.timeout(60)
@pytest.mark.parametrize("none_ranks", [(1,), (0, 2)])
def test_a_grad_none_on_some_ranks_raises_on_every_rank_and_the_next_step_recovers(
    none_ranks,
) -> None:
    results = get_pool(3).run(none_on_some_ranks_then_recover, CASE, none_ranks, timeout=30)
    for rank, r in enumerate(results):
        assert "disagree with rank 0 on the step's plan" in r["error"], (rank, r["error"])
        assert r["differing"] == {} and r["keys"] == results[0]["keys"], (rank, r)


@pytest.mark.timeout(60)
def test_a_grad_none_on_every_rank_skips_the_param_and_keeps_its_state() -> None:
    # Case.no_grad: None on every rank in step 1; run_case's muon_ref skips it too
    from .checks import run_case

    run_case(3, replace(CASE, no_grad=(0, 3)))


@pytest.mark.timeout(60)
def test_params_added_to_and_removed_from_groups_between_steps_match_the_reference(
    tmp_path,
) -> None:
    case = replace(CASE, shapes=CASE.shapes[:3], placements=CASE.placements[:3])
    results = get_pool(3).run(groups_change_between_steps, case, str(tmp_path), timeout=30)
    for rank, r in enumerate(results):
        assert r["differing"] == {}, (rank, r)
        assert r["keys"] == results[0]["keys"], (rank, r["keys"])
    assert [[i for i, _ in keys] for keys in results[0]["keys"]] == [[0, 1], [0, 1, 2], [0, 1]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["kernel", "momentum"])
@pytest.mark.parametrize("world_size,failing_rank", [(2, 1), (4, 0)])
def test_a_rank_that_raises_mid_step_makes_every_rank_raise_promptly(
    where: str, world_size: int, failing_rank: int
) -> None:
    case = Case(
        shapes=((5, 3),) * world_size, placements=("S0",) * world_size
    )  # all_to_all: every rank owns one
    start = time.monotonic()
    results = get_pool(world_size).run(raise_mid_step, case, failing_rank, where, timeout=30)
    assert time.monotonic() - start < 2 * PROMPT_S
    for rank, r in enumerate(results):
        want = (
            f"rank {failing_rank} failed mid-step in the {where}"
            if rank == failing_rank
            else f"ranks [{failing_rank}] failed mid-step"
        )
        assert want in r["error"] and r["seconds"] < PROMPT_S, (rank, r)
        assert r["unchanged"] and r["differing"] == {}, (rank, r)


@pytest.mark.timeout(60)
def test_repeated_runs_are_bitwise_identical() -> None:
    case = replace(CASE, steps=3, placements=("S0", "S0", "S1", "R"))
    first, second = (get_pool(4).run(distributed_steps, case, timeout=30) for _ in range(2))
    for rank, (a, b) in enumerate(zip(first, second)):
        assert all(
            same_bits(x, y) for x, y in zip(a["params"] + a["buffers"], b["params"] + b["buffers"])
        ), rank


# three batches of equal size (W params each, no empty box): three write groups of a streaming step, one of an
# atomic step; four rounds asked for (by size, a step this small goes in one round: one write group)
GROUPED = Case(
    shapes=((8, 4),) * 4 + ((4, 8),) * 4 + ((16, 2),) * 4,
    placements=("S0",) * 12,
    overrides=(("rounds", 4),),
)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("atomic", [False, True])
def test_a_failure_in_a_later_write_group_writes_exactly_the_earlier_groups_on_every_rank(
    atomic: bool,
) -> None:
    results = get_pool(4).run(raise_in_a_later_write_group, GROUPED, 2, (4, 8), atomic, timeout=30)
    written = (
        [False] * 12 if atomic else [True] * 4 + [False] * 8
    )  # the (8, 4) batch is the first group
    for rank, r in enumerate(results):
        assert r["changed"] == written, (rank, r)
        state = (
            "no param or momentum buffer was written"
            if atomic
            else "the first 1 batches of the step's plan"
        )
        assert "failed mid-step" in r["error"] and state in r["error"], (rank, r["error"])
