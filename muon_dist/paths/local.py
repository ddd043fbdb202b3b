"""Local path: a param whose every member's box holds whole blocks (experts): every 3-D stack sharded on its
expert dim, fused experts with E_local % fsdp == 0, or boxes that happen to end on block boundaries. No
communication: each member orthogonalises the blocks it holds.

Reference equation, on every member r, for every param k of the batch:
    run(batch)[k] == box_r(kernel(full(batch[k])))
Contract: bitwise (proofs/paths.md#local). box_r is a run of whole blocks, and muon_ref's newton_schulz
orthogonalises each matrix of a stack alone (a Python loop over stack[i]), so the kernel on box_r's blocks gives
each block the bits the kernel on the whole param gives it. Traffic: none.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from ..batch import Batch, Kernel, run_kernels
from ..comm import Comm, Group
from ..geometry import Box
from .interface import Path


def owners(num_params: int, group_size: int) -> tuple[int, ...]:
    return ()


def check(batch: Batch) -> None:
    assert batch.owners == () and all(
        len(c) == 1 for g in batch.geometries for c in g.components
    ), batch


def run(
    comm: Comm, group: Group, batch: Batch, directions: list[Tensor], kernels: list[Kernel]
) -> list[Tensor]:
    me = group.ranks.index(comm.rank)
    calls = [(k, d, g.boxes[me]) for k, (d, g) in enumerate(zip(directions, batch.geometries))]
    return [u.to(batch.update_torch_dtype) for u in run_kernels(kernels, calls)]


def expected_bytes(batch: Batch, member: int, itemsizes: Mapping[str, int]) -> None:
    return None  # no collective


def work(batch: Batch, member: int) -> tuple[tuple[int, Box], ...]:
    """Every param's kernel on the member's own box (its whole blocks; none in an empty box)."""
    return tuple((k, g.boxes[member]) for k, g in enumerate(batch.geometries))


PATH = Path(
    name="local",
    run=run,
    owners=owners,
    check=check,
    expected_bytes=expected_bytes,
    work=work,
    collectives=0,  # none: each member works on what it holds
    moves_directions=False,  # the directions stay where they are
)
