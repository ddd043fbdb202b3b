"""muon_dist.geometry without ranks: the boxes that placements give tile the tensor, right-to-left sharding
(_StridedShard) is told apart from left to right, and a strided placement this module cannot derive is refused
with a message naming it. tests/dist/test_layout.py checks the same boxes against DTensor's own shards."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from muon_dist.geometry import boxes_of, chunk_bounds, geometry, parse_placement, whole
from muon_ref import matrix_layout


@st.composite
def layouts(draw) -> tuple[tuple[int, ...], tuple[int, ...], tuple[str, ...]]:
    """A 2-D shape, a mesh of up to 3 axes (up to 8 ranks) and one code per axis (R, S0, S1; strided S<d>:<f>
    where a later axis cuts the same dim)."""
    mesh = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    codes = [draw(st.sampled_from(["R", "S0", "S1"])) for _ in mesh]
    for a, code in enumerate(codes):
        later = [b for b in range(a + 1, len(mesh)) if codes[b] == code and code != "R"]
        earlier = [b for b in range(a) if codes[b].split(":")[0] == code]  # strided or not
        if later and not earlier and draw(st.booleans()):
            codes[a] = f"{code}:{math.prod(mesh[b] for b in later)}"
    shape = (draw(st.integers(1, 12)), draw(st.integers(1, 12)))
    return shape, mesh, tuple(codes)


@given(drawn=layouts())
# the valid form of a draw that once marked two axes strided on one dim (found by the thorough profile)
@example(drawn=((1, 1), (1, 1, 2), ("S0:2", "S0", "S0")))
def test_the_boxes_of_any_placements_tile_the_tensor(drawn) -> None:
    shape, mesh, codes = drawn
    if all(c == "R" for c in codes):
        return
    seen = set()
    for box in boxes_of(shape, mesh, codes):
        cells = {
            (i, j)
            for i in range(box.offsets[0], box.offsets[0] + box.shape[0])
            for j in range(box.offsets[1], box.offsets[1] + box.shape[1])
        }
        assert not cells & seen, (shape, mesh, codes)  # disjoint
        seen |= cells
    assert len(seen) == math.prod(shape)  # covering


def test_right_to_left_sharding_is_not_left_to_right() -> None:
    # (11, 7) on dp 4 x tp 2, FSDP2 over ColwiseParallel: rank (dp 1, tp 0) holds rows 2-3 of tp 0's rows 0-5,
    # where left-to-right sharding would give it rows 3-4 (dp 1's rows 3-5, then tp 0's first two of them)
    strided, plain = (
        boxes_of((11, 7), (4, 2), ("S0:2", "S0")),
        boxes_of((11, 7), (4, 2), ("S0", "S0")),
    )
    assert strided[2].offsets == (chunk_bounds(6, 4, 1)[0], 0) and strided != plain


def test_a_strided_placement_it_cannot_derive_is_refused_naming_the_placements() -> None:
    with pytest.raises(ValueError, match="_StridedShard must be the first axis"):
        boxes_of((8, 4), (2, 2), ("S0:3", "S0"))  # split factor 3 on a tp axis of 2


def test_an_unsharded_param_is_one_group_of_whole_replicas() -> None:
    g = geometry((5, 3), ((0, 1), (2, 3)), ("R", "R"), matrix_layout((5, 3)).blocks)
    assert g.groups == ((0, 1, 2, 3),) and g.boxes == (whole((5, 3)),) * 4 and not g.sharded


@pytest.mark.parametrize(
    "code, parsed",
    [("R", ("R", None, 1)), ("S0", ("S", 0, 1)), ("S1", ("S", 1, 1)), ("S0:4", ("S", 0, 4))],
)
def test_placement_codes_parse_to_kind_dim_and_split_factor(code: str, parsed: tuple) -> None:
    """parse_placement's docstring: a Replicate has no dim and factor 1, as a plain Shard has."""
    assert parse_placement(code) == parsed


def test_a_geometry_whose_groups_and_boxes_disagree_cannot_be_built() -> None:
    """Every shard group has one member per box (Geometry's invariant): a group short of a member is refused."""
    g = geometry((5, 3), (0, 1, 2, 3), ("S0",), matrix_layout((5, 3)).blocks)
    assert g.groups == ((0, 1, 2, 3),) and len(g.boxes) == 4
    with pytest.raises(AssertionError):
        dataclasses.replace(g, groups=((0, 1, 2),))
