"""Cutting a whole parameter into its shard group's boxes and joining boxes back (any dims, any boxes).

Equations: join(cut(X, g), g.boxes, whole) == X for every X of g's global shape (the boxes tile the tensor:
proofs/sharding.md), and cut(X, g)[j] is member j's box of X, flattened (empty boxes included); join of the boxes
that tile a frame (a block) gives exactly the frame's part of X (proofs/paths.md#shard1).
"""

from __future__ import annotations

from torch import Tensor

from ..geometry import Box, Geometry, whole


def cut(full: Tensor, geometry: Geometry, frame: Box | None = None) -> list[Tensor]:
    """Member j's box of `full` (the tensor of `frame`, default the whole param), flattened, for every member j;
    empty for a member whose box lies outside the frame."""
    frame = frame or whole(geometry.global_shape)
    out = []
    for box in geometry.boxes:
        part = box.intersect(frame) if box.numel else None
        out.append(
            full[part.within(frame).index].contiguous().reshape(-1) if part else full.new_empty(0)
        )
    return out


def join(pieces: list[Tensor], boxes: list[Box], frame: Box) -> Tensor:
    """The tensor of `frame` from flattened pieces of the boxes that tile it: exactly its shape, never padded. Where
    the pieces already lie in one storage as that tensor's row-major elements (in_place), a view of them: the
    same elements with no copy (the caller must not write into it; no kernel writes its input); else a new
    tensor."""
    view = in_place(pieces, boxes, frame)
    if view is not None:
        return view
    out = pieces[0].new_empty(frame.shape)
    filled = 0
    for piece, box in zip(pieces, boxes):
        if box.numel:
            out[box.within(frame).index] = piece.reshape(box.shape)
            filled += box.numel
    assert filled == frame.numel, (filled, frame)
    return out


def in_place(pieces: list[Tensor], boxes: list[Box], frame: Box) -> Tensor | None:
    """The frame's tensor as a view of the pieces' storage, where the non-empty boxes are, in order, consecutive
    slabs of the frame along dim 0 (each spans every other dim whole: Shard(0) boxes) and their pieces are
    contiguous and lie one right after another in one storage; else None. The elements are then already in the
    row-major order join would copy them into: the view is equal to join's copy, element for element (an owner
    that receives a param's rows from every member in member order, and nothing in between: one owned param in
    an all-to-all's receive buffer)."""
    if not frame.shape:
        return None
    rows, end, first = 0, None, None
    for piece, box in zip(pieces, boxes):
        if not box.numel:
            continue
        part = box.within(frame)
        if (
            part.offsets[0] != rows
            or any(part.offsets[1:])
            or part.shape[1:] != frame.shape[1:]
            or not piece.is_contiguous()
            or piece.numel() != box.numel
        ):
            return None
        if first is None:
            first = piece
        elif (
            piece.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or piece.storage_offset() != end
        ):
            return None
        rows, end = rows + part.shape[0], piece.storage_offset() + piece.numel()
    if first is None or rows != frame.shape[0]:
        return None
    return first.as_strided(frame.shape, _row_major(frame.shape), first.storage_offset())


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))
