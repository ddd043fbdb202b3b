"""Replicated path: plain tensors (replicated over the default group) or Replicate placements, in batches of
R <= W params; member k orthogonalises param k and an all-gather gives every member every update.

Precondition: every member holds the same gradient (as after DDP's all-reduce); the update of param k is
member k's. Reference equation, on every member and for every param k < R:
    run(batch)[k] == kernel(batch[k])
Contract: bitwise: one kernel call on the whole matrix, then its bits are copied (proofs/paths.md#replicated).
Traffic: (W - 1) matrices of the batch's size each way per member (members k >= R send zeros).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..comm import Comm, Group
from ..layout import ParamLayout
from .shards import Kernel


def run(comm: Comm, group: Group, directions: list[Tensor], layout: ParamLayout, kernel: Kernel,
        update_dtype: torch.dtype) -> list[Tensor]:
    me, numel = group.ranks.index(comm.rank), directions[0].numel()
    if me < len(directions):
        mine = kernel(directions[me]).to(update_dtype).reshape(-1)
    else:
        mine = directions[0].new_zeros(numel, dtype=update_dtype)
    gathered = comm.all_gather(mine, group, "replicated").reshape(group.size, numel)
    return [gathered[k].reshape(layout.global_shape) for k in range(len(directions))]
