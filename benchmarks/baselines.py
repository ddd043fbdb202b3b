"""Two of the field's baselines, written with torch.distributed directly (benchmarks.counting) and muon_ref's
functional pieces (momentum_direction, orthogonalize, apply_update): the kernel is muon_ref's, never a copy.

Both take FSDP2-style params: DTensors sharded Shard(0) over the world (torch.chunk boxes, empty ones included),
with Shard(0) gradients. Momentum and the update run on the local shard; only orthogonalize sees whole params.
Uneven boxes are padded to the largest box for the equal-size collectives and stripped before the kernel.

(a) FullTensorMuon (LlamaFactory v2, muonium's single-param path, Moonlight's ZeRO-1 PoC; see
    docs/distributed.md): every rank all-gathers every param's direction, runs the kernel
    on every param and keeps its own box:   update_r = box_r(orthogonalize(full(D)))  on every rank r.
    Traffic per param and rank: (W - 1) padded boxes of the direction each way; W-fold duplicated NS.
(c) GatherScatterMuon (samsja muon_fsdp2): param i is owned by rank i mod W, which gathers the boxes, runs the
    kernel and scatters the update's boxes:  update_r = box_r(orthogonalize(full(D)))  computed by the owner.
    Traffic per param: the owner receives W - 1 padded boxes of D and sends W - 1 padded boxes of the update.
Contract: bitwise equal to muon_ref.Muon on the full tensors in fp32 (benchmarks.run checks it every run).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from muon_dist.geometry import chunk_bounds
from muon_ref.functional import (
    MatrixLayout,
    apply_update,
    matrix_layout,
    momentum_direction,
    orthogonalize,
)
from muon_ref.optim import group_config
from muon_ref.presets import preset_defaults

from .counting import CountingCollectives


def padded_rows(x: Tensor, rows: int) -> Tensor:
    """x with zero rows appended up to `rows` rows (the largest box), for an equal-size collective."""
    out = x.new_zeros((rows, *x.shape[1:]))
    out[: x.size(0)] = x
    return out


class _ShardedMuon:
    """Momentum and update on local shards; subclasses say how a direction's whole param meets the kernel."""

    def __init__(
        self,
        params: Sequence[Tensor],
        names: Sequence[str],
        preset: str,
        collectives: CountingCollectives,
    ) -> None:
        self.params, self.names, self.comm = list(params), list(names), collectives
        self.cfg = group_config(preset_defaults(preset, {}))
        self.buffers: dict[int, Tensor] = {}

    def layout(self, i: int) -> MatrixLayout:
        return matrix_layout(self.params[i].shape, None, False, self.names[i])

    def boxes(self, i: int) -> list[tuple[int, int]]:
        """(first row, rows) of every rank's box of param i (torch.chunk over dim 0)."""
        return [
            chunk_bounds(self.params[i].shape[0], self.comm.world_size, r)
            for r in range(self.comm.world_size)
        ]

    def update_box(self, i: int, direction: Tensor) -> Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def step(self) -> None:
        self.comm.reset()
        for i, p in enumerate(self.params):
            grad = p.grad.to_local()
            buf = self.buffers[i] if i in self.buffers else torch.zeros_like(grad)
            self.buffers[i], direction = momentum_direction(grad, buf, self.cfg)
            local = p.to_local()
            local.copy_(
                apply_update(local, self.update_box(i, direction), self.layout(i), self.cfg)
            )


class FullTensorMuon(_ShardedMuon):
    """(a): all-gather the whole direction on every rank, NS everywhere, keep this rank's box."""

    def update_box(self, i: int, direction: Tensor) -> Tensor:
        boxes, W = self.boxes(i), self.comm.world_size
        width = max(n for _, n in boxes)
        gathered = self.comm.all_gather(padded_rows(direction, width)).reshape(
            W, width, *direction.shape[1:]
        )
        full = torch.cat([gathered[j, :n] for j, (_, n) in enumerate(boxes)])
        first, rows = boxes[self.comm.rank]
        return orthogonalize(full, self.layout(i), self.cfg)[first : first + rows]


class GatherScatterMuon(_ShardedMuon):
    """(c): gather the direction on its owner (i mod W), NS there, scatter the update's boxes."""

    def update_box(self, i: int, direction: Tensor) -> Tensor:
        boxes, owner = self.boxes(i), i % self.comm.world_size
        width = max(n for _, n in boxes)
        pieces = self.comm.gather(padded_rows(direction, width), owner)
        update_boxes = None
        if pieces is not None:
            full = torch.cat([piece[:n] for piece, (_, n) in zip(pieces, boxes)])
            update = orthogonalize(full, self.layout(i), self.cfg)
            update_boxes = [padded_rows(update[first : first + n], width) for first, n in boxes]
        dtype = self.cfg.ns_dtype or direction.dtype
        mine = self.comm.scatter(update_boxes, (width, *direction.shape[1:]), dtype, owner)
        return mine[: boxes[self.comm.rank][1]]
