"""The NS cost model and the assignment rules of muon_dist.balance."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from muon_check.rules import imbalance, imbalance_by_rule, per_shape, round_robin
from muon_check.shapes import SHAPE_TABLES, ParamSpec
from muon_dist.balance import lpt, ns_flops, rounds

costs_st = st.lists(st.integers(1, 10**6), min_size=1, max_size=60)


def test_ns_flops_counts_the_three_products_of_each_step_on_the_wide_orientation():
    m, n = 3, 7  # A = X X^T: 2*9*7, A A: 2*27, B X: 2*9*7 per step
    assert (
        ns_flops(n, m, steps=2) == ns_flops(m, n, steps=2) == 2 * (2 * 9 * 7 + 2 * 27 + 2 * 9 * 7)
    )


@given(costs=costs_st, world_size=st.integers(1, 16))
def test_lpt_max_load_is_within_one_largest_unit_of_the_mean(costs, world_size):
    # list scheduling bound: each unit goes to a rank whose load is at most the mean of the loads before it
    owner = lpt(costs, world_size)
    loads = [sum(c for c, r in zip(costs, owner) if r == k) for k in range(world_size)]
    assert all(0 <= r < world_size for r in owner)
    assert max(loads) <= sum(costs) / world_size + max(costs)


@given(costs=costs_st, world_size=st.integers(1, 16))
def test_lpt_is_never_worse_than_round_robin_by_more_than_the_largest_unit(costs, world_size):
    rr = imbalance(costs, round_robin(costs, world_size), world_size)
    mean = sum(costs) / world_size
    assert imbalance(costs, lpt(costs, world_size), world_size) <= rr + max(costs) / mean


def test_a_lopsided_assignment_scores_above_one_negative_control():
    assert imbalance([5, 5, 5, 5], [0, 0, 0, 1], 2) == 1.5
    assert imbalance([5, 5, 5, 5], lpt([5, 5, 5, 5], 2), 2) == 1.0


def test_per_shape_batching_puts_remainders_on_the_first_ranks():
    specs = [ParamSpec(f"p{i}", (4, 4), "matrix") for i in range(5)] + [
        ParamSpec("q", (3, 4), "matrix")
    ]
    assert per_shape(specs, 4) == [0, 1, 2, 3, 0, 0]


def test_lpt_balances_the_moe_table_at_every_world_size_and_never_goes_below_the_bound():
    specs = SHAPE_TABLES["moe_30b_a3b"]()
    for world_size in (8, 64, 1024):
        r = imbalance_by_rule(specs, world_size)
        assert r["bound"] <= r["lpt"] <= 1.05 and r["lpt"] <= min(r["round_robin"], r["per_shape"])


def test_shape_tables_route_matrices_to_muon_and_the_rest_to_adamw():
    for name, table in SHAPE_TABLES.items():
        specs = table()
        assert all(
            s.is_muon == (len(s.shape) >= 2 and s.kind not in ("embedding", "head")) for s in specs
        ), name


def _round_loads(
    costs: list[int], owner: list[int], round_of: list[int], world_size: int, count: int
):
    return [
        [
            sum(c for c, o, r in zip(costs, owner, round_of) if o == w and r == k)
            for w in range(world_size)
        ]
        for k in range(count)
    ]


@given(
    shapes=st.lists(
        st.sampled_from([(256, 256), (1024, 256), (256, 1024), (64, 512)]), min_size=1, max_size=40
    ),
    world_size=st.integers(1, 8),
    count=st.integers(1, 6),
)
def test_rounds_give_ranks_with_the_same_costs_the_same_load_in_every_round(
    shapes, world_size, count
):
    """balance.rounds: every unit in a round, each rank's load in round r within its largest unit of 1/count of
    its load, and ranks whose units lpt gave the same costs (as a multiset) the same load in every round, so
    that no rank waits at a round's all-to-all for another's larger unit. Negative control: the test below."""
    costs = [ns_flops(*s) for s in shapes]
    owner = lpt(costs, world_size)
    round_of = rounds(costs, owner, count)
    assert all(0 <= r < count for r in round_of)
    loads = _round_loads(costs, owner, round_of, world_size, count)
    for w in range(world_size):
        mine = [c for c, o in zip(costs, owner) if o == w]
        for k in range(count):
            assert abs(loads[k][w] - sum(mine) / count) <= max(mine, default=0)
    multiset = [sorted(c for c, o in zip(costs, owner) if o == w) for w in range(world_size)]
    for a in range(world_size):
        for b in range(a):
            if multiset[a] == multiset[b]:
                assert all(loads[k][a] == loads[k][b] for k in range(count)), (a, b, loads)


def test_rounds_of_the_dense_set_are_balanced_where_param_order_rounds_are_not():
    """The 28 matrices of `python -m benchmarks`' dense set on W = 4 in 4 rounds: lpt gives every rank three
    (1024, 256)-like and four (256, 256) matrices; largest first to the least loaded round, every round is balanced (the sum over rounds of
    the slowest rank's load equals the mean load). Negative control: the same cut taking each rank's units in
    param order (the rule before) leaves rounds where one rank's load is twice another's."""
    from benchmarks.run import muon_specs

    costs = [ns_flops(*s.shape) for s in muon_specs("dense")]
    owner = lpt(costs, 4)
    loads = _round_loads(costs, owner, rounds(costs, owner, 4), 4, 4)
    assert sum(max(row) for row in loads) == sum(costs) / 4

    def param_order(costs, owner, count):  # each rank's units in their order, the same midpoint cut
        totals, seen, out = {}, {}, []
        for c, r in zip(costs, owner):
            totals[r] = totals.get(r, 0) + c
        for c, r in zip(costs, owner):
            before = seen.get(r, 0)
            seen[r] = before + c
            out.append(min(count - 1, (2 * before + c) * count // (2 * totals[r])))
        return out

    before = _round_loads(costs, owner, param_order(costs, owner, 4), 4, 4)
    assert sum(max(row) for row in before) > 1.25 * sum(costs) / 4
    assert any(max(row) >= 2 * min(row) for row in before)
