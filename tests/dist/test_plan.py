"""The planner: a pure function whose plan is the same on every rank, checks itself, and whose digest changes
exactly when what the ranks must agree on changes."""

from __future__ import annotations

import dataclasses
import importlib
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from muon_dist import Entry, Options, expected_bytes, plan
from muon_dist.balance import lpt, ns_flops
from muon_dist.paths import PATHS
from muon_dist.plan import PACK_MIN_ELEMENTS, ROUND_MIN_ELEMENTS, ROUNDS, round_count
from tests.conftest import examples

from .batches import layout_1d, layout_ep
from .checks import timeout_for
from .test_experts import placed_models, textbook_path

ITEMSIZES = {"torch.float32": 4, "torch.bfloat16": 2}

pytestmark = pytest.mark.timeout(timeout_for(60))


def entry(
    rank: int, W: int, shape: tuple[int, int], placement: str, group: int = 0, active: bool = True
) -> Entry:
    """What rank `rank` plans for a param (a layout is rank-independent: `rank` shows the plan does not vary)."""
    return Entry(layout_1d(shape, placement, W, "torch.float32"), group, "torch.bfloat16", active)


specs = st.lists(
    st.tuples(
        st.sampled_from([(5, 3), (4, 4), (1, 7)]),
        st.sampled_from(["S0", "S1", "R"]),
        st.integers(0, 1),
        st.booleans(),
    ),
    min_size=1,
    max_size=20,
)


@settings(max_examples=examples(2.0))
@given(
    W=st.integers(1, 8),
    spec=specs,
    options=st.sampled_from([Options(), Options("padded_all_to_all"), Options(force_path="agrs")]),
)
def test_every_rank_plans_the_same_batches_and_digest(W: int, spec: list, options: Options) -> None:
    plans = [plan(tuple(entry(r, W, *s) for s in spec), options) for r in range(W)]
    assert len({p.digest() for p in plans}) == 1
    assert len({p.batches for p in plans}) == 1
    paths = plans[0].path_of()
    assert [p is not None for p in paths] == [s[3] for s in spec]
    for batch in plans[0].batches:
        assert len({spec[i][:3] for i in batch.params}) == 1  # one layout and group per batch
        assert (batch.path == "replicated") == (spec[batch.params[0]][1] == "R")


@pytest.mark.parametrize("change", ["shape", "placement", "active", "group"])
def test_the_digest_changes_when_what_ranks_must_agree_on_changes(change: str) -> None:
    a = (entry(0, 4, (5, 3), "S0"), entry(0, 4, (4, 4), "S1"))
    changed = {
        "shape": entry(0, 4, (3, 5), "S0"),
        "placement": entry(0, 4, (5, 3), "S1"),
        "active": entry(0, 4, (5, 3), "S0", active=False),
        "group": entry(0, 4, (5, 3), "S0", group=1),
    }[change]
    assert plan(a, Options()).digest() != plan((changed, a[1]), Options()).digest()


def test_full_batches_take_all_to_all_and_the_remainder_the_remainder_path() -> None:
    entries = tuple(entry(0, 4, (5, 3), "S0") for _ in range(6))
    assert plan(entries, Options()).path_of() == ("all_to_all",) * 4 + ("agrs",) * 2
    padded = plan(entries, Options("padded_all_to_all"))
    last = padded.batches[-1]
    assert (
        padded.path_of()[4:] == ("padded_all_to_all",) * 2
        and last.group_size - len(last.params) == 2
    )  # padding


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(remainder="all_to_all"),
        dict(force_path="replicated"),
        dict(force_path="all_to_all"),
        dict(force_path="x"),
    ],
)
def test_unknown_path_options_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="must be"):
        Options(**kwargs)


def test_the_plan_checks_its_own_invariants() -> None:
    p = plan(tuple(entry(0, 2, (5, 3), "S0") for _ in range(2)), Options())
    with pytest.raises(AssertionError):
        dataclasses.replace(p, batches=p.batches[:0])


mixed = st.lists(
    st.tuples(
        st.sampled_from([(5, 3), (4, 4), (1, 7)]),
        st.sampled_from(["S0", "S1", "R"]),
        st.integers(0, 1),
        st.booleans(),
        st.sampled_from(["torch.bfloat16", "torch.float32"]),
    ),
    min_size=1,
    max_size=20,
)


@settings(max_examples=examples(1.0))
@given(W=st.integers(1, 6), spec=mixed, remainder=st.sampled_from(["agrs", "padded_all_to_all"]))
def test_global_dispatch_merges_the_all_to_all_family_per_shard_group_and_dtype_pair_with_lpt_owners(
    W: int, spec: list, remainder: str
) -> None:
    """plan.py's docstring: every batch of a global_dispatch path merged into one global_all_to_all batch per
    (shard groups, direction dtype, update dtype), params in param-group order, owners by LPT on each param's
    Newton-Schulz FLOPs; the other batches stay as they are, in order, in runs between the global batches (each
    run of floor or ceil of others / globals batches right before its global batch, nothing after the last)."""
    entries = tuple(
        Entry(layout_1d(shape, placement, W, "torch.float32"), group, update, active)
        for shape, placement, group, active, update in spec
    )
    batched = plan(entries, Options(remainder, rounds=1))
    merged = plan(entries, Options(remainder, dispatch="global", rounds=1))
    # (a shard group of one moves nothing: its batches stay as they are)
    kept = [b for b in batched.batches if not PATHS[b.path].global_dispatch or b.group_size == 1]
    merged_globals = [b for b in merged.batches if b.path == "global_all_to_all"]
    assert [b for b in merged.batches if b.path != "global_all_to_all"] == kept
    if merged_globals:
        K, G = len(kept), len(merged_globals)
        ends = [i for i, b in enumerate(merged.batches) if b.path == "global_all_to_all"]
        assert ends[-1] == len(merged.batches) - 1
        lengths = [end - start - 1 for start, end in zip([-1, *ends], ends)]
        assert all(n in (K // G, -(-K // G)) for n in lengths), (lengths, K, G)
    runs: dict[tuple, list[int]] = {}
    for b in batched.batches:
        if PATHS[b.path].global_dispatch and b.group_size > 1:
            runs.setdefault((b.geometries[0].groups, b.direction_dtype, b.update_dtype), []).extend(
                b.params
            )
    assert len(merged.batches) == len(kept) + len(runs)
    for b, ((groups, direction, update), params) in zip(merged_globals, runs.items()):
        costs = [ns_flops(*entries[i].layout.global_shape) for i in sorted(params)]
        assert (b.path, b.params, b.owners) == (
            "global_all_to_all",
            tuple(sorted(params)),
            tuple(lpt(costs, W)),
        )
        assert (b.geometries[0].groups, b.direction_dtype, b.update_dtype) == (
            groups,
            direction,
            update,
        )
        assert b.geometries == tuple(entries[i].layout.geometry for i in b.params)


@settings(max_examples=examples(1.0))
@given(
    drawn=placed_models(), count=st.integers(1, 3), dispatch=st.sampled_from(["batched", "global"])
)
def test_expert_stacks_take_the_path_their_boxes_call_for(
    drawn: tuple, count: int, dispatch: str
) -> None:
    """Where the field's three cases apply (test_experts.textbook_path): local, subgroup_all_gather, else the
    all-to-all family (all_to_all for a full batch, the remainder path otherwise; global_all_to_all under global
    dispatch, which merges that family alone: local and subgroup_all_gather batches stay as they are)."""
    model, (ep, fsdp) = drawn
    E, m, n, fused = model["E"], model["m"], model["n"], model["fused"]
    layout = layout_ep(
        (E * m, n) if fused else (E, m, n), ep, fsdp, "torch.float32", E if fused else None
    )
    want = textbook_path(E, m, fused, ep, fsdp)
    options = Options(dispatch=dispatch)
    paths = plan(
        tuple(Entry(layout, 0, "torch.float32", True) for _ in range(count)), options
    ).path_of()
    family = {"global_all_to_all"} if dispatch == "global" else {"all_to_all", "agrs"}
    if want is not None:
        assert paths == (want,) * count, (layout, paths)
    else:
        assert set(paths) <= family | {"local", "subgroup_all_gather"}, paths


@pytest.mark.parametrize("name", sorted(PATHS))
def test_options_take_as_remainder_or_forced_path_only_the_paths_that_take_any_batch_size(
    name: str,
) -> None:
    """agrs and padded_all_to_all take a batch of any size up to W; every other path (all_to_all: full batches only;
    global_all_to_all: the merged batch that global dispatch builds; the expert, blocks and replicated paths: chosen
    by the layout) is refused by name in both fields."""
    if name in ("agrs", "padded_all_to_all"):
        assert (Options(name).remainder, Options(force_path=name).force_path) == (name, name)
        return
    with pytest.raises(ValueError, match=f"remainder must be one of .*, got '{name}'"):
        Options(name)
    with pytest.raises(ValueError, match=f"force_path must be None or one of .*, got '{name}'"):
        Options(force_path=name)


def test_options_read_their_names_by_value_as_a_command_line_gives_them() -> None:
    """argparse and config files give new str objects, never the interned literals: they select what the literals
    select, refusals included."""
    built = {name: "".join(list(name)) for name in ("global", "agrs", "padded_all_to_all")}
    assert all(b == n and b is not n for n, b in built.items())
    with pytest.raises(ValueError, match="force_path must be None"):
        Options(dispatch=built["global"], force_path=built["agrs"])
    entries = tuple(entry(0, 4, (5, 3), "S0") for _ in range(6))
    assert plan(entries, Options(dispatch=built["global"])).path_of() == ("global_all_to_all",) * 6
    assert (
        plan(entries, Options(built["padded_all_to_all"])).path_of()
        == ("all_to_all",) * 4 + ("padded_all_to_all",) * 2
    )


@settings(max_examples=examples(1.0))
@given(W=st.integers(2, 6), spec=mixed, count=st.integers(1, 8))
def test_global_rounds_cut_the_merged_batch_keeping_every_owner_and_about_one_round_of_its_load_each(
    W: int, spec: list, count: int
) -> None:
    """Options.rounds with dispatch="global": each merged batch cut into up to `count` global_all_to_all batches
    (muon_dist.balance.rounds): the same params in param order, each with the owner LPT gives it in the merged
    batch, and every owner's load in round r within one param's cost of 1/count of its load."""
    entries = tuple(
        Entry(layout_1d(shape, placement, W, "torch.float32"), group, update, active)
        for shape, placement, group, active, update in spec
    )
    one = plan(entries, Options(dispatch="global", rounds=1))
    cut = plan(entries, Options(dispatch="global", rounds=count))

    def key(b):
        return b.geometries[0].groups, b.direction_dtype, b.update_dtype

    whole = {
        i: (b.owners[k], key(b))
        for b in one.batches
        if b.path == "global_all_to_all"
        for k, i in enumerate(b.params)
    }
    parts = [b for b in cut.batches if b.path == "global_all_to_all"]
    assert [b for b in cut.batches if b.path != "global_all_to_all"] == [
        b for b in one.batches if b.path != "global_all_to_all"
    ]
    assert sorted(i for b in parts for i in b.params) == sorted(whole)
    assert all(list(b.params) == sorted(b.params) for b in parts)
    for b in parts:
        assert all(whole[i] == (o, key(b)) for i, o in zip(b.params, b.owners))
    cost = {i: ns_flops(*entries[i].layout.global_shape) for i in whole}
    for merged_key in {k for _, k in whole.values()}:
        mine = [b for b in parts if key(b) == merged_key]
        assert len(mine) <= count
        for owner in range(W):
            owned = [cost[i] for i, (o, k) in whole.items() if o == owner and k == merged_key]
            for b in mine:
                load = sum(cost[i] for i, o in zip(b.params, b.owners) if o == owner)
                assert abs(load - sum(owned) / count) <= max(owned, default=0), (
                    owner,
                    load,
                    owned,
                    count,
                )


@settings(max_examples=examples(1.0))
@given(W=st.integers(1, 6), spec=mixed, count=st.integers(1, 8))
# two same-shape params in a group of one, which packs whatever the rounds (found by the thorough profile)
@example(W=1, spec=[((5, 3), "S0", 0, True, "torch.bfloat16")] * 2, count=1)
def test_batched_all_to_all_batches_pack_same_layout_full_batches_up_to_one_round_of_the_step(
    W: int, spec: list, count: int
) -> None:
    """Options.rounds with dispatch="batched": a run's full batches of W are packed, k at a time, into one
    all_to_all batch (member j owns params j, j + W, ...), k the most that keeps the batch within 1/rounds of the
    step's elements (at least 1); the params' order, paths and traffic are those of batches of W."""
    entries = tuple(
        Entry(layout_1d(shape, placement, W, "torch.float32"), group, update, active)
        for shape, placement, group, active, update in spec
    )
    packed, single = plan(entries, Options(rounds=count)), plan(entries, Options(rounds=10**9))
    assert packed.path_of() == single.path_of()
    assert [i for b in packed.batches for i in b.params] == [
        i for b in single.batches for i in b.params
    ]
    cap = sum(math.prod(e.layout.global_shape) for e in entries if e.active) / count
    for b in packed.batches:
        if (
            b.path != "all_to_all" or b.group_size == 1
        ):  # a group of one: test_a_group_of_one_packs_...
            continue
        size = math.prod(entries[b.params[0]].layout.global_shape)
        assert len({entries[i].key() for i in b.params}) == 1
        assert b.owners == tuple(k % W for k in range(len(b.params)))
        assert len(b.params) == W or len(b.params) * size <= cap, (len(b.params), size, cap)
    # batches of W, but a group of one packs whatever the rounds (as above)
    for b in single.batches:
        assert b.path != "all_to_all" or b.group_size == 1 or len(b.params) == b.group_size
    for rank in range(W):
        assert expected_bytes(packed, rank, ITEMSIZES) == expected_bytes(single, rank, ITEMSIZES)


@settings(max_examples=examples(1.0))
@given(spec=mixed, count=st.integers(1, 8))
def test_a_group_of_one_packs_a_runs_params_up_to_the_steps_largest_param(
    spec: list, count: int
) -> None:
    """_packed in a shard group of one (W = 1), whatever the rounds: consecutive params of a run share a batch while
    its elements stay within the step's largest active param's or PACK_MIN_ELEMENTS, whichever is more (at least
    one param a batch), so same-shape matrices can share a stack kernel call and the step's peak stays about its
    largest param's; the params' order is that of batches of one."""
    entries = tuple(
        Entry(layout_1d(shape, placement, 1, "torch.float32"), group, update, active)
        for shape, placement, group, active, update in spec
    )
    packed = plan(entries, Options(rounds=count))
    largest = max(
        [math.prod(e.layout.global_shape) for e in entries if e.active] + [PACK_MIN_ELEMENTS]
    )
    single = plan(
        entries, Options(force_path="agrs")
    )  # batches of W = 1, each run in param-group order
    assert [i for b in packed.batches for i in b.params] == [
        i for b in single.batches for i in b.params
    ]
    for b in packed.batches:
        assert len({entries[i].key() for i in b.params}) == 1, b
        size = math.prod(entries[b.params[0]].layout.global_shape)
        if b.path == "replicated":
            assert len(b.params) == 1
        else:
            assert len(b.params) == 1 or len(b.params) * size <= largest, (b, largest)
    # the most a batch can take: a run never splits where the next param would still fit
    for first, second in zip(packed.batches, packed.batches[1:]):
        same_run = entries[first.params[0]].key() == entries[second.params[0]].key()
        if same_run and first.path == second.path != "replicated":
            size = math.prod(entries[first.params[0]].layout.global_shape)
            assert (len(first.params) + 1) * size > largest, (first, second, largest)


@pytest.mark.parametrize("side, want", [(16, 1), (64, 1), (128, 2), (160, 3), (256, 4), (1024, 4)])
def test_by_default_a_steps_rounds_hold_at_least_round_min_elements_each(
    side: int, want: int
) -> None:
    """Options.rounds None (DistributedMuon's default): global dispatch cuts a merged batch of E elements into
    min(ROUNDS, E // ROUND_MIN_ELEMENTS) rounds, at least one, before the memory budget adds any (a budget that
    binds on none here; the default budget's rounds: tests/dist/test_memory_budget.py); an explicit rounds= is
    taken as given. 32 (side, side) matrices on W = 4 (8 per owner, so every round has work): 2^17 elements in
    all (side 64) is one round, 2^19 (side 128) two, 819,200 (side 160) three, 2^21 (side 256) and more the four
    of ROUNDS. Negative control: ROUNDS rounds asked for explicitly cut the smaller steps into four rounds, which
    the default does not."""
    assert (ROUNDS, ROUND_MIN_ELEMENTS) == (4, 1 << 18)
    entries = tuple(entry(0, 4, (side, side), "S0") for _ in range(32))
    elements = 32 * side * side
    assert round_count(Options(dispatch="global"), elements) == want
    by_size = plan(entries, Options(dispatch="global", memory_budget=1 << 40)).batches
    asked = plan(entries, Options(dispatch="global", rounds=ROUNDS)).batches
    assert [b.path for b in by_size] == ["global_all_to_all"] * want
    assert len(asked) == ROUNDS and (want == ROUNDS) == (len(by_size) == len(asked))
    assert all(round_count(Options(rounds=r), elements) == r for r in (1, 3, 7))


def test_write_groups_that_end_with_a_check_of_their_own_hold_at_least_write_group_min_elements() -> (
    None
):
    """agreement.write_groups: a group whose last batch cannot carry the flag closes once it holds 1/WRITE_GROUPS
    of the step's elements, and at least WRITE_GROUP_MIN_ELEMENTS: a small step's batches without a free check
    write in one group (one failure check), a large step's in about WRITE_GROUPS. Negative control: with the
    floor at zero the small step is cut into one group per batch."""
    from muon_dist import agreement

    assert agreement.WRITE_GROUP_MIN_ELEMENTS == 1 << 18
    for side, groups in ((16, 1), (512, 16)):
        entries = tuple(entry(0, 4, (side, side), "S0") for _ in range(16 * 4))
        step_plan = plan(entries, Options(dispatch="batched", rounds=16))
        assert len(step_plan.batches) == 16
        assert len(agreement.write_groups(step_plan, False)) == groups, side
    small = plan(
        tuple(entry(0, 4, (16, 16), "S0") for _ in range(16 * 4)),
        Options(dispatch="batched", rounds=16),
    )
    floor = agreement.WRITE_GROUP_MIN_ELEMENTS
    try:
        agreement.WRITE_GROUP_MIN_ELEMENTS = 0
        assert len(agreement.write_groups(small, False)) == 16
    finally:
        agreement.WRITE_GROUP_MIN_ELEMENTS = floor


def test_in_a_group_of_one_expert_stacks_pack_too_up_to_the_largest_param():
    """At W = 1, four (2, 128, 256) expert stacks beside a (128, 1024) matrix (2^17 elements, over PACK_MIN_ELEMENTS):
    local batches of two stacks (the matrix's elements); the (4, 4) matrices all in one batch (PACK_MIN_ELEMENTS)."""
    assert 2 * (2 * 128 * 256) == 128 * 1024 > PACK_MIN_ELEMENTS
    stack = layout_ep((2, 128, 256), 1, 1, "torch.float32", None)
    matrix = layout_1d((128, 1024), "S0", 1, "torch.float32")
    small = layout_1d((4, 4), "S0", 1, "torch.float32")
    entries = (
        tuple(Entry(stack, 0, "torch.float32", True) for _ in range(4))
        + (Entry(matrix, 0, "torch.float32", True),)
        + tuple(Entry(small, 0, "torch.float32", True) for _ in range(3))
    )
    batches = plan(entries, Options()).batches
    assert [(b.path, b.params) for b in batches] == [
        ("local", (0, 1)),
        ("local", (2, 3)),
        ("all_to_all", (4,)),
        ("all_to_all", (5, 6, 7)),
    ]


def test_only_the_all_to_all_family_packs_expert_stacks_keep_batches_of_their_group():
    """_packed: local and subgroup_all_gather batches stay at the group's size however large the round's cap."""
    for ep, fsdp, shape, experts, path in (
        (2, 1, (4, 3, 2), None, "local"),
        (1, 4, (8, 3), 2, "subgroup_all_gather"),
    ):
        layout = layout_ep(shape, ep, fsdp, "torch.float32", experts)
        batches = plan(
            tuple(Entry(layout, 0, "torch.float32", True) for _ in range(8)), Options(rounds=1)
        ).batches
        assert [(b.path, len(b.params)) for b in batches] == [(path, ep * fsdp)] * (
            8 // (ep * fsdp)
        )


def test_an_expert_stack_is_one_sharded_along_its_expert_dim_only():
    """plan.is_expert_stack: a 3-D stack (or num_experts) whose placements shard dim 0 or replicate, on any mesh;
    sharded on another dim, not."""
    from muon_dist import ParamLayout
    from muon_dist.plan import is_expert_stack

    hsdp = ParamLayout(
        "p", (4, 6, 3), "torch.float32", ((0, 1), (2, 3)), ("R", "S0"), ("dp", "fsdp")
    )
    assert is_expert_stack(hsdp) and is_expert_stack(layout_ep((4, 3, 2), 2, 1, "torch.float32"))
    assert not is_expert_stack(layout_1d((4, 6, 3), "S1", 2, "torch.float32"))


def test_the_expert_paths_refuse_a_batch_with_owners():
    """local and subgroup_all_gather batches have no owners (every member steps its own boxes): check() refuses one
    with owners."""
    from .batches import batch_of

    for path, layout in (
        ("local", layout_ep((4, 3, 2), 2, 1, "torch.float32")),
        ("subgroup_all_gather", layout_ep((8, 3), 1, 4, "torch.float32", 2)),
    ):
        batch = batch_of(path, layout, 2, "torch.float32")
        PATHS[path].check(batch)
        with pytest.raises(AssertionError):
            PATHS[path].check(dataclasses.replace(batch, owners=(0, 1)))


def test_the_blocks_ledger_balances_on_a_group_of_300_ranks_with_owners_past_256():
    """Every byte a member sends another receives: summed over the group, sent == received, with a direction and an
    update of different dtypes, on a group large enough that owners are ints beyond CPython's small-int cache."""
    W = 300
    layout = dataclasses.replace(
        layout_1d((600, 4), "S0", W, "torch.float32"), split_sizes=(3,) * 200
    )  # every block straddles two ranks' boxes
    planned = plan((Entry(layout, 0, "torch.bfloat16", True),), Options())
    (batch,) = planned.batches
    assert batch.path == "blocks" and batch.direction_dtype != batch.update_dtype
    ledger = [expected_bytes(planned, rank, ITEMSIZES).get("blocks", (0, 0)) for rank in range(W)]
    assert sum(s for s, _ in ledger) == sum(r for _, r in ledger) > 0


@pytest.mark.parametrize("name", sorted(PATHS))
def test_every_path_is_a_record_named_as_registered(name: str) -> None:
    """PATHS maps each name to its module's frozen Path record: the record's name is its key, it is the module's
    own PATH (followable from the registry to the code), its functions are the module's, and a path carries the
    failure flag only where it runs as Steps (the flag travels in steps(..., flag=))."""
    path = PATHS[name]
    module = importlib.import_module(f"muon_dist.paths.{name}")
    assert path.name == name and module.PATH is path
    assert path.run is module.run and path.owners is module.owners and path.check is module.check
    assert path.steps is getattr(module, "steps", None)
    assert not path.carries_flag or path.pipelined
    with pytest.raises(dataclasses.FrozenInstanceError):
        path.name = "other"  # type: ignore[misc]


def test_a_record_that_carries_a_flag_without_steps_is_refused() -> None:
    """Negative control of the record's own invariant: carries_flag without steps cannot be declared."""
    with pytest.raises(AssertionError, match="a flag travels in steps"):
        dataclasses.replace(PATHS["agrs"], carries_flag=True)
