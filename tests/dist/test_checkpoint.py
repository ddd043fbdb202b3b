"""Checkpoints across world sizes (muon_dist/checkpoint.py): a DCP checkpoint saved at W loads at W' and the run
goes on bitwise like an uninterrupted muon_ref run; muon_ref and DistributedMuon state dicts convert into each
other bitwise; loaded groups step with their own (possibly new) hyperparameters."""

from __future__ import annotations

from dataclasses import replace

import pytest

from muon_check.fixtures import box_of, same_bits

from .ckpt_workers import convert_round_trip, reference_run, resume, resume_reference, save_after
from .conftest import get_pool
from .workers import Case

# even, uneven with an empty shard at W=4, Shard(1), Replicate, plain; two groups
CASE = Case(
    shapes=((6, 4), (5, 3), (3, 6), (4, 4), (3, 5), (6, 4)),
    placements=("S0", "S0", "S1", "R", "plain", "S0"),
    groups=(0, 0, 0, 1, 1, 0),
    overrides=(("weight_decay", 0.05),),
)
NEVER_STEPPED = (5,)  # its grad is None on every rank before the save: its state must exist anyway
# FSDP2 over Colwise (_StridedShard over Shard(0)) and over Rowwise (Shard(0) x Shard(1)), uneven rows
TP_CASE = Case(
    shapes=((11, 7), (5, 9), (12, 4)), placements=("S0:2,S0", "S0,S1", "S0:2,S0"), mesh="tp2"
)
TP4_CASE = replace(TP_CASE, mesh="tp4", placements=("S0:4,S0", "S0,S1", "S0:4,S0"))


def _assert_equal_to_reference(results: list[dict], case: Case, stop: int, **ref_kwargs) -> None:
    ref_params, ref_bufs = reference_run(case, stop, **ref_kwargs)
    W = len(results)
    for rank, r in enumerate(results):
        for name, got, want in (
            ("param", r["params"], ref_params),
            ("momentum", r["buffers"], ref_bufs),
        ):
            for i, (t, full) in enumerate(zip(got, want)):
                box = box_of(full, case.placements[i], case.mesh, rank, W)
                assert same_bits(t, box), f"rank {rank}/{W}: {name} {i} differs from muon_ref"


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "save_world,save_mesh,load_world,dtype",
    [
        (2, "fsdp", 3, "float32"),
        (3, "fsdp", 1, "float32"),
        (1, "fsdp", 4, "float32"),
        (4, "hsdp", 2, "float32"),
        (4, "fsdp", 3, "bfloat16"),
        # with 1 -> 4 and 4 -> 2 above: every ordered pair W != W' of {1, 2, 4}
        (1, "fsdp", 2, "float32"),
        (2, "fsdp", 1, "float32"),
        (2, "fsdp", 4, "float32"),
        (4, "fsdp", 1, "float32"),
    ],
)
def test_a_dcp_checkpoint_saved_at_one_world_size_resumes_at_another_bitwise(
    tmp_path, save_world: int, save_mesh: str, load_world: int, dtype: str
) -> None:
    placements = tuple(
        "plain" if pl == "R" and save_mesh == "hsdp" else pl for pl in CASE.placements
    )
    saved = replace(
        CASE, mesh=save_mesh, dtype=dtype, placements=placements
    )  # Replicate DTensors: 1-D meshes only
    keys = get_pool(save_world).run(save_after, saved, 2, NEVER_STEPPED, str(tmp_path), timeout=60)
    assert all(k == keys[0] for k in keys) and [i for i, _ in keys[0]] == list(
        range(len(CASE.shapes))
    ), keys
    loaded = replace(saved, mesh="fsdp")
    results = get_pool(load_world).run(resume, loaded, 2, 4, str(tmp_path), timeout=60)
    _assert_equal_to_reference(results, loaded, 4, none=NEVER_STEPPED, none_until=2)


@pytest.mark.timeout(90)
def test_a_loaded_state_with_new_hyperparameters_steps_with_the_new_ones(tmp_path) -> None:
    # lr, weight decay and the shape scale's form all change on resume: nothing derived from them is in the state
    changes = (
        (0, (("lr", 0.004), ("weight_decay", 0.0), ("lr_scale", "match_rms_adamw"))),
        (1, (("lr", 0.03),)),
    )
    keys = get_pool(2).run(save_after, CASE, 2, (), str(tmp_path), timeout=60)
    assert {k for _, ks in keys[0] for k in ks} == {"momentum_buffer"}, keys[0]
    results = get_pool(3).run(resume, CASE, 2, 4, str(tmp_path), changes, timeout=60)
    assert all(r["lr"] == [0.004, 0.03] for r in results), [r["lr"] for r in results]
    _assert_equal_to_reference(results, CASE, 4, changes_at=2, changes=changes)


@pytest.mark.timeout(90)
def test_a_loaded_state_keeps_the_saved_hyperparameters_when_none_change(tmp_path) -> None:
    get_pool(3).run(
        save_after, replace(CASE, overrides=(("lr", 0.02),)), 1, (), str(tmp_path), timeout=60
    )
    results = get_pool(2).run(
        resume, CASE, 1, 3, str(tmp_path), timeout=60
    )  # built with lr 1e-3: loads 0.02
    assert all(r["lr"] == [0.02, 0.02] for r in results), [r["lr"] for r in results]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "world_size, case",
    [
        (1, "plain"),
        (4, "plain"),
        # FSDP2 over tensor parallelism with uneven shards (dp 2 x tp 2, dp 2 x tp 4): torch 2.9.1's full_tensor of
        # these orders rows wrongly, so the conversion must read the boxes itself (muon_dist/checkpoint.py)
        (4, "tp2"),
        (8, "tp4"),
    ],
)
def test_reference_and_distributed_state_dicts_convert_into_each_other_bitwise(
    world_size: int, case: str
) -> None:
    chosen = {"plain": CASE, "tp2": TP_CASE, "tp4": TP4_CASE}[case]
    for rank, r in enumerate(
        get_pool(world_size).run(convert_round_trip, chosen, 2, 2, timeout=60)
    ):
        assert r == {"to_reference": {}, "continued": {}, "buffers": {}}, (rank, r)


@pytest.mark.timeout(90)
def test_a_dcp_checkpoint_of_distributed_muon_resumes_in_muon_ref_on_full_tensors_bitwise(
    tmp_path,
) -> None:
    get_pool(3).run(save_after, CASE, 2, NEVER_STEPPED, str(tmp_path), timeout=60)
    (result,) = get_pool(1).run(resume_reference, CASE, 2, 4, str(tmp_path), timeout=60)
    plain = replace(CASE, placements=("plain",) * len(CASE.shapes))
    _assert_equal_to_reference([result], plain, 4, none=NEVER_STEPPED, none_until=2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "load_world, load_mesh, load_placements",
    [
        (2, "fsdp", ("S0", "S0", "S0")),  # tensor parallelism dropped: FSDP2 alone
        (8, "tp4", ("S0:4,S0", "S0,S1", "S0:4,S0")),  # dp 2 x tp 4
        (4, "tp2", ("S1,S0", "S0,S0", "S1,S1")),  # the same mesh, other placements
    ],
)
def test_a_checkpoint_saved_under_tensor_parallelism_resumes_on_another_dp_tp_layout_bitwise(
    tmp_path, load_world: int, load_mesh: str, load_placements: tuple[str, ...]
) -> None:
    """Saved on a dp 2 x tp 2 mesh (FSDP2 over Colwise: _StridedShard; over Rowwise: Shard(0) x Shard(1)), loaded
    by DCP into another (dp, tp) layout, continued: bitwise like an uninterrupted muon_ref run."""
    get_pool(4).run(save_after, TP_CASE, 2, (), str(tmp_path), timeout=60)
    loaded = replace(TP_CASE, mesh=load_mesh, placements=load_placements)
    results = get_pool(load_world).run(resume, loaded, 2, 4, str(tmp_path), timeout=60)
    _assert_equal_to_reference(results, loaded, 4)
