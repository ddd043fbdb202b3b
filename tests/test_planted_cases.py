"""The planted-bug suite's cases one at a time (muon_check/adapters/planted.py; the whole suite through the CLI is
tests/test_planted.py): the correct Muon under each planted bug conforms in the families that catch the bug (the
negative control: the defect is the departure); the new families pass for DistributedMuon in every mode and for
muon_ref (the known-good controls); and the families of the newer classes catch their planted bugs where they
should, and only there."""

from __future__ import annotations

import pytest

from muon_check import conformance
from muon_check.adapters.cases import (
    DIST_FAMILIES,
    FUSED_DIST_FAMILIES,
    LONG_SAVE,
    Case,
    default_cases,
    in_family,
)
from muon_check.adapters.controls import PaddedControl
from muon_check.adapters.planted import (
    BASES,
    PLANTED,
    ExpertSlabNewtonSchulz,
    GatherMuon,
    MuonPerMicroBatch,
    Planted,
    PlantedAdapter,
    PrefixedStateKeys,
    RecastStepCounter,
    SmallMuon,
)
from muon_check.adapters.shipped import (
    DdpReference,
    DistributedReference,
    Reference,
    ReplicatedReference,
)

NEW_FAMILIES = {
    None: ("micro_batches", "nesterov_off"),
    "dtensor": (
        "padded_scale",
        "asym_none",
        "accumulation",
        "checkpoint",
        "checkpoint_unstepped",
        "row_sharded",
        "resume_long",
    ),
    "replicated": ("asym_none", "accumulation", "checkpoint", "checkpoint_unstepped"),
    "unreduced": ("straddle", "accumulation", "checkpoint", "checkpoint_unstepped"),
}


def _base(planted: Planted) -> PlantedAdapter:
    """The correct Muon under the planted bug, with the same claim, kind and dtypes, in the families that catch it."""
    (base,) = [b.optimizer for b in BASES if issubclass(planted.adapter.optimizer, b.optimizer)]
    a = planted.adapter
    return PlantedAdapter(base, a.distributed, planted.caught_by, preset=a.preset, dtypes=a.dtypes)


def _base_groups() -> list[tuple[Planted, ...]]:
    """The planted bugs grouped by the correct Muon under them (the base, its mode, preset, dtypes and world sizes):
    one check of a group's base on the union of its bugs' families runs every case that one check per bug would."""
    groups: dict[tuple, list[Planted]] = {}
    for planted in PLANTED:
        base = _base(planted)
        key = (base.optimizer, base.distributed, base.preset, base.dtypes, planted.world_sizes)
        groups.setdefault(key, []).append(planted)
    return [tuple(g) for g in groups.values()]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "plants", _base_groups(), ids=lambda ps: "bugs" + "-".join(str(p.field_bug) for p in ps)
)
def test_the_correct_muon_under_each_planted_bug_conforms_where_the_bug_is_caught(
    plants: tuple[Planted, ...],
) -> None:
    """The negative control of every planted bug: the correct Muon it was planted in conforms on every case of the
    families that catch the bug (so what departs there is the bug), every bug's families among the cases run."""
    families = frozenset().union(*(p.caught_by for p in plants))
    first = _base(plants[0])
    base = PlantedAdapter(
        first.optimizer, first.distributed, families, preset=first.preset, dtypes=first.dtypes
    )
    report = conformance.check(base, plants[0].world_sizes, 3, 30.0, 0.0, log=lambda *_: None)
    assert report["conforms"] and report["outcomes"], report["diagnosis"]
    ran = {o["family"] for o in report["outcomes"]}
    assert all(p.caught_by <= ran for p in plants), (ran, [p.caught_by for p in plants])


def test_the_planted_bugs_fall_into_fewer_base_groups_and_each_bug_into_one() -> None:
    """_base_groups is a partition of PLANTED (every bug in exactly one group, so the base check above covers every
    bug), coarser than one group per bug."""
    groups = _base_groups()
    assert sorted(p.field_bug for g in groups for p in g) == sorted(p.field_bug for p in PLANTED)
    assert len(groups) < len(PLANTED)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "adapter",
    [Reference(), DistributedReference(), ReplicatedReference(), DdpReference()],
    ids=lambda a: a.distributed or "single",
)
def test_the_new_families_pass_for_the_known_good_controls(adapter) -> None:
    families = NEW_FAMILIES[adapter.distributed]
    report = conformance.check(
        adapter, (1, 2), 3, 30.0, 0.0, families=families, log=lambda *_: None
    )
    assert report["conforms"], report["diagnosis"]
    assert {o["family"] for o in report["outcomes"]} == set(families)
    asym = [o for o in report["outcomes"] if o["family"] == "asym_none"]
    assert all(
        o["policy"] == "raise ValueError" for o in asym
    )  # docs/distributed.md, "Guarantees": ValueError on every rank


@pytest.mark.timeout(60)
def test_muon_once_per_micro_batch_departs_on_the_distributed_accumulation_family_only() -> None:
    # replicated params and gradients: every rank runs the whole single-device Muon, so the planted bug 7 and its
    # base are candidates of that mode too; the accumulation family is the ranks' micro_batches
    families = ("accumulation", "even")
    good = conformance.check(
        PlantedAdapter(SmallMuon, "replicated", frozenset(families)),
        (2,),
        3,
        30.0,
        0.0,
        log=lambda *_: None,
    )
    bad = conformance.check(
        PlantedAdapter(MuonPerMicroBatch, "replicated", frozenset(families)),
        (2,),
        3,
        30.0,
        0.0,
        log=lambda *_: None,
    )
    assert good["conforms"], good["diagnosis"]
    assert (
        bad["diagnosis"].startswith("bug: ")
        and "departs on accumulation (1/1: W=2)" in (bad["diagnosis"])
    ), bad["diagnosis"]
    assert "; bitwise on even" in bad["diagnosis"], bad["diagnosis"]


# ---------------------------------------------------------------- the families of the newer classes (14-27)


def test_the_new_dtensor_families_exist_where_they_should_and_nowhere_else() -> None:
    cases = default_cases(
        frozenset({"row_sharded", "resume_long"}) | FUSED_DIST_FAMILIES,
        "dtensor",
        (1, 2, 3, 4),
        ("float32",),
        3,
    )
    where = {(c.family, c.world_size) for c in cases}
    # row_sharded needs ranks; resume_long is W <= 2 (258 steps); fused_sharded where a box cuts an expert
    assert where == {
        ("row_sharded", 2),
        ("row_sharded", 3),
        ("row_sharded", 4),
        ("resume_long", 1),
        ("resume_long", 2),
        ("fused_sharded", 2),
        ("fused_sharded", 4),
    }
    assert all(in_family(c) for c in cases)
    long = [c for c in cases if c.family == "resume_long"]
    assert all(c.steps == LONG_SAVE + 1 and c.resume_world_size == c.world_size for c in long)
    assert not FUSED_DIST_FAMILIES & DIST_FAMILIES  # only for adapters that list it (num_experts)


def test_a_shrunk_case_keeps_what_its_new_family_targets() -> None:
    long = Case("resume_long", "dtensor", 2, ((3, 3),), steps=LONG_SAVE, resume_world_size=2)
    assert not in_family(long)  # a save before step 257 cannot show a counter stuck at 256
    fused = Case("fused_sharded", "dtensor", 2, ((8, 3),), options=(("num_experts", 4),))
    assert not in_family(fused)  # rows 4 | 4 on experts of 2 rows: no box cuts an expert
    assert not in_family(Case("row_sharded", "dtensor", 2, ((2, 6),)))


def _one_family(adapter: PlantedAdapter, family: str, dtypes=("float32",)) -> dict:
    adapter.families, adapter.dtypes = frozenset({family}), dtypes
    return conformance.check(adapter, (2,), 3, 60.0, 0.0, log=lambda *_: None)


@pytest.mark.timeout(120)
def test_a_step_counter_recast_on_load_departs_on_resume_long_in_bf16_only() -> None:
    # negative control: GatherMuon keeps its counter under "step", which torch.optim.Optimizer.load_state_dict
    # does not cast; the planted bug keeps it under "count", which it casts to the bf16 param's dtype
    good = _one_family(
        PlantedAdapter(GatherMuon, "dtensor", DIST_FAMILIES), "resume_long", ("bfloat16",)
    )
    bad = _one_family(
        PlantedAdapter(RecastStepCounter, "dtensor", DIST_FAMILIES),
        "resume_long",
        ("float32", "bfloat16"),
    )
    assert good["conforms"] and len(good["outcomes"]) == 1, good["diagnosis"]
    fp32, bf16 = bad["outcomes"]
    assert fp32["status"] == "bitwise" and bf16["status"] == "differs", bad["outcomes"]
    assert bf16["resumed"] == (
        "param 0 state 'count' on rank 0: saved float32 cpu 257.0, loaded bfloat16 cpu 256.0 (W=2)"
    )
    assert bf16["max_diff"] == 0.0  # the params are right: only the state comparison shows it
    assert bad["diagnosis"] == (  # state a load changed is a bug whatever else ran
        "bug: the resume changes the optimizer state on resume_long (1/2: W=2; bfloat16 only)"
    )


@pytest.mark.timeout(120)
def test_prefixed_state_keys_show_as_a_reset_in_the_params_and_as_lost_keys_after_the_load() -> (
    None
):
    report = _one_family(PlantedAdapter(PrefixedStateKeys, "dtensor", DIST_FAMILIES), "resume_long")
    (outcome,) = report["outcomes"]
    assert outcome["status"] == "differs" and outcome["max_diff"] > 0  # the buffer restarts at zero
    assert outcome["resumed"].startswith(
        "param 0 state 'momentum_buffer' on rank 0: lost by the load"
    )


@pytest.mark.timeout(120)
def test_newton_schulz_on_slabs_of_experts_departs_where_a_box_cuts_an_expert_only() -> None:
    # on boxes along expert boundaries (8 rows of 4 experts at W = 2: 4 | 4) the planted bug is muon_ref exactly
    # (conformance.run_here would need one device: the boxes need ranks)
    aligned = Case("fused_sharded", "dtensor", 2, ((8, 3),), options=(("num_experts", 4),))
    runner = conformance.Runner(
        PlantedAdapter(ExpertSlabNewtonSchulz, "dtensor", FUSED_DIST_FAMILIES), 60.0
    )
    try:
        assert runner.run(aligned).status == "bitwise"
    finally:
        runner.close()
    report = _one_family(
        PlantedAdapter(ExpertSlabNewtonSchulz, "dtensor", FUSED_DIST_FAMILIES), "fused_sharded"
    )
    assert [o["status"] for o in report["outcomes"]] == ["differs"], report["diagnosis"]


class PaddedControlOnTwoFamilies(PaddedControl):
    """A correct control on two families (its ranks import it from here): the verbose log is the same for every
    family's cases."""

    families = frozenset({"even", "uneven"})


@pytest.mark.timeout(120)
def test_verbose_planted_runs_print_each_case_as_it_ends_and_quiet_ones_none() -> None:
    """--planted --verbose: each case of a control reaches the case log as it ends (one line per case), so a slow or
    stuck candidate shows which case it is in, and the suite's log gets only the control's line; without
    --verbose the case log is the silent one."""
    assert conformance._Suite(10.0, 1, print, {}, "cpu").case_log is conformance._silent
    pools: dict = {}
    try:
        printed: list[str] = []
        cases: list[str] = []
        suite = conformance._Suite(10.0, 1, printed.append, pools, "cpu", cases.append)
        (row,) = conformance._run_controls([PaddedControlOnTwoFamilies], suite)
        assert row["conforms"] and len(printed) == 1 and printed[0].startswith("control ")
        assert len(cases) == row["cases"] > 1
    finally:
        conformance.close_pools(pools)
