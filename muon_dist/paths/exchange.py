"""The exchange shared by the all-to-all family: every param to its owner and its update back, one ragged
all_to_all_single each way for the whole batch.

Forward: member j sends owner o its boxes of the params o owns, concatenated in travel order (muon_dist/batch.py:
param order, the owner's largest moved so that in a group of two its boxes arrive side by side), with split sizes
(uneven and empty boxes need no padding). The owner joins each param's boxes into exactly its global tensor (a
view of the receive buffer where they arrived as its row-major elements: shards.in_place) and runs that param's
kernel on it. Back: the update's boxes, in param order.

Equation, on every member r and for every param k:  exchange_steps(...)[k] == box_r(kernel_k(full(D_k)))
(the value the generator returns; muon_dist.runtime.run_to_end runs it without pausing)
(proofs/paths.md#a2a, #global): the owner joins exactly the global tensor (the boxes tile it) and runs the param's
own kernel on it; the exchanges only move bits. Traffic of param k, for member r with box b_r of k's S elements:
the owner receives S - b_owner direction elements and sends as many update elements back; any other member sends
b_r direction elements and receives b_r update elements (the lower bound 2 (W - 1) / W S when even).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from ..batch import Batch, FailureFlag, Kernel, Packed, run_kernels, travel_order
from ..comm import Comm, Group
from ..geometry import Box, Geometry, whole
from ..runtime import Steps
from .shards import cut, join


def pack(pieces: list[list[Tensor]], empty: Tensor) -> Tensor:
    """pieces[j]: what goes to member j, in param order; one flat buffer (`empty` when there is nothing)."""
    flat = [p.reshape(-1) for row in pieces for p in row]
    return torch.cat(flat) if flat else empty


def forward_send(
    boxes: Sequence[Tensor],
    geometries: Sequence[Geometry],
    owners: Sequence[int],
    member: int,
    empty: Tensor,
) -> Tensor:
    """`member`'s forward send buffer, packed from its boxes of the batch's params: to owner 0 its boxes of owner
    0's params in travel_order (muon_dist/batch.py), then to owner 1, and so on (Batch.send_offsets' layout)."""
    owned = [[k for k, o in enumerate(owners) if o == j] for j in range(geometries[0].group_size)]
    return pack(
        [[boxes[k] for k in travel_order(mine, geometries, member)] for mine in owned], empty
    )


def unpack(flat: Tensor, lengths: list[list[int]]) -> list[list[Tensor]]:
    """The inverse of pack: lengths[j] are the sizes of the pieces from member j (empty pieces included)."""
    out, offset = [], 0
    for row in lengths:
        out.append(
            [flat[offset + sum(row[:i]) : offset + sum(row[: i + 1])] for i in range(len(row))]
        )
        offset += sum(row)
    assert offset == flat.numel(), (offset, flat.numel())
    return out


def exchange_steps(
    comm: Comm,
    group: Group,
    geometries: Sequence[Geometry],
    owners: Sequence[int],
    directions: list[Tensor],
    kernels: Sequence[Kernel],
    update_dtype: torch.dtype,
    name: str,
    flag: FailureFlag | None = None,
) -> Steps:
    """The exchange as Steps (muon_dist/runtime.py): it yields right after issuing each of its two all-to-alls, so the
    caller can compute while they run, and returns this member's box of every param's update (module docstring);
    collectives logged under `name`. A group of one owns every param whole: the kernels run on the directions as
    they are, with no exchange (and no yield). `flag`: the update's all-to-all also carries every member's
    failure flag (FailureFlag; a group of more than one), read right before it is issued. It holds the
    directions only until they are packed; directions given as a Packed (muon_dist/batch.py) are sent as their
    buffer, which holds exactly what pack would build from them."""
    W, me = group.size, group.ranks.index(comm.rank)
    if W == 1:
        return _orthogonalise_whole(directions, kernels, geometries, update_dtype)
    # sizes[k][j]: member j's box of param k; owned[j]: the params of member j; to_owner[j]: my boxes of member
    # j's params; from_member[j]: member j's boxes of my params
    sizes = [g.sizes for g in geometries]
    owned = [[k for k, o in enumerate(owners) if o == j] for j in range(W)]
    to_owner = [sum(sizes[k][me] for k in owned[j]) for j in range(W)]
    from_member = [sum(sizes[k][j] for k in owned[me]) for j in range(W)]
    empty = directions[0].new_empty(0)
    if isinstance(directions, Packed):  # already in pack's order (Batch.send_offsets)
        send = directions.buffer
        assert send.numel() == sum(to_owner), (send.numel(), to_owner)
    else:
        send = forward_send(directions, geometries, owners, me, empty)
    num_params = len(directions)
    del directions  # packed: this frame holds them no longer
    pending = comm.all_to_all(send, from_member, to_owner, group, name, async_op=True)
    del send
    yield
    # arrived[j][i]: member j's box of its i-th param of mine in travel order; recv[j][i]: of owned[me][i]
    orders = [travel_order(owned[me], geometries, j) for j in range(W)]
    arrived = unpack(pending.wait(), [[sizes[k][j] for k in orders[j]] for j in range(W)])
    del pending  # the received buffer lives as long as its pieces in recv, no longer
    where = [{k: i for i, k in enumerate(order)} for order in orders]
    recv = [[row[at[k]] for k in owned[me]] for at, row in zip(where, arrived)]
    del arrived
    rows = _orthogonalise_owned(recv, owned[me], geometries, kernels, update_dtype)
    del recv
    lengths = [[sizes[k][me] for k in owned[j]] for j in range(W)]
    if flag is not None:
        # one element more per piece, each way: the sender's flag (0 or 1, exact in any dtype)
        mark = torch.full((1,), float(flag.local()), dtype=update_dtype, device=empty.device)
        rows = [row + [mark] for row in rows]
        lengths = [row + [1] for row in lengths]
        to_owner, from_member = [n + 1 for n in to_owner], [n + 1 for n in from_member]
    send = pack(rows, empty.new_empty(0, dtype=update_dtype))
    del rows
    flag_name = flag.name if flag is not None else None
    pending = comm.all_to_all(send, to_owner, from_member, group, name, flag_name, async_op=True)
    del send
    yield
    back = unpack(pending.wait(), lengths)
    if flag is not None:
        marks = torch.cat([row.pop()[-1:] for row in back]).tolist()  # one device-to-host copy
        flag.failed = [group.ranks[j] for j, m in enumerate(marks) if m != 0]
    # back[j]: my boxes of member j's params' updates, in its order
    updates: dict[int, Tensor] = {}
    for j in range(W):
        for k, box in zip(owned[j], back[j]):
            updates[k] = box.reshape(geometries[k].boxes[me].shape)
    return [updates[k] for k in range(num_params)]


def _orthogonalise_whole(
    directions: list[Tensor],
    kernels: Sequence[Kernel],
    geometries: Sequence[Geometry],
    update_dtype: torch.dtype,
) -> list[Tensor]:
    """A group of one: every param is whole here, its kernel runs on its direction as it is."""
    calls = [
        (k, d.reshape(g.global_shape), whole(g.global_shape))
        for k, (d, g) in enumerate(zip(directions, geometries))
    ]
    return [u.to(update_dtype) for u in run_kernels(kernels, calls)]


def _orthogonalise_owned(
    recv: list[list[Tensor]],
    mine: list[int],
    geometries: Sequence[Geometry],
    kernels: Sequence[Kernel],
    update_dtype: torch.dtype,
) -> list[list[Tensor]]:
    """The owner's part: each of its params (`mine`) joined exactly from every member's box (recv[j][i]: member
    j's box of mine[i]) and its kernel run on it; rows[j]: member j's boxes of the updates, in param order."""
    W = len(recv)
    frames = [whole(geometries[k].global_shape) for k in mine]
    calls = (  # lazy: each param joined right before its kernel (run_kernels)
        (k, join([recv[j][i] for j in range(W)], list(geometries[k].boxes), frames[i]), frames[i])
        for i, k in enumerate(mine)
    )
    updates = run_kernels(kernels, calls)
    # boxes[i][j]: member j's box of my i-th param's update
    boxes = [cut(u.to(update_dtype), geometries[k]) for k, u in zip(mine, updates)]
    return [[b[j] for b in boxes] for j in range(W)]


def batch_steps(name: str) -> Callable[..., Steps]:
    """The steps of a path that exchanges its batch as the plan gives it (all_to_all, global_all_to_all): the
    batch's geometries and owners, updates in its update dtype, collectives logged under `name`."""

    def steps(
        comm: Comm,
        group: Group,
        batch: Batch,
        directions: list[Tensor],
        kernels: list[Kernel],
        flag: FailureFlag | None = None,
    ) -> Steps:
        return exchange_steps(
            comm,
            group,
            batch.geometries,
            batch.owners,
            directions,
            kernels,
            batch.update_torch_dtype,
            name,
            flag,
        )

    return steps


def exchange_bytes(
    geometries: Sequence[Geometry],
    owners: Sequence[int],
    member: int,
    itemsizes: Mapping[str, int],
    direction_dtype: str,
    update_dtype: str,
) -> tuple[int, int] | None:
    """(sent, received) bytes of `member` in exchange (the traffic formula of the module docstring); None for a
    group of one (no collective)."""
    if geometries[0].group_size == 1:
        return None
    sent = received = 0
    b_dir, b_upd = itemsizes[direction_dtype], itemsizes[update_dtype]
    for geometry, owner in zip(geometries, owners):
        box = geometry.sizes[member]
        if owner == member:
            lacking = sum(geometry.sizes) - box
            sent, received = sent + lacking * b_upd, received + lacking * b_dir
        else:
            sent, received = sent + box * b_dir, received + box * b_upd
    return sent, received


def batch_bytes(batch: Batch, member: int, itemsizes: Mapping[str, int]) -> tuple[int, int] | None:
    """expected_bytes of a path that exchanges its batch as the plan gives it (all_to_all, global_all_to_all)."""
    return exchange_bytes(
        batch.geometries, batch.owners, member, itemsizes, batch.direction_dtype, batch.update_dtype
    )


def batch_work(batch: Batch, member: int) -> tuple[tuple[int, Box], ...]:
    """work of a path that exchanges its batch as the plan gives it: each param the member owns, whole."""
    return exchange_work(batch.geometries, batch.owners, member)


def exchange_work(
    geometries: Sequence[Geometry], owners: Sequence[int], member: int
) -> tuple[tuple[int, Box], ...]:
    """The kernel calls of `member` in exchange_steps: each param it owns, whole."""
    return tuple(
        (k, whole(g.global_shape))
        for k, (g, o) in enumerate(zip(geometries, owners))
        if o == member
    )
