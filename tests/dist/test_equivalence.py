"""DistributedMuon equals muon_ref.Muon bitwise on gloo/CPU: every path, world sizes 1-8, even and uneven
shards, Shard(0) / Shard(1) / Replicate / plain tensors, HSDP, fp32 and bf16, every preset, 3 steps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from muon_ref.presets import PRESETS
from tests.conftest import examples

from .checks import run_case, timeout_for
from .workers import Case

PLACEMENTS = ("S0", "S1", "plain", "R")


@st.composite
def cases(draw, world_size: int | None = None) -> tuple[int, Case]:
    """A world size and a random set of same-layout runs: dims below W, single rows, primes, remainders;
    up to two params without a gradient (on every rank) in the middle step."""
    W = world_size or draw(st.integers(1, 8))
    mesh = draw(st.sampled_from(["fsdp", "hsdp"])) if W % 2 == 0 and W >= 4 else "fsdp"
    shapes, placements = [], []
    for _ in range(draw(st.integers(1, 3))):
        shape = (draw(st.integers(1, 2 * W + 3)), draw(st.integers(1, 2 * W + 3)))
        placement = draw(st.sampled_from(PLACEMENTS if mesh == "fsdp" else ("S0", "S1")))
        count = draw(st.integers(1, W + 2))
        shapes += [shape] * count
        placements += [placement] * count
    options = draw(
        st.sampled_from([(), (("remainder", "padded_all_to_all"),), (("force_path", "agrs"),)])
    )
    no_grad = tuple(draw(st.sets(st.integers(0, len(shapes) - 1), max_size=2)))
    case = Case(
        tuple(shapes),
        tuple(placements),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        preset=draw(st.sampled_from(sorted(PRESETS))),
        seed=draw(st.integers(0, 2**16)),
        mesh=mesh,
        options=options,
        no_grad=no_grad,
    )
    return W, case


@pytest.mark.timeout(timeout_for(240))
@example(drawn=(4, Case(((5, 3),) * 4, ("S0",) * 4)))  # rank 3 holds an empty shard
@example(
    drawn=(4, Case(((5, 6),) * 5, ("S0",) * 5, dtype="bfloat16"))
)  # padding rows to 8 would flip the transpose
@example(
    drawn=(3, Case(((2, 7),) * 3, ("S1",) * 3, preset="keller", dtype="bfloat16"))
)  # bf16 add(alpha) tail
@example(
    drawn=(8, Case(((1, 9),) * 9 + ((9, 1),) * 2, ("S0",) * 9 + ("S1",) * 2))
)  # single row, one column
@settings(max_examples=examples(3.0))
@given(drawn=cases())
def test_distributed_step_equals_reference_bitwise(drawn: tuple[int, Case]) -> None:
    world_size, case = drawn
    run_case(world_size, case)


@pytest.mark.timeout(timeout_for(120))
@settings(max_examples=examples(0.25))
@given(case=cases(world_size=1).map(lambda d: d[1]), preset=st.sampled_from(sorted(PRESETS)))
def test_world_sizes_1_2_4_8_give_identical_parameters(case: Case, preset: str) -> None:
    case = Case(
        case.shapes,
        tuple("S0" if p == "R" else p for p in case.placements),
        case.dtype,
        preset,
        seed=case.seed,
        no_grad=case.no_grad,
    )
    finals = [_full_params(W, case) for W in (1, 2, 4, 8)]
    for W, got in zip((2, 4, 8), finals[1:]):
        for i, (a, b) in enumerate(zip(finals[0], got)):
            assert torch.equal(a, b), f"param {i} of shape {case.shapes[i]}: W=1 and W={W} differ"


def _full_params(world_size: int, case: Case) -> list[torch.Tensor]:
    """Each param reassembled from the ranks' shards (chunk order), after the case's steps."""
    results = run_case(world_size, case)
    fulls = []
    for i, placement in enumerate(case.placements):
        shards = [r["params"][i] for r in results]
        fulls.append(
            shards[0] if placement == "plain" else torch.cat(shards, dim=int(placement[1:]))
        )
    return fulls


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 4, 6, 8])
@pytest.mark.parametrize(
    "path_options",
    [
        (),
        (("remainder", "padded_all_to_all"),),
        (("force_path", "agrs"),),
        (("force_path", "padded_all_to_all"),),
    ],
)
def test_every_path_runs_where_the_plan_says_and_equals_reference(
    world_size: int, path_options: tuple
) -> None:
    shapes = ((7, 5),) * (world_size + 1) + ((3, 11),) * 2 + ((4, 4),) * 2
    placements = ("S0",) * (world_size + 1) + ("S1",) * 2 + ("plain",) * 2
    results = run_case(world_size, Case(shapes, placements, dtype="bfloat16", options=path_options))
    taken = {p for _, p in results[0]["paths"]}
    # no options: DistributedMuon's default, global dispatch; a remainder or forced path: batched dispatch
    want = {
        "replicated",
        dict(path_options).get("force_path")
        or ("all_to_all" if path_options else "global_all_to_all"),
    }
    assert want <= taken, (taken, want)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "world_size, case",
    [
        (
            4,
            Case(((3, 4, 5),) * 5, ("S0",) * 5, dtype="bfloat16"),
        ),  # 3 experts on 4 ranks: one holds none
        (
            3,
            Case(((2, 6, 4),) * 3, ("S1",) * 3, preset="xtuner"),
        ),  # experts split inside each matrix
        (
            4,
            Case(((6, 5),) * 4, ("S0",) * 4, overrides=(("num_experts", 2),)),
        ),  # fused [E * m, n], cut mid-expert
        (
            2,
            Case(((4, 3, 2, 2),) * 3, ("S0",) * 3, overrides=(("flatten", True),)),
        ),  # conv weights, flattened
    ],
    ids=["3d-experts", "3d-experts-shard1", "fused-experts", "flatten"],
)
def test_expert_stacks_and_flattened_params_equal_reference_bitwise(
    world_size: int, case: Case
) -> None:
    """Expert stacks on a 1-D mesh take the path their boxes call for (tests/dist/test_experts.py): 3-D on dim 0
    is local; split experts go whole to an owner, which runs the kernel per matrix."""
    run_case(world_size, case)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "world_size, case",
    [
        (4, Case(((6, 4),) * 3, ("S0,S1",) * 3, mesh="hsdp")),  # 2 x 2 blocks of a (6, 4) matrix
        (
            4,
            Case(((5, 3),) * 5, ("S1,S0",) * 5, mesh="hsdp", dtype="bfloat16"),
        ),  # uneven, empty blocks, a remainder
        (
            4,
            Case(((4, 2, 3),) * 2, ("S0,S1",) * 2, mesh="ep2"),
        ),  # experts split along dim 1 too: the a2a family
    ],
    ids=["2x2-blocks", "uneven-blocks", "3d-experts"],
)
def test_params_sharded_along_two_dims_equal_reference_bitwise(world_size: int, case: Case) -> None:
    """Shard(d) on one mesh axis and Shard(d') on the other (FSDP2 over a row- or column-parallel TP layer): the
    shard group is the whole mesh, each member holds a 2-D block, and the all-to-all family joins the blocks."""
    results = run_case(world_size, case)
    assert {p for _, p in results[0]["paths"]} <= {"global_all_to_all"}  # the default dispatch
