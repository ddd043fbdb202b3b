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

from collections.abc import Mapping

import torch
from torch import Tensor

from ..batch import Batch, FailureFlag, Kernel
from ..comm import Comm, Group
from ..geometry import Box
from ..runtime import Steps, blocking
from .exchange import exchange_bytes, exchange_steps, exchange_work
from .interface import Path


def owners(num_params: int, group_size: int) -> tuple[int, ...]:
    return tuple(range(num_params))


def check(batch: Batch) -> None:
    assert len(batch.params) <= batch.group_size and batch.owners == owners(len(batch.params), 0), (
        batch
    )


def padded(batch: Batch) -> tuple[tuple, tuple[int, ...]]:
    """(geometries, owners) with the W - R zero matrices appended (the first param's geometry, members R..W-1)."""
    extra = batch.group_size - len(batch.params)
    return batch.geometries + (batch.geometries[0],) * extra, batch.owners + tuple(
        range(len(batch.params), batch.group_size)
    )


def steps(
    comm: Comm,
    group: Group,
    batch: Batch,
    directions: list[Tensor],
    kernels: list[Kernel],
    flag: FailureFlag | None = None,
) -> Steps:
    geometries, all_owners = padded(batch)
    real = len(directions)
    extra = batch.group_size - real
    zeros = [torch.zeros_like(directions[0]) for _ in range(extra)]
    sent = [directions + zeros]
    del directions, zeros  # held by exchange_steps alone, which lets them go once packed
    updates = yield from exchange_steps(
        comm,
        group,
        geometries,
        all_owners,
        sent.pop(),
        list(kernels) + [kernels[0]] * extra,
        batch.update_torch_dtype,
        "padded_all_to_all",
        flag,
    )
    return updates[:real]


run = blocking(steps)  # the interface's run: the Steps without pausing


def expected_bytes(batch: Batch, member: int, itemsizes: Mapping[str, int]) -> tuple[int, int]:
    return exchange_bytes(
        *padded(batch), member, itemsizes, batch.direction_dtype, batch.update_dtype
    )


def work(batch: Batch, member: int) -> tuple[tuple[int, Box], ...]:
    """Each param the member owns, whole; a padding matrix runs param 0's kernel."""
    calls = exchange_work(*padded(batch), member)
    return tuple((k if k < len(batch.params) else 0, box) for k, box in calls)


PATH = Path(
    name="padded_all_to_all",
    run=run,
    steps=steps,
    owners=owners,
    check=check,
    expected_bytes=expected_bytes,
    work=work,
    collectives=2,  # directions out, updates back
    global_dispatch=True,
    remainder=True,  # takes any batch size up to W
    carries_flag=True,  # steps(..., flag=) carries the write group's failure flag in its last collective
)
