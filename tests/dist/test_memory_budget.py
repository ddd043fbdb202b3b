"""memory_budget: the rounds of global dispatch cut so that the communication buffers of the batches in flight
(pipeline_depth times the most a rank sends and receives in one round) stay within a byte budget per rank
(muon_dist.plan: Options.memory_budget, BUDGET_FLOOR_ROUNDS, floor_round, round_buffers, buffer_bytes). The budget moves
params between rounds only: the same owners, the same bits; a bad value is refused in one line at construction."""

from __future__ import annotations

import importlib

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from muon_dist import DistributedMuon, Entry, Options, buffer_bytes, plan
from muon_dist.paths import PATHS
from muon_dist.plan import (
    BUDGET_FLOOR_ROUNDS,
    PIPELINE_DEPTH,
    ROUND_MIN_ELEMENTS,
    floor_round,
    round_buffers,
)
from tests.conftest import examples

from .batches import layout_1d
from .checks import run_case, timeout_for
from .workers import Case

ITEMSIZES = {"torch.float32": 4, "torch.bfloat16": 2}
plan_module = importlib.import_module("muon_dist.plan")  # (muon_dist.plan the name is the function)

pytestmark = pytest.mark.timeout(timeout_for(60))


def _entries(spec: list, W: int) -> tuple[Entry, ...]:
    """fp32 params of a 1-D mesh of W ranks, bf16 directions and updates (as DistributedMuon plans preset
    "torch"), one param group."""
    return tuple(
        Entry(
            layout_1d(shape, placement, W, "torch.float32"),
            0,
            "torch.bfloat16",
            True,
            "torch.bfloat16",
        )
        for shape, placement in spec
    )


def _rounds(step_plan) -> list:
    return [b for b in step_plan.batches if b.path == "global_all_to_all"]


def _within(step_plan, W: int, budget: int) -> bool:
    """Whether the plan's depth (pipeline_depth, as the step runs it) times what any rank sends and receives in
    any round (the path's own traffic formula, the one the ranks' ledgers are checked against) is within
    `budget`, at the default depth or, at the floor (every round at most one param per owner: no more rounds make
    any round smaller), at the most rounds in flight that fit; else whether it is at the floor with one round in
    flight."""
    depth = step_plan.options.pipeline_depth
    batches = _rounds(step_plan)
    most = max(
        (
            sum(PATHS[b.path].expected_bytes(b, rank, ITEMSIZES))
            for b in batches
            for rank in range(W)
        ),
        default=0,
    )
    floor = all(len(set(b.owners)) == len(b.owners) for b in batches)
    if depth * most <= budget:
        return depth == PIPELINE_DEPTH or (floor and (depth + 1) * most > budget)
    return floor and depth == 1


shapes = st.lists(
    st.tuples(
        st.sampled_from([(64, 32), (32, 96), (17, 40), (5, 3), (1, 7)]),
        st.sampled_from(["S0", "S1"]),
    ),
    min_size=1,
    max_size=24,
)


@settings(max_examples=examples(1.0))
@given(W=st.integers(2, 6), spec=shapes, budget=st.integers(1, 1 << 16))
@example(
    W=2, spec=[((1, 7), "S0")], budget=1
)  # its owner holds it whole: a round that moves nothing
def test_each_round_keeps_its_buffers_within_the_budget_with_the_owners_of_one_round(
    W: int, spec: list, budget: int
) -> None:
    """Contract: with memory_budget=B the batches in flight times what any rank sends and receives in a round of
    global dispatch stay within B (the traffic of the path's expected_bytes, not the planner's own model): by
    more rounds, and where every round holds one param per owner, by fewer rounds in flight (as many as fit, at
    least one; _within). The budget only cuts the rounds: every param keeps the owner that one round gives it,
    and the other batches are as in one round. Where the default plan exceeds B, this one has more rounds or
    fewer in flight."""
    entries = _entries(spec, W)
    one = plan(entries, Options(dispatch="global", rounds=1))
    cut = plan(entries, Options(dispatch="global", memory_budget=budget))
    assert _within(cut, W, budget)
    owner = {i: o for b in _rounds(one) for i, o in zip(b.params, b.owners)}
    assert {i: o for b in _rounds(cut) for i, o in zip(b.params, b.owners)} == owner
    assert [b for b in cut.batches if b.path != "global_all_to_all"] == [
        b for b in one.batches if b.path != "global_all_to_all"
    ]
    default = plan(entries, Options(dispatch="global"))
    if not _within(default, W, budget):
        shallower = cut.options.pipeline_depth < default.options.pipeline_depth
        assert len(_rounds(cut)) > len(_rounds(default)) or shallower


def _model_of(W: int, layers: int = 12) -> tuple[Entry, ...]:
    """A dense model's matrices, large enough that four rounds hold many times its largest matrix:
    per layer q, k, v, o of 256 x 256 and an MLP of 1024 x 256 and 256 x 1024, Shard(0) over W ranks."""
    per_layer = [(256, 256)] * 4 + [(1024, 256), (256, 1024)]
    return _entries([(shape, "S0") for _ in range(layers) for shape in per_layer], W)


@pytest.mark.parametrize("W", [2, 3, 4])
def test_the_default_budget_is_four_thirds_of_the_floor_round_per_round_in_flight(
    monkeypatch: pytest.MonkeyPatch, W: int
) -> None:
    """Contract: memory_budget None is, per shard group and dtype pair, pipeline_depth times 4/3
    (BUDGET_FLOOR_ROUNDS) of floor_round: 2 (W - 1) / W of the largest matrix (1024 x 256) at 2 + 2 bytes an
    element. On 12 dense layers the default plan is the plan with that budget given, which the rounds by size
    (four) exceed, so it has more, all within it; on a set whose rounds would fall under ROUND_MIN_ELEMENTS the
    default budget adds none (an explicit one does) and never lowers the depth. Negative control: a planner that
    ignores the budget keeps four rounds on 12 layers and breaks the contract."""
    assert BUDGET_FLOOR_ROUNDS == (4, 3)
    floor = 2 * (W - 1) * 1024 * 256 * 4 // W
    budget = PIPELINE_DEPTH * 4 * floor // 3
    big = _model_of(W)
    assert floor_round([e.layout.geometry for e in big], 4) == floor
    cut = plan(big, Options(dispatch="global"))
    assert cut.batches == plan(big, Options(dispatch="global", memory_budget=budget)).batches
    assert len(_rounds(cut)) > 4 and _within(cut, W, budget)
    assert not _within(plan(big, Options(dispatch="global", rounds=4)), W, budget)
    assert sum(32 * 96 for _ in range(16)) < ROUND_MIN_ELEMENTS
    tiny = _entries([((32, 96), "S0")] * 16, W)
    assert len(_rounds(plan(tiny, Options(dispatch="global")))) == 1
    assert plan(tiny, Options(dispatch="global")).options.pipeline_depth == PIPELINE_DEPTH
    assert len(_rounds(plan(tiny, Options(dispatch="global", memory_budget=3 * 32 * 96 * 4)))) > 1

    plan_module.plan.cache_clear()
    monkeypatch.setattr(
        plan_module,
        "_within_budget",
        lambda g, o, c, counts, round_of, *rest: (counts[0], round_of, 0),
    )
    ignored = plan_module.plan(big, Options(dispatch="global"))
    plan_module.plan.cache_clear()
    assert len(_rounds(ignored)) == 4 and not _within(ignored, W, budget)


def test_round_buffers_is_the_paths_traffic_and_buffer_bytes_the_depth_times_the_largest_batch() -> (
    None
):
    """Contract: round_buffers (the planner's model of a round, per member) equals sent + received of the path's
    expected_bytes (the formula the ranks' ledgers are checked against) for every round and rank, and
    buffer_bytes is min(pipeline_depth, batches) times a rank's largest batch. Control: an owner's term with the
    box not taken out (the whole matrix) differs."""
    W = 3
    step_plan = plan(_model_of(W, layers=2), Options(dispatch="global", rounds=3))
    for b in _rounds(step_plan):
        traffic = [sum(PATHS[b.path].expected_bytes(b, r, ITEMSIZES)) for r in range(W)]
        assert round_buffers(b.geometries, b.owners, 4) == traffic
        whole = [0] * W
        for g, o in zip(b.geometries, b.owners):
            for r in range(W):
                whole[r] += (sum(g.sizes) if r == o else g.sizes[r]) * 4
        assert whole != traffic
    for r in range(W):
        largest = max(sum(PATHS[b.path].expected_bytes(b, r, ITEMSIZES)) for b in step_plan.batches)
        assert buffer_bytes(step_plan, r, ITEMSIZES) == 3 * largest


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(memory_budget=0),
            "memory_budget must be None or an int >= 1 (bytes per rank), got 0",
        ),
        (
            dict(memory_budget=-4),
            "memory_budget must be None or an int >= 1 (bytes per rank), got -4",
        ),
        (
            dict(memory_budget=True),
            "memory_budget must be None or an int >= 1 (bytes per rank), got True",
        ),
        (
            dict(memory_budget=2.0),
            "memory_budget must be None or an int >= 1 (bytes per rank), got 2.0",
        ),
        (
            dict(memory_budget="1"),
            "memory_budget must be None or an int >= 1 (bytes per rank), got '1'",
        ),
        (
            dict(memory_budget=1 << 20, rounds=4),
            "memory_budget sets the rounds of dispatch='global'; give it with rounds=None and "
            "dispatch='global', got rounds=4, dispatch='global'",
        ),
        (
            dict(memory_budget=1 << 20, dispatch="batched"),
            "memory_budget sets the rounds of dispatch='global'; give it with rounds=None and "
            "dispatch='global', got rounds=None, dispatch='batched'",
        ),
    ],
)
def test_a_bad_memory_budget_is_refused_in_one_line_at_construction(
    kwargs: dict, message: str
) -> None:
    """memory_budget: None or an int >= 1 of bytes, with rounds None and global dispatch; anything else raises
    ValueError naming the parameter and the value when the optimizer is built (on every rank, before any
    collective)."""
    import torch

    with pytest.raises(ValueError) as refused:
        DistributedMuon([torch.zeros(4, 4, requires_grad=True)], **kwargs)
    assert str(refused.value) == message
    built = DistributedMuon([torch.zeros(4, 4, requires_grad=True)], memory_budget=1 << 20)
    assert built.options.memory_budget == 1 << 20


@pytest.mark.timeout(timeout_for(120))
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_step_under_a_small_budget_equals_muon_ref_bitwise(world_size: int) -> None:
    """Contract: a budget that cuts the step into one round per param and owner, one in flight, gives muon_ref's
    params and momentum buffers bitwise, with the planned paths, bytes and collectives (run_case; its negative controls:
    tests/dist/test_equivalence.py's sabotaged steps)."""
    shapes = ((8, 6),) * 6 + ((6, 10),) * 3 + ((5, 7),)
    placements = ("S0",) * 6 + ("S1",) * 3 + ("plain",)
    entries = _entries([(s, p) for s, p in zip(shapes[:9], placements[:9])], world_size)
    tight_plan = plan(entries, Options(dispatch="global", memory_budget=1))
    tight = _rounds(tight_plan)
    assert all(len(set(b.owners)) == len(b.owners) for b in tight)
    assert tight_plan.options.pipeline_depth == 1
    assert len(tight) > len(_rounds(plan(entries, Options(dispatch="global"))))
    case = Case(shapes, placements, options=(("memory_budget", 1),))
    run_case(world_size, case)
