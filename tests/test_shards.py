"""muon_dist.paths.shards.join without ranks: the joined tensor equals the param whatever the pieces' storage, and it
is a view of the pieces (no copy) exactly where they already lie in one storage as the param's row-major elements
(one owned param's rows in an all-to-all's receive buffer, member after member). Pieces are drawn as slices of one
flat buffer, in member order or not, with other data between them or not, as Shard(0) or Shard(1) boxes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from muon_dist.geometry import Box, whole
from muon_dist.paths import shards
from muon_dist.paths.shards import cut, join


def _boxes(shape: tuple[int, int], sizes: list[int], dim: int) -> list[Box]:
    """Slabs of `shape` along `dim` with the given sizes (summing to shape[dim]), in order."""
    out, start = [], 0
    for size in sizes:
        offsets = [0, 0]
        offsets[dim] = start
        box_shape = list(shape)
        box_shape[dim] = size
        out.append(Box(tuple(offsets), tuple(box_shape)))
        start += size
    return out


@st.composite
def laid_out(draw):
    """(X, boxes, pieces, adjacent): X of 1-8 x 1-8, cut into up to 4 slabs along dim 0 or 1 (some empty), each
    slab's flattened elements placed in one flat buffer in a drawn order with or without a gap after each;
    adjacent: whether the pieces lie in the buffer as X's row-major elements (dim 0, member order, no gaps)."""
    shape = (draw(st.integers(1, 8)), draw(st.integers(1, 8)))
    dim = draw(st.sampled_from([0, 1]))
    members = draw(st.integers(1, 4))
    cuts = sorted(
        draw(st.lists(st.integers(0, shape[dim]), min_size=members - 1, max_size=members - 1))
    )
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, shape[dim]])]
    boxes = _boxes(shape, sizes, dim)
    order = draw(st.permutations(range(members)))
    gaps = [draw(st.integers(0, 2)) for _ in range(members)]
    X = torch.randn(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    flat = [box_part.reshape(-1) for box_part in (X[b.index] for b in boxes)]
    buffer = torch.full((sum(p.numel() for p in flat) + sum(gaps) + 3,), float("nan"))
    offset, pieces = 3, [None] * members  # a lead-in, so the buffer's start is never assumed
    for j in order:
        buffer[offset : offset + flat[j].numel()] = flat[j]
        pieces[j] = buffer[offset : offset + flat[j].numel()]
        offset += flat[j].numel() + gaps[j]
    nonempty = [j for j in range(members) if boxes[j].numel]
    in_storage_order = [j for j in order if boxes[j].numel]
    span = (
        pieces[nonempty[-1]].storage_offset()
        + pieces[nonempty[-1]].numel()
        - pieces[nonempty[0]].storage_offset()
    )
    adjacent = (
        (dim == 0 or len(nonempty) == 1)
        and in_storage_order == nonempty
        and span == sum(boxes[j].numel for j in nonempty)  # nothing between them
    )
    return X, boxes, pieces, adjacent


@given(drawn=laid_out())
def test_join_equals_the_param_and_is_a_view_exactly_where_the_pieces_lie_as_its_rows(
    drawn,
) -> None:
    """join(pieces, boxes, whole) == X bitwise, for any storage of the pieces; a view of their buffer iff they
    lie there as X's row-major elements (adjacent), else a new tensor."""
    X, boxes, pieces, adjacent = drawn
    out = join(pieces, boxes, whole(X.shape))
    assert torch.equal(out, X)
    shares = out.untyped_storage().data_ptr() == pieces[0].untyped_storage().data_ptr()
    assert shares == adjacent, (boxes, [p.storage_offset() for p in pieces])
    assert out.is_contiguous()


def test_an_owner_of_one_param_joins_its_receive_buffer_with_no_copy_and_of_two_with_copies() -> (
    None
):
    """The exchange's case: the rows of a 6 x 4 param from 3 members (2 rows each, Shard(0)), received in member
    order. With one owned param the buffer is the param; with two, each member's pieces of both params sit
    together, so a param's rows are apart and join copies."""
    X, Y = torch.arange(24.0).reshape(6, 4), -torch.arange(24.0).reshape(6, 4)
    boxes = _boxes((6, 4), [2, 2, 2], 0)
    one = torch.cat([X[b.index].reshape(-1) for b in boxes])
    pieces = list(one.split(8))
    joined = join(pieces, boxes, whole((6, 4)))
    assert torch.equal(joined, X) and joined.data_ptr() == one.data_ptr()
    two = torch.cat([t[b.index].reshape(-1) for b in boxes for t in (X, Y)])
    parts = two.split(8)
    for k, want in enumerate((X, Y)):
        got = join([parts[2 * j + k] for j in range(3)], boxes, whole((6, 4)))
        assert torch.equal(got, want) and got.untyped_storage().data_ptr() != two.data_ptr()


def test_a_view_that_ignored_the_pieces_order_would_be_caught(monkeypatch) -> None:
    """Negative control for the property above: an in_place that takes contiguity in storage for member order
    (no offset check) returns the pieces swapped for members sent in reverse; the equality assertion catches it."""
    X = torch.arange(12.0).reshape(4, 3)
    boxes = _boxes((4, 3), [2, 2], 0)
    buffer = torch.cat([X[boxes[1].index].reshape(-1), X[boxes[0].index].reshape(-1)])
    pieces = [buffer[6:], buffer[:6]]
    assert torch.equal(join(pieces, boxes, whole((4, 3))), X)

    def careless(pieces, boxes, frame):
        start = min(p.storage_offset() for p in pieces)
        return pieces[0].as_strided(frame.shape, (frame.shape[1], 1), start)

    monkeypatch.setattr(shards, "in_place", careless)
    assert not torch.equal(join(pieces, boxes, whole((4, 3))), X)


@pytest.mark.parametrize("placement", ["S0", "S1"])
@pytest.mark.parametrize("shape", [(5, 3), (1, 7), (7, 1)])
def test_cut_then_join_is_the_identity(shape, placement) -> None:
    """The module's equation join(cut(X, g), g.boxes, whole) == X. cut's Shard(0) pieces are X's own rows (a
    contiguous slab needs no copy), so join gives X's storage back; its Shard(1) pieces are copies of columns,
    joined by a copy, unless one member holds every element."""
    from muon_dist.geometry import geometry
    from muon_ref import matrix_layout

    g = geometry(shape, (0, 1), (placement,), matrix_layout(shape).blocks)
    X = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    pieces = cut(X, g)
    joined = join(pieces, list(g.boxes), whole(shape))
    assert torch.equal(joined, X)
    one_holder = sum(1 for p in pieces if p.numel()) == 1
    assert (joined.data_ptr() == X.data_ptr()) == (placement == "S0" or one_holder)
