"""Subgroup all-gather path: an expert stack whose experts are split over the members of a component (the
members that hold rows of the same expert, layout.expert_components()), each such component holding exactly
one expert: fsdp % E_local == 0 with the expert's rows divisible by fsdp / E_local. Members alone in their
component hold whole experts and compute locally.

The component all-gathers its boxes (padded to its largest box for the equal-size collective; the padding is
stripped before the join), every member runs the kernel on the joined expert and keeps its own rows; no
reverse communication. The sub-groups come from comm.subgroups: created once per partition, on every rank.

Reference equation, on every member r, for every param k of the batch:
    run(batch)[k] == box_r(kernel(full(batch[k])))
Contract: bitwise (proofs/paths.md#subgroup-all-gather): the join is exactly the component's expert (the
all-gather only moves bits), newton_schulz orthogonalises each matrix of a stack alone, so the expert gets
the bits it gets inside the whole stack, and keeping rows is a copy. Traffic per member of a component of k
members: (k - 1) R max-box elements each way, directions only; EP-local boxes, never the global E * m.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..comm import Comm, Group
from ..layout import ParamLayout
from . import local
from .shards import Kernel, member_sizes


def own_rows(update: Tensor, start: int, length: int) -> Tensor:
    """This member's rows of its component's update (start: its first row inside the component)."""
    return update.narrow(0, start, length)


def run(comm: Comm, group: Group, directions: list[Tensor], layout: ParamLayout, kernel: Kernel,
        update_dtype: torch.dtype) -> list[Tensor]:
    components = [c for c in layout.expert_components() if len(c) > 1]
    subs = comm.subgroups(tuple(tuple(g[j] for j in c) for g in layout.all_groups() for c in components))
    me = group.ranks.index(comm.rank)
    component = next((c for c in components if me in c), None)
    if component is None:
        return local.run(comm, group, directions, layout, kernel, update_dtype)
    every, R = member_sizes(layout, group.size), len(directions)
    sizes = [every[j] for j in component]
    send = directions[0].new_zeros(R, max(sizes))
    for k, d in enumerate(directions):
        send[k, : d.numel()] = d.reshape(-1)
    sub = subs[tuple(group.ranks[j] for j in component)]
    gathered = comm.all_gather(send, sub, "subgroup_all_gather").reshape(len(component), R, max(sizes))
    start = sum(layout.box(j)[1][0] for j in component[: component.index(me)])
    out = []
    for k in range(R):
        expert = torch.cat([gathered[q, k, : sizes[q]] for q in range(len(component))])
        update = kernel(expert.reshape(-1, *layout.global_shape[1:])).to(update_dtype)
        out.append(own_rows(update, start, layout.local_shape[0]).clone())
    return out
