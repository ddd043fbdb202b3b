"""The planner table at scale (benchmarks/scale.py): DistributedMuon's figures come from its own plan and equal what
gloo ranks measure; the peers' schemes are models whose figures are checked on a case computed by hand."""

from __future__ import annotations

import pytest

from benchmarks import scale
from muon_check.shapes import ParamSpec


@pytest.mark.parametrize("model", sorted(scale.MODELS))
def test_default_dispatch_moves_the_lower_bound_on_every_model_up_to_1024_ranks(model: str) -> None:
    """The plan's bytes per rank for DistributedMuon's default (global dispatch) on the real models' shapes: within
    0.1% of the lower bound at W = 8 and 1024 (a pure function of the shapes: the same on every machine)."""
    specs = [s for s in scale.MODELS[model]() if s.is_muon]
    for W in (8, 1024):
        r = scale.row(model, "distributed", specs, W)
        assert 1.0 <= r["over_bound"] <= 1.001, r
        assert r["padding_percent"] == 0.0, r


def test_the_peer_models_on_a_case_computed_by_hand() -> None:
    """Three (4, 2) matrices on 2 ranks. xtuner: batches (p0, p1) and (p2, zero), each rank sending a 4-element shard
    of the other's param and 4 update elements back per batch; Dion: one batch (p0, p1 | p2, zero). Both: 32 bytes
    per rank, a quarter of the elements moved are the zero matrix's, both ranks run two NS; 4 and 2 collectives."""
    specs = [ParamSpec(f"p{i}", (4, 2), "matrix") for i in range(3)]
    for scheme, collectives in (("xtuner", 4), ("dion", 2)):
        t = scale.tally_of(scheme, specs, 2)
        assert t.sent == [32, 32] and t.moved == 32 and t.padded == 8, (scheme, t)
        assert t.flops[0] == t.flops[1] == 2 * scale.ns_flops(4, 2) and t.collectives == collectives
    canzona = scale.tally_of("canzona", specs, 2)  # LPT over equal costs: ranks 0, 1, 0
    assert (
        canzona.flops == [2 * scale.ns_flops(4, 2), scale.ns_flops(4, 2)]
        and canzona.collectives == 3
    )


@pytest.mark.timeout(240)
def test_the_plans_figures_equal_what_gloo_ranks_measure() -> None:
    """--check at W = 2: every rank's bytes sent, NS FLOPs at its backend and collectives, on three sets."""
    assert scale.check([2]) == []


@pytest.mark.timeout(240)
def test_a_plan_figure_off_by_one_flop_is_caught(monkeypatch) -> None:
    """Negative control: a plan whose FLOPs figure is one more than the kernels' is reported on every rank."""
    real = scale.expected_flops
    monkeypatch.setattr(scale, "expected_flops", lambda plan, rank: real(plan, rank) + 1)
    problems = scale.check([2])
    assert len(problems) == 6 and all("flops" in p for p in problems), problems


def test_the_command_prints_a_table_per_model(capsys) -> None:
    """`python -m benchmarks scale` with a model, a W and two schemes: exit 0, one table, a row per scheme."""
    args = ["--models", "qwen3_30b_a3b", "--world-sizes", "8", "--schemes", "distributed", "dion"]
    assert scale.main(args) == 0
    out = capsys.readouterr().out
    assert "qwen3_30b_a3b: per step, per rank" in out and out.count("    8 ") == 2, out


@pytest.mark.parametrize("model", sorted(scale.MODELS))
def test_the_default_memory_budget_bounds_the_buffers_of_the_real_models(model: str) -> None:
    """DistributedMuon's default plan at W = 8 keeps every rank's buffer model (muon_dist.buffer_bytes) within the
    default budget: pipeline_depth (3) times 4/3 of the floor round, 2 (W - 1) / W of the largest matrix's bf16
    direction and update bytes; the rounds by size alone (the plan without a budget) exceed it on every one of
    the three models, so the budget is what bounds them (the table's buf GB column, docs/benchmarks.md)."""
    from muon_dist import Options, buffer_bytes, plan

    specs = [s for s in scale.MODELS[model]() if s.is_muon]
    largest = max(s.shape[0] * s.shape[1] for s in specs if len(s.shape) == 2)
    budget = 3 * 4 * (2 * 7 * largest * (2 + 2) // 8) // 3
    entries = scale.entries_of(specs, 8)
    default = plan(entries, Options(dispatch="global"))
    unbounded = plan(entries, Options(dispatch="global", memory_budget=1 << 62))
    assert max(buffer_bytes(default, r, scale.ITEMSIZES) for r in range(8)) <= budget
    assert max(buffer_bytes(unbounded, r, scale.ITEMSIZES) for r in range(8)) > budget


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_the_benchmark_sets_have_the_rounds_their_measurements_had(world_size: int) -> None:
    """The speeds and peaks docs/benchmarks.md measured with the default are of these plans: the dense set in 7,
    5 and 4 rounds at W = 2, 3 and 4 (the default budget cuts its four rounds by size at W = 2 and 3), every other
    set as by size, with the budget off (one round each: under ROUND_MIN_ELEMENTS the default budget adds none)."""
    from benchmarks.run import SETS
    from muon_dist import Options, plan

    for name, make_set in SETS.items():
        entries = scale.entries_of([s for s in make_set() if s.is_muon], world_size)
        default = plan(entries, Options(dispatch="global")).batches
        if name == "dense":
            rounds = sum(b.path == "global_all_to_all" for b in default)
            assert rounds == {2: 7, 3: 5, 4: 4}[world_size]
        else:
            off = plan(entries, Options(dispatch="global", memory_budget=1 << 62)).batches
            assert default == off, name
