"""Each path, alone, on the in-process ThreadComm: its reference equation holds bitwise, its ledger matches
the plan's byte formulas and collectives, and AGRS keeps signed zeros (on threads and on gloo)."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import muon_ref
from muon_check.fixtures import bits
from muon_dist import Group, ThreadComm, ThreadWorld
from muon_dist.comm import run_threads as run_on_threads
from muon_dist.geometry import Box, whole
from muon_dist.paths import PATHS, agrs
from muon_dist.paths.shards import join
from tests.conftest import examples

from .batches import batch_of, box, layout_1d
from .checks import timeout_for

_NS = functools.partial(muon_ref.newton_schulz, **muon_ref.MuonConfig().ns_kwargs())
ITEMSIZES = {"torch.float32": 4, "torch.bfloat16": 2}


def NS(x: torch.Tensor, frame=None) -> torch.Tensor:
    """muon_ref's kernel on a whole matrix (the kernels' signature: the frame is the whole param here)."""
    return _NS(x)


def run_threads(
    W: int, path: str, fulls: list[torch.Tensor], placement: str, kernel, out_dtype
) -> list[dict]:
    """Every rank's run of `path` on its boxes of `fulls`: {"updates", "ledger", "expected"}, or raises."""
    world, results = ThreadWorld(W, timeout_s=20), [None] * W
    layout = layout_1d(tuple(fulls[0].shape), placement, W, fulls[0].dtype)
    batch = batch_of(path, layout, len(fulls), out_dtype)

    def rank_main(rank: int) -> None:
        comm = ThreadComm(world, rank)
        ups = PATHS[path].run(
            comm,
            Group(tuple(range(W))),
            batch,
            [box(f, layout, rank) for f in fulls],
            [kernel] * len(fulls),
        )
        want = PATHS[path].expected_bytes(
            batch, rank, ITEMSIZES
        )  # None: no collective, so no ledger entry
        results[rank] = {
            "updates": ups,
            "ledger": dict(comm.ledger),
            "expected": {} if want is None else {path: want},
            "layout": layout,
            "rank": rank,
            "calls": [c[1] for c in comm.calls],
        }

    run_on_threads(W, rank_main)
    return results


def assert_equation(results: list[dict], fulls: list[torch.Tensor], kernel, out_dtype) -> None:
    """run(batch)[k] == box_r(kernel(full(batch[k]))) on every rank r, bit for bit; bytes as planned."""
    wants = [kernel(f, None).to(out_dtype) for f in fulls]
    for r in results:
        lay = r["layout"]
        assert len(r["updates"]) == len(fulls), (len(r["updates"]), len(fulls))
        for got, want in zip(r["updates"], wants):
            mine = box(want, lay, r["rank"])
            assert torch.equal(bits(got), bits(mine)), (lay, got, mine)
        assert {k: tuple(v) for k, v in r["ledger"].items()} == r["expected"]
        for path in r[
            "ledger"
        ]:  # none: the all-to-all family in a group of one calls no collective
            assert r["calls"] == COLLECTIVES[path], (path, r["calls"])


COLLECTIVES = {
    "all_to_all": ["all_to_all"] * 2,
    "padded_all_to_all": ["all_to_all"] * 2,
    "agrs": ["all_gather", "reduce_scatter"],
    "replicated": ["all_gather"],
}


# tested elsewhere: expert stacks (tests/dist/test_experts.py), LPT owners over mixed shapes
# (tests/dist/test_global_dispatch.py), separate blocks (tests/dist/test_blocks_tp.py)
ELSEWHERE = {"local", "subgroup_all_gather", "global_all_to_all", "blocks"}


@st.composite
def batches(draw) -> tuple:
    W = draw(st.integers(1, 8))
    path = draw(st.sampled_from(sorted(set(PATHS) - ELSEWHERE)))
    count = W if path == "all_to_all" else draw(st.integers(1, W))
    shape = (draw(st.integers(1, 2 * W + 2)), draw(st.integers(1, 2 * W + 2)))
    placement = "R" if path == "replicated" else draw(st.sampled_from(["S0", "S1"]))
    return (
        W,
        path,
        count,
        shape,
        placement,
        draw(st.sampled_from([torch.float32, torch.bfloat16])),
        draw(st.integers(0, 999)),
    )


@pytest.mark.timeout(timeout_for(120))
@example(drawn=(4, "all_to_all", 4, (5, 3), "S0", torch.float32, 0))  # rank 3 holds an empty shard
@example(drawn=(8, "agrs", 3, (1, 9), "S0", torch.bfloat16, 0))  # one row on 8 ranks: 7 empty boxes
@settings(max_examples=examples(2.0))
@given(drawn=batches())
def test_each_path_returns_this_ranks_box_of_the_kernel_on_the_whole_matrix(drawn: tuple) -> None:
    W, path, count, shape, placement, dtype, seed = drawn
    gen = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(shape, generator=gen).to(dtype) for _ in range(count)]
    results = run_threads(W, path, fulls, placement, NS, torch.bfloat16)
    assert_equation(results, fulls, NS, torch.bfloat16)


def _negative_zeros(x: torch.Tensor, frame=None) -> torch.Tensor:
    """A kernel whose output holds -0.0 (where x > 0) and +0.0 (where x <= 0)."""
    return torch.where(x > 0, torch.full_like(x, -0.0), torch.zeros_like(x))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("W, count", [(2, 1), (4, 3), (5, 5)])
def test_agrs_keeps_the_sign_of_zero_bitwise(W: int, count: int) -> None:
    fulls = [torch.randn(7, 3, generator=torch.Generator().manual_seed(i)) for i in range(count)]
    assert_equation(
        run_threads(W, "agrs", fulls, "S0", _negative_zeros, torch.float32),
        fulls,
        _negative_zeros,
        torch.float32,
    )


@pytest.mark.timeout(60)
def test_agrs_with_plus_zero_padding_loses_negative_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agrs, "ADDITIVE_IDENTITY", 0.0)
    fulls = [torch.randn(7, 3, generator=torch.Generator().manual_seed(0))]
    with pytest.raises(AssertionError):
        assert_equation(
            run_threads(2, "agrs", fulls, "S0", _negative_zeros, torch.float32),
            fulls,
            _negative_zeros,
            torch.float32,
        )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gloo_reduce_scatter_keeps_the_sign_of_zero_in_agrs(dtype: str) -> None:
    from .conftest import get_pool
    from .workers import agrs_on_gloo

    assert get_pool(3).run(agrs_on_gloo, dtype, timeout=30) == [True] * 3


def test_join_refuses_pieces_whose_boxes_do_not_tile_the_frame() -> None:
    """shards.join builds the frame in uninitialised memory, so boxes that leave part of it uncovered would hand
    garbage to the kernel: it asserts that the boxes fill the frame (proofs/paths.md#shard1)."""
    frame = whole((4, 3))
    top, bottom = Box((0, 0), (2, 3)), Box((2, 0), (2, 3))
    pieces = [torch.arange(6.0), torch.arange(6.0, 12.0)]
    assert torch.equal(
        bits(join(pieces, [top, bottom], frame)), bits(torch.arange(12.0).reshape(4, 3))
    )
    with pytest.raises(AssertionError):
        join(pieces[:1], [top], frame)  # the bottom half never written


@pytest.mark.parametrize(
    "W, count, placement, joined_in_place",
    [
        # each member owns one param: its rows arrive in member order, nothing between
        (2, 2, "S0", 2),
        (3, 3, "S0", 3),
        # two owned params in a group of two: the first of the largest travels last from member 0 and first
        # from member 1 (batch.travel_order), so its rows lie side by side; the other's are apart
        (2, 4, "S0", 2),
        # two owned params in a group of three: member 1's boxes of both lie between member 0's and member 2's
        (3, 6, "S0", 0),
        # columns: the pieces are not the param's row-major order
        (3, 3, "S1", 0),
    ],
)
def test_an_owner_joins_a_param_in_its_receive_buffer_without_a_copy_where_the_rows_lie_in_order(
    W: int, count: int, placement: str, joined_in_place: int
) -> None:
    """The all-to-all exchange hands the owner's kernel a view of the receive buffer (shards.in_place: no joined
    copy, the same elements) exactly where a param's rows arrived in member order with nothing between them, and
    a new tensor otherwise (the cases with none in place are the control: the check tells a copy from a view).
    The updates stay the kernel's on the whole matrix, bitwise."""
    inputs: list[bool] = []

    def recording(x: torch.Tensor, frame=None) -> torch.Tensor:
        inputs.append(x._base is not None)  # a view of the receive buffer; join's copy has no base
        return NS(x)

    fulls = [torch.randn(6, 4, generator=torch.Generator().manual_seed(k)) for k in range(count)]
    results = run_threads(W, "all_to_all", fulls, placement, recording, torch.float32)
    assert_equation(results, fulls, NS, torch.float32)
    assert len(inputs) == count and sum(inputs) == joined_in_place, inputs


@pytest.mark.parametrize(
    "rows, owners, in_place",
    [
        # owner 0: params 0, 1, 3 (rows 2, 6, 6: the first of the largest is 1); owner 1: 2, 4 (rows 4, 8)
        ((2, 6, 4, 6, 8), (0, 0, 1, 0, 1), {1, 4}),
        # one owner of all, the largest last in param order
        ((2, 4, 8), (1, 1, 1), {2}),
        # control: reorder=False below, the boxes in param order
    ],
)
@pytest.mark.parametrize("reorder", [True, False])
def test_in_a_group_of_two_each_owner_reads_its_largest_param_where_it_arrived(
    monkeypatch: pytest.MonkeyPatch,
    rows: tuple[int, ...],
    owners: tuple[int, ...],
    in_place: set[int],
    reorder: bool,
) -> None:
    """Global all-to-all at W = 2 with params of several sizes: member 0 sends an owner's largest param (by
    elements, the first of the largest) last and member 1 first (batch.travel_order), so the owner's kernel reads
    it as a view of the receive buffer (no joined copy) and every other owned param from a copy; the updates stay
    the kernel's on each whole matrix, bitwise, with the planned bytes. Control (reorder=False): with the boxes
    sent in param order, no param of an owner of several is in place, and the check sees the difference."""
    from muon_dist.batch import Batch
    from muon_dist.paths import exchange

    if not reorder:
        monkeypatch.setattr(exchange, "travel_order", lambda owned, geometries, member: list(owned))
    W = 2
    layouts = [layout_1d((r, 3), "S0", W, torch.float32) for r in rows]
    batch = Batch(
        "global_all_to_all",
        tuple(range(len(rows))),
        tuple(lay.geometry for lay in layouts),
        owners,
        "torch.float32",
        "torch.float32",
    )
    fulls = [
        torch.randn(r, 3, generator=torch.Generator().manual_seed(r * 10 + k))
        for k, r in enumerate(rows)
    ]
    seen: dict[int, bool] = {}

    def recording(k: int):
        def kernel(x: torch.Tensor, frame=None) -> torch.Tensor:
            seen[k] = x._base is not None  # a view of the receive buffer; join's copy has no base
            return NS(x)

        return kernel

    world, results = ThreadWorld(W, timeout_s=20), [None] * W

    def rank_main(rank: int) -> None:
        comm = ThreadComm(world, rank)
        results[rank] = PATHS["global_all_to_all"].run(
            comm,
            Group((0, 1)),
            batch,
            [box(f, lay, rank) for f, lay in zip(fulls, layouts)],
            [recording(k) for k in range(len(rows))],
        )
        want = PATHS["global_all_to_all"].expected_bytes(batch, rank, ITEMSIZES)
        assert {k: tuple(v) for k, v in comm.ledger.items()} == {"global_all_to_all": want}

    run_on_threads(W, rank_main)
    for rank, updates in enumerate(results):
        for f, lay, got in zip(fulls, layouts, updates):
            assert torch.equal(bits(got), bits(box(NS(f).float(), lay, rank)))
    assert sorted(seen) == list(range(len(rows)))
    assert {k for k, v in seen.items() if v} == (in_place if reorder else set()), seen


@settings(max_examples=examples(1.0))
@given(
    W=st.integers(1, 5),
    rows=st.lists(st.integers(1, 9), min_size=1, max_size=7),
    data=st.data(),
)
def test_travel_order_moves_only_the_first_of_the_largest_and_only_from_the_end_members(
    W: int, rows: list[int], data
) -> None:
    """batch.travel_order on any owned params (any sizes, empty boxes too): a permutation of them; param order from
    every member but 0 and W - 1; from member 0 the first of the largest moved last, from member W - 1 first (at
    W = 1 member 0 is both: param order). Control: an order that moves the last of the largest differs wherever
    two params tie for the largest."""
    from muon_dist.batch import travel_order

    geometries = [layout_1d((r, 3), "S0", W, "torch.float32").geometry for r in rows]
    owned = sorted(data.draw(st.sets(st.integers(0, len(rows) - 1), min_size=1)))
    size = {k: sum(geometries[k].sizes) for k in owned}
    first_largest = next(k for k in owned if size[k] == max(size.values()))
    rest = [k for k in owned if k != first_largest]
    for member in range(W):
        got = travel_order(owned, geometries, member)
        assert sorted(got) == owned
        if len(owned) < 2 or W == 1 or 0 < member < W - 1:
            assert got == owned, (member, got)
        elif member == 0:
            assert got == rest + [first_largest], (member, got)
        else:
            assert got == [first_largest] + rest, (member, got)
    last_largest = [k for k in owned if size[k] == max(size.values())][-1]
    if W > 1 and last_largest != first_largest:
        assert travel_order(owned, geometries, W - 1)[0] != last_largest  # the control
