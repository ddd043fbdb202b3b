"""AGRS path (all-gather, reduce-scatter): a batch of R <= W params sharded over a group of W ranks.

All-gather every member's boxes of the R params (each box padded to the largest box for the equal-size
collective; the padding is stripped before the join), member k < R orthogonalises param k, and a
reduce-scatter SUM returns each member its boxes; every other member contributes -0.0 there.

Reference equation, on every member r and for every param k < R:
    run(batch)[k] == box_r(kernel(full(batch[k])))
Contract: bitwise. Each element of the sum has one contribution x from the owner and W - 1 contributions of
-0.0, and x + (-0.0) == x bitwise for every x, -0.0 and NaN included, in any order of summation; +0.0 would
not do: -0.0 + +0.0 == +0.0 (proofs/paths.md#agrs). Traffic per member: (W - 1) R max-box elements each way
in the all-gather and again in the reduce-scatter; over all members W times the lower bound for R matrices.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..comm import Comm, Group
from ..layout import ParamLayout
from .shards import Kernel, cut, join, member_sizes

# What non-owners contribute to the sum: x + (-0.0) == x for every x; +0.0 would turn an owner's -0.0 into +0.0.
ADDITIVE_IDENTITY = -0.0


def run(comm: Comm, group: Group, directions: list[Tensor], layout: ParamLayout, kernel: Kernel,
        update_dtype: torch.dtype) -> list[Tensor]:
    me, sizes, W, R = group.ranks.index(comm.rank), member_sizes(layout, group.size), group.size, len(directions)
    width = max(sizes)
    send = directions[0].new_zeros(R, width)
    for k, d in enumerate(directions):
        send[k, : sizes[me]] = d.reshape(-1)
    gathered = comm.all_gather(send, group, "agrs").reshape(W, R, width)
    contrib = send.new_full((W, R, width), ADDITIVE_IDENTITY, dtype=update_dtype)
    if me < R:
        full = join([gathered[j, me, : sizes[j]] for j in range(W)], layout)
        for j, box in enumerate(cut(kernel(full).to(update_dtype), layout, W)):
            contrib[j, me, : sizes[j]] = box
    mine = comm.reduce_scatter_sum(contrib, group, "agrs").reshape(R, width)
    return [mine[k, : sizes[me]].reshape(layout.local_shape) for k in range(R)]
