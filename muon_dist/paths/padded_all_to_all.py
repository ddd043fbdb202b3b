"""Padded all-to-all path: a remainder batch of R < W params, padded with W - R zero matrices, then the
all-to-all path (members R..W-1 orthogonalise a zero matrix; the kernel maps it to zero; its update is
dropped). The option, and the fallback of xtuner and Dion.

Reference equation, on every member r and for every param k < R:
    run(batch)[k] == box_r(kernel(full(batch[k])))
Contract: bitwise, as the all-to-all path: the padding is whole extra matrices, never rows or columns of a
real one, so each real matrix still meets the kernel unpadded (proofs/paths.md#padded-a2a). Overhead: the
traffic of W - R zero matrices, and their W - R kernel calls.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..comm import Comm, Group
from ..layout import ParamLayout
from . import all_to_all
from .shards import Kernel


def run(comm: Comm, group: Group, directions: list[Tensor], layout: ParamLayout, kernel: Kernel,
        update_dtype: torch.dtype) -> list[Tensor]:
    zeros = [torch.zeros_like(directions[0]) for _ in range(group.size - len(directions))]
    updates = all_to_all.run(comm, group, directions + zeros, layout, kernel, update_dtype, "padded_all_to_all")
    return updates[: len(directions)]
