"""Cutting a whole parameter into the shard group's boxes and joining them back (Shard(0) or Shard(1)).

Equation: join(cut(X)) == X for every X of the layout's global shape, and cut(X)[j] is what member j holds
(torch.chunk boxes; empty boxes included). Shard(1) is the same with dim 1 (proofs/paths.md#shard1).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from ..layout import ParamLayout

Kernel = Callable[[Tensor], Tensor]


def member_sizes(layout: ParamLayout, group_size: int) -> list[int]:
    return [math.prod(layout.box(j)[1]) for j in range(group_size)]


def cut(full: Tensor, layout: ParamLayout, group_size: int) -> list[Tensor]:
    """Member j's box of `full`, flattened, for j in 0..group_size-1."""
    dim = layout.shard_dim
    out = []
    for j in range(group_size):
        offsets, shape = layout.box(j)
        out.append(full.narrow(dim, offsets[dim], shape[dim]).contiguous().reshape(-1))
    return out


def join(pieces: list[Tensor], layout: ParamLayout) -> Tensor:
    """The whole parameter from its members' flattened boxes: exactly the global shape, never padded."""
    shaped = [p.reshape(layout.box(j)[1]) for j, p in enumerate(pieces)]
    full = torch.cat(shaped, dim=layout.shard_dim)
    assert tuple(full.shape) == layout.global_shape, (full.shape, layout.global_shape)
    return full
