"""Subgroup all-gather path: an expert stack whose blocks (experts) are split over the members of a component
(the members that hold pieces of the same block, Geometry.components), each such component holding exactly one
block: fsdp % E_local == 0 with the expert's rows divisible by fsdp / E_local. Members alone in their component
hold whole blocks and compute locally.

The component all-gathers its boxes (padded to its largest box for the equal-size collective; the padding is
stripped before the join), every member runs the kernel on the joined block and keeps its own piece; no
reverse communication. The sub-groups come from comm.subgroups: created once per partition, on every rank.

Reference equation, on every member r, for every param k of the batch:
    run(batch)[k] == box_r(kernel(full(batch[k])))
Contract: bitwise (proofs/paths.md#subgroup-all-gather): the join is exactly the component's block (the
all-gather only moves bits), newton_schulz orthogonalises each matrix of a stack alone, so the block gets the
bits it gets inside the whole stack, and keeping one's piece is a copy. Traffic per member of a component of k
members: (k - 1) R max-box elements each way, directions only; EP-local boxes, never the global E * m.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from ..batch import Batch, Kernel, run_kernels
from ..comm import Comm, Group
from ..geometry import Box, Geometry
from .interface import Path
from .shards import join


def owners(num_params: int, group_size: int) -> tuple[int, ...]:
    return ()


def shared(geometry: Geometry) -> list[tuple[int, ...]]:
    """The components of more than one member."""
    return [c for c in geometry.components if len(c) > 1]


def check(batch: Batch) -> None:
    assert batch.owners == () and len(set(batch.geometries)) == 1, batch
    geometry = batch.geometries[0]
    assert shared(geometry) and all(len(geometry.blocks_of(c)) == 1 for c in shared(geometry)), (
        batch
    )


def own_piece(update: Tensor, mine: Box, frame: Box) -> Tensor:
    """This member's box of its component's update (the update is the tensor of `frame`, the block)."""
    return update[mine.within(frame).index]


def run(
    comm: Comm, group: Group, batch: Batch, directions: list[Tensor], kernels: list[Kernel]
) -> list[Tensor]:
    geometry, me, R = batch.geometries[0], group.ranks.index(comm.rank), len(directions)
    components = shared(geometry)
    subs = comm.subgroups(
        tuple(tuple(g[j] for j in c) for g in geometry.groups for c in components)
    )
    component = next((c for c in components if me in c), None)
    if component is None:  # whole blocks: the local path's computation
        calls = [(k, d, geometry.boxes[me]) for k, d in enumerate(directions)]
        return [u.to(batch.update_torch_dtype) for u in run_kernels(kernels, calls)]
    block = geometry.blocks[geometry.blocks_of(component)[0]]
    frame = Box(block.offsets, block.shape)
    boxes = [geometry.boxes[j] for j in component]
    width = max(b.numel for b in boxes)
    send = directions[0].new_zeros(R, width)
    for k, d in enumerate(directions):
        send[k, : d.numel()] = d.reshape(-1)
    sub = subs[tuple(group.ranks[j] for j in component)]
    gathered = comm.all_gather(send, sub, "subgroup_all_gather").reshape(len(component), R, width)
    calls = (  # lazy: each param joined right before its kernel (run_kernels)
        (
            k,
            join([gathered[q, k, : boxes[q].numel] for q in range(len(component))], boxes, frame),
            frame,
        )
        for k in range(R)
    )
    updates = run_kernels(kernels, calls)
    del gathered
    return [
        own_piece(u.to(batch.update_torch_dtype), geometry.boxes[me], frame).clone()
        for u in updates
    ]


def expected_bytes(
    batch: Batch, member: int, itemsizes: Mapping[str, int]
) -> tuple[int, int] | None:
    geometry = batch.geometries[0]
    component = next(c for c in geometry.components if member in c)
    if len(component) == 1:
        return None  # no collective on a member alone in its component
    moved = (len(component) - 1) * len(batch.params) * max(geometry.sizes[j] for j in component)
    moved *= itemsizes[batch.direction_dtype]
    return moved, moved


def work(batch: Batch, member: int) -> tuple[tuple[int, Box], ...]:
    """A member alone in its component: every param's kernel on its own box; else every param's kernel on the
    component's block (each member of a component runs it)."""
    geometry = batch.geometries[0]
    component = next((c for c in shared(geometry) if member in c), None)
    if component is None:
        return tuple((k, geometry.boxes[member]) for k in range(len(batch.params)))
    block = geometry.blocks[geometry.blocks_of(component)[0]]
    return tuple((k, Box(block.offsets, block.shape)) for k in range(len(batch.params)))


PATH = Path(
    name="subgroup_all_gather",
    run=run,
    owners=owners,
    check=check,
    expected_bytes=expected_bytes,
    work=work,
    collectives=1,  # the all-gather inside each expert's component
)
