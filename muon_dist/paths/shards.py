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
    """The tensor of `frame` from flattened pieces of the boxes that tile it: exactly its shape, never padded."""
    out = pieces[0].new_empty(frame.shape)
    filled = 0
    for piece, box in zip(pieces, boxes):
        if box.numel:
            out[box.within(frame).index] = piece.reshape(box.shape)
            filled += box.numel
    assert filled == frame.numel, (filled, frame)
    return out
