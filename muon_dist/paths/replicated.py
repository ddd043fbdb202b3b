"""Replicated path: plain tensors (replicated over the default group) or Replicate placements, in batches of
R <= W params; member k orthogonalises param k and an all-gather gives every member every update.

Precondition: every member holds the same gradient (as after DDP's all-reduce); the update of param k is
member k's. Reference equation, on every member and for every param k < R:
    run(batch)[k] == kernel(batch[k])
Contract: bitwise: one kernel call on the whole matrix, then its bits are copied (proofs/paths.md#replicated).
Traffic: (W - 1) matrices of the batch's size each way per member (members k >= R send zeros).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from ..batch import Batch, Kernel
from ..comm import Comm, Group
from ..geometry import Box, whole
from .interface import Path


def owners(num_params: int, group_size: int) -> tuple[int, ...]:
    return tuple(range(num_params))


def check(batch: Batch) -> None:
    assert len(batch.params) <= batch.group_size and batch.owners == owners(len(batch.params), 0), (
        batch
    )
    assert len(set(batch.geometries)) == 1 and not batch.geometries[0].sharded, batch


def run(
    comm: Comm, group: Group, batch: Batch, directions: list[Tensor], kernels: list[Kernel]
) -> list[Tensor]:
    shape = batch.geometries[0].global_shape
    me, numel = group.ranks.index(comm.rank), directions[0].numel()
    if me < len(directions):
        mine = kernels[me](directions[me], whole(shape)).to(batch.update_torch_dtype).reshape(-1)
    else:
        mine = directions[0].new_zeros(numel, dtype=batch.update_torch_dtype)
    gathered = comm.all_gather(mine, group, "replicated").reshape(group.size, numel)
    return [gathered[k].reshape(shape) for k in range(len(directions))]


def expected_bytes(batch: Batch, member: int, itemsizes: Mapping[str, int]) -> tuple[int, int]:
    moved = (batch.group_size - 1) * batch.numel(0) * itemsizes[batch.update_dtype]
    return moved, moved


def work(batch: Batch, member: int) -> tuple[tuple[int, Box], ...]:
    """Member k < R runs param k's kernel on the whole param."""
    if member >= len(batch.params):
        return ()
    return ((member, whole(batch.geometries[member].global_shape)),)


PATH = Path(
    name="replicated",
    run=run,
    owners=owners,
    check=check,
    expected_bytes=expected_bytes,
    work=work,
    collectives=1,  # the all-gather of the owners' updates
    moves_directions=False,  # the directions stay where they are
)
