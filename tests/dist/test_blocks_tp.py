"""Tensor parallelism and fused projections: every placement that FSDP2 over parallelize_module produces, and
params orthogonalised per block (split_sizes) or per head (num_heads), equal muon_ref.Muon bitwise on gloo.

Meshes: dp x tp (the "tp<k>" kind) and replicate x shard x tp ("grid<r>x<s>x<t>") up to 8 ranks. Placements per
mesh axis: Replicate, Shard(0), Shard(1), and _StridedShard(d, split_factor=t) where FSDP2 shards a dim that tensor
parallelism already shards (right to left). Separate blocks take the "blocks" path (each block to the member that
holds most of it); plain matrices the all-to-all family over every rank that holds a piece.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from muon_check.fixtures import box_of, mesh_shape
from muon_ref.presets import PRESETS
from tests.conftest import examples

from .checks import run_case, timeout_for
from .workers import Case

MESHES = [
    (kind, W)
    for kind, W in (
        ("tp2", 4),
        ("tp4", 4),
        ("tp2", 8),
        ("tp4", 8),
        ("grid2x2x2", 8),
        ("grid1x2x2", 4),
        ("grid2x1x2", 4),
        ("grid2x2x1", 4),
    )
]


@st.composite
def tp_placements(draw, kind: str, world_size: int) -> str:
    """One code per mesh axis as FSDP2 over tensor parallelism makes them: the tp axis Replicate, Shard(0)
    (ColwiseParallel) or Shard(1) (RowwiseParallel); the shard axis Shard(0) or Shard(1) (strided when tp shards the
    same dim, as fully_shard does, or left to right); a replicate axis Replicate. Never all Replicate (a replicated
    DTensor lives on a 1-D mesh)."""
    shape, names = mesh_shape(kind, world_size)
    tp, dp = draw(st.sampled_from(["R", "S0", "S1"])), draw(st.sampled_from(["S0", "S1"]))
    if dp == tp and draw(st.booleans()):
        dp = f"{dp}:{shape[-1]}"
    return ",".join(["R"] * (len(shape) - 2) + [dp, tp])


def _compositions(draw, total: int) -> tuple[int, ...]:
    cuts = sorted(draw(st.sets(st.integers(1, total - 1), max_size=3))) if total > 1 else []
    bounds = [0, *cuts, total]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


@st.composite
def tp_cases(draw) -> tuple[int, Case]:
    """A mesh, one or two runs of same-layout 2-D params, optionally split (row blocks) or per head (rows or
    columns), every preset, fp32 or bf16."""
    kind, W = draw(st.sampled_from(MESHES))
    shape = (draw(st.integers(1, 13)), draw(st.integers(1, 13)))
    blocks = draw(st.sampled_from(["none", "split", "heads0", "heads1"]))
    overrides: tuple = ()
    if blocks == "split" and shape[0] > 1:
        overrides = (("split_sizes", _compositions(draw, shape[0])),)
    elif blocks.startswith("heads"):
        dim = int(blocks[-1])
        heads = draw(st.sampled_from([h for h in range(1, shape[dim] + 1) if shape[dim] % h == 0]))
        overrides = (("num_heads", heads), ("split_dim", dim))
    runs = draw(st.integers(1, 2))
    shapes, placements = [], []
    for _ in range(runs):
        count = draw(st.integers(1, W + 1))
        placement = draw(tp_placements(kind, W))
        shapes += [shape] * count
        placements += [placement] * count
    case = Case(
        tuple(shapes),
        tuple(placements),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        preset=draw(st.sampled_from(sorted(PRESETS))),
        seed=draw(st.integers(0, 2**16)),
        mesh=kind,
        overrides=overrides,
    )
    return W, case


@pytest.mark.timeout(timeout_for(240))
@example(
    drawn=(4, Case(((11, 7),) * 5, ("S0:2,S0",) * 5, mesh="tp2"))
)  # strided: FSDP2 over ColwiseParallel
@example(
    drawn=(8, Case(((5, 9),) * 3, ("R,S0,S1",) * 3, mesh="grid2x2x2"))
)  # HSDP x RowwiseParallel
@example(
    drawn=(
        4,
        Case(((10, 4),) * 2, ("S0:2,S0",) * 2, mesh="tp2", overrides=(("split_sizes", (6, 2, 2)),)),
    )
)
@example(
    drawn=(
        4,
        Case(
            ((6, 8),) * 3,
            ("S0,S1",) * 3,
            mesh="tp2",
            dtype="bfloat16",
            overrides=(("num_heads", 4), ("split_dim", 1)),
        ),
    )
)  # o_proj heads split by TP and FSDP
@settings(max_examples=examples(1.0))
@given(drawn=tp_cases())
def test_tensor_parallel_and_fused_params_equal_reference_bitwise(drawn: tuple[int, Case]) -> None:
    world_size, case = drawn
    run_case(
        world_size, case
    )  # params and buffers bitwise, paths as planned, bytes as each path's formula


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "world_size, case, moves",
    [
        (
            3,
            Case(((9, 4),) * 2, ("S0",) * 2, overrides=(("num_heads", 3),)),
            False,
        ),  # every head on one member
        (
            4,
            Case(((10, 6),) * 2, ("S0",) * 2, overrides=(("split_sizes", (3, 5, 2)),)),
            True,
        ),  # blocks straddle
    ],
)
def test_the_blocks_path_moves_exactly_the_pieces_that_lie_off_each_blocks_owner(
    world_size: int, case: Case, moves: bool
) -> None:
    results = run_case(world_size, case)  # the ledger equals blocks.expected_bytes
    assert all({p for _, p in r["paths"]} == {"blocks"} for r in results)
    assert (
        any("blocks" in r["bytes"] for r in results) == moves
    )  # no collective when no block straddles
    # the lower bound, computed apart: per block, its size minus the largest piece any rank holds, received once
    # as a direction (bf16: 2 B, the "torch" kernel's input cast, muon_ref.newton_schulz.input_cast) and once as an
    # update (bf16: 2 B)
    labels = torch.arange(case.shapes[0][0] * case.shapes[0][1]).reshape(case.shapes[0])
    held = [
        set(box_of(labels, case.placements[0], case.mesh, r, world_size).flatten().tolist())
        for r in range(world_size)
    ]
    sizes = dict(case.overrides).get("split_sizes") or (case.shapes[0][0] // 3,) * 3
    starts = [sum(sizes[:b]) for b in range(len(sizes))]
    lacking = 0
    for start, size in zip(starts, sizes):
        block = set(labels[start : start + size].flatten().tolist())
        lacking += len(block) - max(len(block & h) for h in held)
    received = sum(r["bytes"].get("blocks", (0, 0))[1] for r in results)
    assert received == len(case.shapes) * lacking * (2 + 2), (received, lacking)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "dp, tp, preset", [(2, 2, "torch"), (1, 4, "dion"), (4, 2, "moonlight"), (2, 4, "torch")]
)
def test_a_tensor_parallel_fsdp2_transformer_block_trains_bitwise_with_muon_ref(
    dp: int, tp: int, preset: str
) -> None:
    """parallelize_module + fully_shard on a dp x tp mesh (FSDP2 over Colwise gives _StridedShard; over Rowwise,
    Shard(0) x Shard(1)); a fused qkv split into unequal q/k/v blocks, an output projection per head whose heads
    straddle the tp shards. Given the same gradients, every param equals muon_ref's after every step."""
    from .conftest import get_pool, record_paths
    from .tp_workers import tp_fsdp_training

    results = get_pool(dp * tp).run(tp_fsdp_training, dp, tp, preset, 3, timeout=150)
    record_paths(results)
    placements = results[0]["placements"]
    assert placements["qkv.weight"][0].startswith("_S") and placements["o.weight"] == [
        "S(0)",
        "S(1)",
    ], placements
    for r in results:
        assert all(not any(step.values()) for step in r["differs"]), (r["rank"], r["differs"])
        # the MLP's matrices go to LPT owners over every rank (global dispatch, the default)
        assert dict(r["paths"]) == {
            "qkv": "blocks",
            "o": "blocks",
            "gate": "global_all_to_all",
            "up": "global_all_to_all",
            "down": "global_all_to_all",
        }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_nonfinite_block_of_a_split_param_follows_the_policy_alone_on_every_rank(
    policy: str,
) -> None:
    """A NaN in the last row of p0 (its last block, held by rank 3 alone): "skip" keeps that block's bits and steps
    the others, as muon_ref steps separate params; "raise" names the param on every rank."""
    from .ckpt_workers import nonfinite_on_one_rank
    from .conftest import get_pool

    case = Case(((10, 6),) * 2, ("S0",) * 2, overrides=(("split_sizes", (3, 5, 2)),))
    results = get_pool(4).run(nonfinite_on_one_rank, case, float("nan"), policy, timeout=30)
    assert [r["sees"] for r in results] == [False, False, False, True]
    for rank, r in enumerate(results):
        if policy == "skip":
            assert r["error"] == "no error" and not r["unchanged"] and r["differing"] == {}, (
                rank,
                r,
            )
        else:
            assert (
                "p0 of shape (10, 6) has a non-finite gradient" in r["error"] and r["unchanged"]
            ), (rank, r)
