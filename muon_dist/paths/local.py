"""Local path: an expert stack whose every box holds whole experts (E_local % fsdp == 0, every 3-D stack
sharded on dim 0, or boxes that happen to end on expert boundaries). No communication.

Reference equation, on every member r, for every param k of the batch:
    run(batch)[k] == box_r(kernel(full(batch[k])))
Contract: bitwise (proofs/paths.md#local). box_r is a run of whole experts, and muon_ref's newton_schulz
orthogonalises each matrix of a stack alone (a Python loop over stack[i]), so kernel on box_r's experts gives
each expert the bits kernel on the whole stack gives it. Traffic: none.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..comm import Comm, Group
from ..layout import ParamLayout
from .shards import Kernel


def run(comm: Comm, group: Group, directions: list[Tensor], layout: ParamLayout, kernel: Kernel,
        update_dtype: torch.dtype) -> list[Tensor]:
    return [kernel(d).to(update_dtype) for d in directions]
