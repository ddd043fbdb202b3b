"""Global all-to-all path: every sharded Muon param of a step that shares a shard group of W ranks and a
(direction dtype, update dtype) pair, in one batch of any size; member owners[k] owns param k (the plan's LPT
assignment on Newton-Schulz FLOPs, muon_dist/plan.py).

Forward: ONE all_to_all_single: member j sends owner o its boxes of the params o owns, concatenated in param
order, with split sizes (uneven and empty boxes need no padding). The owner joins each param's boxes into
exactly its global matrix and runs that param's own kernel. Back: ONE all_to_all_single with the update
boxes in the same order. So two collectives per (group, dtype pair) and step, whatever the number of shapes.

Reference equation, on every member r and for every param k of the batch:
    run(batch)[k] == box_r(kernel_k(full(batch[k])))
Contract: bitwise: the owner joins exactly the global matrix of each param it owns and runs that param's own
kernel; the exchange only moves bits (proofs/paths.md#global). Traffic per param: its size minus the owner's
box, each way: the lower bound 2 (W - 1) / W of the matrix when even.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..comm import Comm, Group
from ..layout import ParamLayout
from .shards import Kernel, cut, join, member_sizes

PATH = "global_all_to_all"


def pack(pieces: list[list[Tensor]], empty: Tensor) -> Tensor:
    """pieces[j]: what goes to member j, in param order; one flat buffer (`empty` when there is nothing)."""
    flat = [p.reshape(-1) for row in pieces for p in row]
    return torch.cat(flat) if flat else empty


def unpack(flat: Tensor, lengths: list[list[int]]) -> list[list[Tensor]]:
    """The inverse of pack: lengths[j] are the sizes of the pieces from member j (empty pieces included)."""
    out, offset = [], 0
    for row in lengths:
        out.append([flat[offset + sum(row[:i]):offset + sum(row[:i + 1])] for i in range(len(row))])
        offset += sum(row)
    assert offset == flat.numel(), (offset, flat.numel())
    return out


def run(comm: Comm, group: Group, directions: list[Tensor], layouts: list[ParamLayout], kernels: list[Kernel],
        owners: tuple[int, ...], update_dtype: torch.dtype) -> list[Tensor]:
    W, me = group.size, group.ranks.index(comm.rank)
    sizes = [member_sizes(layout, W) for layout in layouts]  # sizes[k][j]: member j's box of param k
    owned = [[k for k, o in enumerate(owners) if o == j] for j in range(W)]  # owned[j]: params of member j
    to_owner = [sum(sizes[k][me] for k in owned[j]) for j in range(W)]  # my boxes, by owner
    from_member = [sum(sizes[k][j] for k in owned[me]) for j in range(W)]  # member j's boxes of my params

    send = pack([[directions[k] for k in owned[j]] for j in range(W)], directions[0].new_empty(0))
    recv = unpack(comm.all_to_all(send, from_member, to_owner, group, PATH),
                  [[sizes[k][j] for k in owned[me]] for j in range(W)])  # recv[j][i]: member j's box of owned[me][i]
    boxes = [cut(kernels[k](join([recv[j][i] for j in range(W)], layouts[k])).to(update_dtype), layouts[k], W)
             for i, k in enumerate(owned[me])]  # boxes[i][j]: member j's box of my i-th param's update

    send = pack([[b[j] for b in boxes] for j in range(W)], directions[0].new_empty(0, dtype=update_dtype))
    back = unpack(comm.all_to_all(send, to_owner, from_member, group, PATH),
                  [[sizes[k][me] for k in owned[j]] for j in range(W)])
    updates: list[Tensor | None] = [None] * len(directions)
    for j in range(W):
        for k, box in zip(owned[j], back[j]):
            updates[k] = box.reshape(layouts[k].local_shape)
    return updates  # type: ignore[return-value]
