"""The baselines' collectives, each call counted by the bytes of the tensors it sends and receives.

Counted as muon_dist.comm counts DistributedMuon's (one message per peer, never the backend's own routing), so
the two ledgers compare:
    all_gather(x):       sent (W - 1) |x|, received (W - 1) |x|
    gather(x, dst):      a non-destination sends |x|; dst receives (W - 1) |x|
    scatter(pieces, src): src sends the W - 1 pieces of the others; every other rank receives its piece
where |x| is x.numel() * x.element_size().
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from muon_dist.comm import older_collective_names


class CountingCollectives:
    """torch.distributed collectives on the default group, with this rank's (sent, received) bytes since reset()."""

    def __init__(self) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.sent = self.received = 0
        self.collectives = 0

    def reset(self) -> None:
        self.sent = self.received = 0
        self.collectives = 0

    def all_gather(self, x: Tensor) -> Tensor:
        """Equal-size all-gather: result[j * n:(j + 1) * n] is rank j's x (n = x.numel())."""
        x = x.contiguous().reshape(-1)
        out = x.new_empty(self.world_size * x.numel())
        with older_collective_names():
            dist.all_gather_into_tensor(out, x)
        moved = (self.world_size - 1) * x.numel() * x.element_size()
        self.sent, self.received = self.sent + moved, self.received + moved
        self.collectives += 1
        return out

    def gather(self, x: Tensor, dst: int) -> list[Tensor] | None:
        """Every rank's x (equal sizes) on dst, in rank order; None elsewhere."""
        x = x.contiguous()
        nbytes = x.numel() * x.element_size()
        self.collectives += 1
        if self.rank != dst:
            dist.gather(x, None, dst=dst)
            self.sent += nbytes
            return None
        pieces = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.gather(x, pieces, dst=dst)
        self.received += (self.world_size - 1) * nbytes
        return pieces

    def scatter(
        self, pieces: list[Tensor] | None, shape: tuple[int, ...], dtype: torch.dtype, src: int
    ) -> Tensor:
        """Piece j of src's `pieces` (each of this shape and dtype) to rank j."""
        out = torch.empty(shape, dtype=dtype)
        nbytes = out.numel() * out.element_size()
        self.collectives += 1
        if self.rank == src:
            dist.scatter(out, [p.contiguous() for p in pieces], src=src)
            self.sent += (self.world_size - 1) * nbytes
        else:
            dist.scatter(out, None, src=src)
            self.received += nbytes
        return out
