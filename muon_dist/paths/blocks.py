"""Blocks path: params whose blocks are stepped as separate params (split_sizes, num_heads: a separate layout),
sharded over a group of W ranks in any boxes. Each block is a unit, owned by the member that holds its largest
piece (ties: the lowest member); every member holding a piece of it sends that piece to the owner, which joins the
pieces into exactly the block, runs the kernel on the block alone and sends each member its piece back. One ragged
all_to_all_single each way for the whole batch; none at all when every block lies whole on one member.

Reference equation, on every member r and for every param k of the batch:
    run(batch)[k] == box_r(kernel(full(batch[k])))
where the kernel orthogonalises each block alone (muon_ref.functional.orthogonalize on a separate layout).
Contract: bitwise (proofs/paths.md#blocks): each owner joins exactly the block (the pieces tile it) and runs the
kernel on it alone, which is what the kernel does to that block of the whole param (each block its own tensor:
muon_ref.functional.map_blocks); the exchanges only move bits. Traffic of a block of S elements whose owner holds
a piece of p elements: S - p elements each way over all members (the owner receives them and sends them back),
the lower bound for that block: someone must receive the whole block and return it, and the holder of the largest
piece lacks the least.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ..batch import Batch, Kernel, run_kernels
from ..comm import Comm, Group
from ..geometry import Box, Geometry
from .exchange import pack, unpack
from .interface import Path
from .shards import join


@dataclass(frozen=True)
class Unit:
    """One block of a param: its box (frame), every member's piece of it (None: none), and its owner."""

    frame: Box
    pieces: tuple[Box | None, ...]
    owner: int


@functools.lru_cache(maxsize=1024)
def units(geometry: Geometry) -> tuple[Unit, ...]:
    """The units of a param, in block order (a pure function of the geometry, identical on every rank)."""
    out = []
    for block in geometry.blocks:
        frame = Box(block.offsets, block.shape)
        pieces = tuple(box.intersect(frame) if box.numel else None for box in geometry.boxes)
        sizes = [p.numel if p else 0 for p in pieces]
        out.append(Unit(frame, pieces, sizes.index(max(sizes))))
    return tuple(out)


def exchanges(batch: Batch) -> bool:
    """Whether some block has a piece outside its owner (else no member sends anything, on any rank)."""
    return any(
        p is not None and j != u.owner
        for g in batch.geometries
        for u in units(g)
        for j, p in enumerate(u.pieces)
    )


def owners(num_params: int, group_size: int) -> tuple[int, ...]:
    return ()  # per block, not per param: units()


def check(batch: Batch) -> None:
    assert batch.owners == () and all(g.sharded for g in batch.geometries), batch


def run(
    comm: Comm, group: Group, batch: Batch, directions: list[Tensor], kernels: list[Kernel]
) -> list[Tensor]:
    me, W, dtype = group.ranks.index(comm.rank), group.size, batch.update_torch_dtype
    todo = [(k, u) for k, g in enumerate(batch.geometries) for u in units(g)]
    mine = [g.boxes[me] for g in batch.geometries]
    if not exchanges(batch):
        # every block lies whole on its owner: orthogonalise what this member owns
        outs = [d.new_empty(box.shape, dtype=dtype) for d, box in zip(directions, mine)]
        here = [(k, u, u.frame.within(mine[k]).index) for k, u in todo if u.owner == me]
        calls = ((k, directions[k][i].contiguous(), u.frame) for k, u, i in here)
        for (k, _, i), update in zip(here, run_kernels(kernels, calls)):
            outs[k][i] = update.to(dtype)
        return outs
    owned = [[(k, u) for k, u in todo if u.owner == j] for j in range(W)]
    to_owner = [sum(u.pieces[me].numel for k, u in owned[j] if u.pieces[me]) for j in range(W)]
    from_member = [sum(u.pieces[j].numel for _, u in owned[me] if u.pieces[j]) for j in range(W)]
    send = pack(
        [
            [
                directions[k][u.pieces[me].within(mine[k]).index].reshape(-1)
                for k, u in owned[j]
                if u.pieces[me]
            ]
            for j in range(W)
        ],
        directions[0].new_empty(0),
    )
    recv = unpack(
        comm.all_to_all(send, from_member, to_owner, group, "blocks"),
        [[u.pieces[j].numel for _, u in owned[me] if u.pieces[j]] for j in range(W)],
    )
    back = _orthogonalise_owned(owned[me], recv, kernels, W, dtype)
    returned = unpack(
        comm.all_to_all(
            pack(back, directions[0].new_empty(0, dtype=dtype)),
            to_owner,
            from_member,
            group,
            "blocks",
        ),
        [[u.pieces[me].numel for _, u in owned[j] if u.pieces[me]] for j in range(W)],
    )
    held = [(k, u) for k, u in todo if u.pieces[me] is not None]  # the units I hold a piece of
    outs = [d.new_empty(box.shape, dtype=dtype) for d, box in zip(directions, mine)]
    cursor = [0] * W
    for k, u in held:
        piece = returned[u.owner][cursor[u.owner]]
        cursor[u.owner] += 1
        outs[k][u.pieces[me].within(mine[k]).index] = piece.reshape(u.pieces[me].shape)
    return outs


def _orthogonalise_owned(
    owned: list[tuple[int, Unit]],
    recv: list[list[Tensor]],
    kernels: list[Kernel],
    W: int,
    dtype: torch.dtype,
) -> list[list[Tensor]]:
    """The owner's part: each owned unit joined exactly from its members' pieces (recv[j]: member j's pieces, in
    order), its kernel run on the unit's frame; back[j]: member j's pieces of the updates, in order."""
    back: list[list[Tensor]] = [[] for _ in range(W)]
    taken = [0] * W
    inputs = []  # (param, its unit, the unit's parts from its members)
    for k, u in owned:
        members = [j for j in range(W) if u.pieces[j]]
        inputs.append((k, u, [recv[j][taken[j]] for j in members]))
        for j in members:
            taken[j] += 1
    calls = (  # lazy: each unit joined right before its kernel (run_kernels)
        (k, join(parts, [p for p in u.pieces if p], u.frame), u.frame) for k, u, parts in inputs
    )
    for (k, u, _), update in zip(inputs, run_kernels(kernels, calls)):
        update = update.to(dtype)
        for j in range(W):
            if u.pieces[j]:
                back[j].append(update[u.pieces[j].within(u.frame).index].reshape(-1))
    return back


def expected_bytes(
    batch: Batch, member: int, itemsizes: Mapping[str, int]
) -> tuple[int, int] | None:
    if not exchanges(batch):
        return None  # no collective
    b_dir, b_upd = itemsizes[batch.direction_dtype], itemsizes[batch.update_dtype]
    sent = received = 0
    for g in batch.geometries:
        for u in units(g):
            piece = u.pieces[member].numel if u.pieces[member] else 0
            if u.owner == member:
                lacking = u.frame.numel - piece
                sent, received = sent + lacking * b_upd, received + lacking * b_dir
            else:
                sent, received = sent + piece * b_dir, received + piece * b_upd
    return sent, received


def work(batch: Batch, member: int) -> tuple[tuple[int, Box], ...]:
    """Each block unit the member owns, on its frame."""
    return tuple(
        (k, u.frame) for k, g in enumerate(batch.geometries) for u in units(g) if u.owner == member
    )


PATH = Path(
    name="blocks",
    run=run,
    owners=owners,
    check=check,
    expected_bytes=expected_bytes,
    work=work,
    collectives=2,  # directions out, updates back
)
