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

from collections.abc import Mapping

from torch import Tensor

from ..batch import Batch, Kernel
from ..comm import Comm, Group
from ..geometry import Box, whole
from .interface import Path
from .shards import cut, join

# What non-owners contribute to the sum: x + (-0.0) == x for every x; +0.0 would turn an owner's -0.0 into +0.0.
ADDITIVE_IDENTITY = -0.0


def owners(num_params: int, group_size: int) -> tuple[int, ...]:
    return tuple(range(num_params))


def check(batch: Batch) -> None:
    assert len(batch.params) <= batch.group_size and batch.owners == owners(len(batch.params), 0), (
        batch
    )
    assert len(set(batch.geometries)) == 1, batch  # one layout: one box size per member


def run(
    comm: Comm, group: Group, batch: Batch, directions: list[Tensor], kernels: list[Kernel]
) -> list[Tensor]:
    geometry, W, R = batch.geometries[0], group.size, len(directions)
    me, sizes, width = group.ranks.index(comm.rank), geometry.sizes, max(geometry.sizes)
    send = directions[0].new_zeros(R, width)
    for k, d in enumerate(directions):
        send[k, : sizes[me]] = d.reshape(-1)
    gathered = comm.all_gather(send, group, "agrs").reshape(W, R, width)
    contrib = send.new_full((W, R, width), ADDITIVE_IDENTITY, dtype=batch.update_torch_dtype)
    if me < R:
        frame = whole(geometry.global_shape)
        full = join([gathered[j, me, : sizes[j]] for j in range(W)], list(geometry.boxes), frame)
        for j, box in enumerate(
            cut(kernels[me](full, frame).to(batch.update_torch_dtype), geometry)
        ):
            contrib[j, me, : sizes[j]] = box
    mine = comm.reduce_scatter_sum(contrib, group, "agrs").reshape(R, width)
    return [mine[k, : sizes[me]].reshape(geometry.boxes[me].shape) for k in range(R)]


def expected_bytes(batch: Batch, member: int, itemsizes: Mapping[str, int]) -> tuple[int, int]:
    moved = (batch.group_size - 1) * len(batch.params) * max(batch.geometries[0].sizes)
    both = moved * (itemsizes[batch.direction_dtype] + itemsizes[batch.update_dtype])
    return both, both


def work(batch: Batch, member: int) -> tuple[tuple[int, Box], ...]:
    """Member k < R runs param k's kernel on the whole param."""
    if member >= len(batch.params):
        return ()
    return ((member, whole(batch.geometries[member].global_shape)),)


PATH = Path(
    name="agrs",
    run=run,
    owners=owners,
    check=check,
    expected_bytes=expected_bytes,
    work=work,
    collectives=2,  # the all-gather and the reduce-scatter
    global_dispatch=True,
    remainder=True,
)
