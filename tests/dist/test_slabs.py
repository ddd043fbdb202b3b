"""The momentum and write stages in slabs (muon_dist/elementwise.py: write_slabs, direction_in_slabs,
update_in_slabs): the slabs tile the box along its first dim, every one but the last a multiple of BLOCK elements,
and a stage run slab by slab gives each element the bits the reference gets on the whole tensor; the step runs
them so, with muon_ref's bits."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from muon_check.fixtures import bits
from muon_dist import Box, Options, elementwise
from muon_dist.elementwise import BLOCK, direction_in_slabs, update_in_slabs, write_slabs
from muon_ref.functional import apply_update, matrix_layout, momentum_direction
from muon_ref.optim import group_config
from muon_ref.presets import PRESETS, preset_defaults
from tests.conftest import examples

from .batches import layout_1d
from .checks import timeout_for
from .test_step_threads import Case, Group, assert_boxes_of_reference, on_threads

pytestmark = pytest.mark.timeout(timeout_for(60))


def check_slabs(box: Box, elements: int, slabs: list[Box]) -> None:
    """write_slabs' contract for one box: consecutive slabs along dim 0 that tile it, each spanning its other
    dims; every slab but the last a multiple of BLOCK elements; none larger than `elements` or than the fewest
    whole rows that make a multiple of BLOCK; the box itself where it is no larger than `elements`."""
    if not box.shape or box.numel <= elements:
        assert slabs == [box], (box, slabs)
        return
    row = math.prod(box.shape[1:])
    unit = BLOCK // math.gcd(BLOCK, row)
    at = box.offsets[0]
    for slab in slabs:
        assert slab.offsets[0] == at and slab.shape[0] >= 1, (box, slabs)
        assert slab.offsets[1:] == box.offsets[1:] and slab.shape[1:] == box.shape[1:], (box, slabs)
        assert slab.numel <= max(elements, unit * row), (box, elements, slab)
        at += slab.shape[0]
    assert at == box.offsets[0] + box.shape[0], (box, slabs)
    assert all(slab.numel % BLOCK == 0 for slab in slabs[:-1]), (box, slabs)


@settings(max_examples=examples(2.0))
@given(
    shape=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    offset=st.integers(0, 9),
    elements=st.integers(1, 600),
)
def test_slabs_tile_the_box_in_whole_rows_each_but_the_last_a_multiple_of_block(
    shape: list[int], offset: int, elements: int
) -> None:
    """write_slabs over boxes of 1-3 dims (empty ones too) and slab sizes: check_slabs' contract."""
    box = Box((offset,) * len(shape), tuple(shape))
    check_slabs(box, elements, write_slabs(box, elements))


def test_a_cutter_without_the_block_rule_fails_the_slab_check() -> None:
    """Control: slabs of elements // row rows (no rounding to whole blocks) tile the box but cut it inside a
    block, which check_slabs catches."""
    box, elements = Box((0, 0), (10, 3)), 10
    naive = [Box((r, 0), (min(3, 10 - r), 3)) for r in range(0, 10, 3)]
    with pytest.raises(AssertionError):
        check_slabs(box, elements, naive)


def stages_in_slabs(shape, placement, W, preset, dtype, seed, elements) -> None:
    """On every rank's box, direction_in_slabs (into a bf16 and a same-dtype buffer) and update_in_slabs (into
    the box's param itself) against the reference's stages on the whole tensor, bit for bit."""
    cfg = group_config(preset_defaults(preset, {}))
    gen = torch.Generator().manual_seed(seed)
    grad, buf, param = (torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
    update = torch.randn(shape, generator=gen).to(torch.bfloat16)
    mlayout = matrix_layout(shape)
    _, direction = momentum_direction(grad, buf, cfg)
    new_param = apply_update(param, update, mlayout, cfg)
    geometry = layout_1d(shape, placement, W, str(dtype)).geometry
    for rank in range(W):
        mine = geometry.boxes[geometry.member(rank)]
        on = lambda t: t[mine.index].contiguous()  # noqa: E731
        for out_dtype in (torch.bfloat16, dtype):
            out = torch.full(mine.shape, float("nan"), dtype=out_dtype)
            got = direction_in_slabs(cfg, on(grad), on(buf), mlayout, shape, mine, out, elements)
            assert got is out
            assert torch.equal(bits(out), bits(on(direction).to(out_dtype))), (rank, mine)
        own = on(param)
        got = update_in_slabs(cfg, own, on(update), mlayout, shape, mine, own, (), elements)
        assert got is own
        assert torch.equal(bits(own), bits(on(new_param))), (rank, mine)


@settings(max_examples=examples(1.0))
@example(
    shape=(129, 63), placement="S0", W=2, preset="torch", dtype=torch.bfloat16, seed=1, elements=64
)
@example(
    shape=(130, 64), placement="S1", W=4, preset="dion", dtype=torch.float32, seed=2, elements=1
)
@given(
    shape=st.tuples(st.integers(1, 140), st.integers(1, 70)),
    placement=st.sampled_from(["S0", "S1"]),
    W=st.integers(1, 4),
    preset=st.sampled_from(sorted(PRESETS)),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    seed=st.integers(0, 999),
    elements=st.integers(1, 700),
)
def test_the_stages_in_slabs_give_every_shard_the_whole_tensors_bits(
    shape, placement, W, preset, dtype, seed, elements
) -> None:
    """direction_in_slabs and update_in_slabs on any shard and slab size: the whole tensor's bits (the tails of
    uneven shards and of the tensor included; (129, 63) holds the global tail in its last box)."""
    stages_in_slabs(shape, placement, W, preset, dtype, seed, elements)


def test_slabs_that_leave_out_the_last_rows_fail_the_equality_check(monkeypatch) -> None:
    """Control: a cutter that drops the last slab leaves those rows of the outputs unwritten (NaN directions,
    the old param), which the check above catches."""
    real = elementwise.write_slabs
    monkeypatch.setattr(
        elementwise, "write_slabs", lambda box, elements=None: real(box, elements)[:-1]
    )
    with pytest.raises(AssertionError):
        stages_in_slabs((130, 64), "S0", 2, "torch", torch.float32, 0, 64)


GLOBAL = Options(
    dispatch="global"
)  # DistributedMuon's default (the plan's Options default to "batched")
SPLIT = (("split_sizes", (64, 64)),)
HEADS = (("num_heads", 2), ("split_dim", 1))


def on_two(group: Group, dtype: str, preset: str, **more) -> Case:
    """A case of one param group on a 1-D mesh of two ranks, global dispatch, not atomic."""
    return Case(2, (0, 1), (group,), dtype, preset, GLOBAL, False, **more)


# (case, whether the batch's path takes its directions packed), by id
STEP_CASES = {
    "uneven-tail": (
        on_two(Group((), ((130, 64), (129, 63)), (("S0",),) * 2), "bfloat16", "torch"),
        True,
    ),
    "columns": (
        on_two(Group((), ((130, 64), (96, 40)), (("S0",), ("S1",))), "float32", "dion"),
        True,
    ),
    "w3-batched-atomic": (
        Case(
            3,
            (0, 1, 2),
            (Group((), ((193, 32),) * 4, (("S0",),) * 4),),
            "float32",
            "torch",
            Options(),
            True,
        ),
        True,
    ),
    "split": (on_two(Group(SPLIT, ((128, 64),), (("S0",),)), "bfloat16", "torch"), False),
    "heads": (on_two(Group(HEADS, ((48, 64),), (("S0",),)), "float32", "moonlight"), False),
    "experts": (
        Case(
            4,
            ((0, 1), (2, 3)),
            (Group((("num_experts", 4),), ((64, 24),) * 2, (("S0", "S0"),) * 2),),
            "bfloat16",
            "xtuner",
            GLOBAL,
            False,
        ),
        False,
    ),
    "skipped": (
        on_two(
            Group((), ((130, 64),) * 2, (("S0",),) * 2),
            "float32",
            "torch",
            nonfinite=(1, 70 * 64 + 5),
            policy="skip",
        ),
        True,
    ),
    "stack-rows": (
        on_two(Group((), ((4, 64, 24),) * 2, (("S1",),) * 2), "bfloat16", "torch"),
        True,
    ),
    "experts-columns": (
        on_two(Group((("num_experts", 2),), ((64, 24),) * 2, (("S1",),) * 2), "float32", "torch"),
        True,
    ),
}


@pytest.mark.timeout(timeout_for(120))
@pytest.mark.parametrize("elements", [1, 300])
@pytest.mark.parametrize("case, packed", list(STEP_CASES.values()), ids=list(STEP_CASES))
def test_the_step_runs_its_stages_in_slabs_with_muon_refs_bits(
    monkeypatch, case: Case, packed: bool, elements: int
) -> None:
    """execute(out_params=...) with SLAB_ELEMENTS patched small, so that every large box is written slab by slab,
    and its direction computed slab by slab where the batch's path takes its directions packed (`packed`; the
    blocks path of separate layouts and the local path of expert stacks compute it on the box), both counted:
    more stage calls than boxes. Each rank's params and buffers are muon_ref's, bitwise, over two steps (dense
    params with uneven boxes and the global tail, column shards, W = 3 batched and atomic, separate blocks by
    rows and by columns, expert stacks on (ep, fsdp), a skipped non-finite param, a 3-D stack sharded by its
    matrices' rows (slabs of whole matrices) and stacked experts sharded by columns (slabs within an expert))."""
    calls = {"momentum": 0, "update": 0}
    real_momentum, real_update = elementwise.momentum_on_box, elementwise.update_on_box

    def counting(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(elementwise, "SLAB_ELEMENTS", elements)
    monkeypatch.setattr(elementwise, "momentum_on_box", counting("momentum", real_momentum))
    monkeypatch.setattr(elementwise, "update_on_box", counting("update", real_update))
    results = on_threads(case, steps=2, in_place=True)
    assert_boxes_of_reference(case, results, steps=2)
    boxes = 2 * case.world_size * len(case.layouts())  # stage calls without slabs, at most
    assert calls["update"] > boxes and (calls["momentum"] > boxes) == packed, (calls, boxes)
