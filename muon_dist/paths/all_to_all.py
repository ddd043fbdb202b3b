"""All-to-all path: a batch of W same-layout params, sharded over a group of W ranks; member k owns param k.

Forward all_to_all_single: member j sends its box of param k to member k, with split sizes, so uneven and
empty boxes need no padding. Owner k joins the boxes into exactly the global matrix, runs the kernel, cuts
the update into boxes and sends them back with a second all_to_all_single. Uneven shards take this path
too and report it under the same name, "all_to_all" (proofs/paths.md#a2a-uneven).

Reference equation, on every member r and for every param k of the batch:
    run(batch)[k] == box_r(kernel(full(batch[k])))
Contract: bitwise, because the owner runs the same kernel on the same unpadded global matrix, and the
exchange only moves bits (proofs/paths.md#a2a). Traffic per param: (W - 1) / W of it each way when even:
the lower bound 2 (W - 1) / W of the matrix.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..comm import Comm, Group
from ..layout import ParamLayout
from .shards import Kernel, cut, join, member_sizes


def to_owners(comm: Comm, group: Group, shards: list[Tensor], layout: ParamLayout, path: str) -> Tensor:
    """Member k of the group receives every box of param k; returns this member's whole param."""
    me, sizes = group.ranks.index(comm.rank), member_sizes(layout, group.size)
    send = torch.cat([s.reshape(-1) for s in shards])
    recv = comm.all_to_all(send, sizes, [sizes[me]] * group.size, group, path)
    return join(list(recv.split(sizes)), layout)


def from_owners(comm: Comm, group: Group, update: Tensor, layout: ParamLayout, path: str) -> list[Tensor]:
    """Owner k sends box j of its update to member j; returns this member's box of every param's update."""
    me, sizes = group.ranks.index(comm.rank), member_sizes(layout, group.size)
    send = torch.cat(cut(update, layout, group.size))
    recv = comm.all_to_all(send, [sizes[me]] * group.size, sizes, group, path)
    n = sizes[me]  # not recv.split(n): an empty box (n == 0) would give one piece, not W
    return [recv[k * n:(k + 1) * n].reshape(layout.local_shape) for k in range(group.size)]


def run(comm: Comm, group: Group, directions: list[Tensor], layout: ParamLayout, kernel: Kernel,
        update_dtype: torch.dtype, path: str = "all_to_all") -> list[Tensor]:
    assert len(directions) == group.size, (len(directions), group.size)
    full = to_owners(comm, group, directions, layout, path)
    return from_owners(comm, group, kernel(full).to(update_dtype), layout, path)
