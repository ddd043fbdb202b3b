"""Batch: params that move together along one communication path in a step (a frozen part of the plan).

Every field is rank-independent: the geometry of each param (its shard groups and every member's box), which
member orthogonalises each param, and the dtypes that travel (the direction's and the kernel output's). The
path module named by `path` states and checks the invariants that path needs (muon_dist/paths).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .geometry import Box, Geometry

# orthogonalise the whole blocks of a param that lie inside `box`, given x = the param's part in that box
Kernel = Callable[[Tensor, Box], Tensor]
# one kernel call of a batch: (the param's position in the batch, its part x, the box x is)
KernelCall = tuple[int, Tensor, Box]


class Kernels(list):
    """A batch's kernels, kernels[k] the kernel of its k-th param, and `many`: several calls at once, each result
    the one its own call gives (muon_dist/step.py stacks the same-shape matrices of the calls for the backend's
    stack kernel, muon_dist/kernels.orthogonalize_many)."""

    def __init__(
        self, each: Sequence[Kernel], many: Callable[[Iterable[KernelCall]], list[Tensor]]
    ) -> None:
        super().__init__(each)
        self.many = many


def run_kernels(kernels: Sequence[Kernel], calls: Iterable[KernelCall]) -> list[Tensor]:
    """[kernels[k](x, box) for k, x, box in calls]: at once where kernels is a Kernels, one by one otherwise (a
    plain list, as the paths' own tests pass). `calls` may be lazy (a generator): a call's input can then be made
    just before its kernel runs and freed after."""
    if isinstance(kernels, Kernels):
        return kernels.many(calls)
    return [kernels[k](x, box) for k, x, box in calls]


@dataclass(frozen=True)
class Batch:
    """params: indices into the plan's entries, in param-group order; geometries: each param's (all share one shard
    group size); owners: the member that orthogonalises each param (empty on paths where every member
    orthogonalises what it holds); direction_dtype / update_dtype: the dtype each param's direction and
    kernel output travel in."""

    path: str
    params: tuple[int, ...]
    geometries: tuple[Geometry, ...]
    owners: tuple[int, ...]
    direction_dtype: str
    update_dtype: str

    def __post_init__(self) -> None:
        assert self.params and len(self.geometries) == len(self.params), self
        assert len({g.group_size for g in self.geometries}) == 1, self
        assert all(0 <= o < self.group_size for o in self.owners), self

    @property
    def group_size(self) -> int:
        return self.geometries[0].group_size

    @property
    def update_torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.update_dtype.removeprefix("torch."))

    @property
    def direction_torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.direction_dtype.removeprefix("torch."))

    def numel(self, k: int) -> int:
        return math.prod(self.geometries[k].global_shape)

    def send_offsets(self, member: int) -> tuple[list[int], int]:
        """Where each param's box of `member` starts in that member's forward send buffer, in the exchange's order
        (muon_dist/paths/exchange.py, pack: the boxes of the params that owner 0 orthogonalises, in travel_order,
        then owner 1's, and so on), and the buffer's length in elements."""
        offsets, at = [0] * len(self.params), 0
        for owner in range(self.group_size):
            owned = [k for k, o in enumerate(self.owners) if o == owner]
            for k in travel_order(owned, self.geometries, member):
                offsets[k], at = at, at + self.geometries[k].sizes[member]
        return offsets, at


def travel_order(owned: Sequence[int], geometries: Sequence[Geometry], member: int) -> list[int]:
    """The order in which `member` sends its boxes of one owner's params (`owned`, in param order) in the exchange's
    forward all-to-all, and so the order in which the owner finds member's boxes in its receive buffer: param
    order, except that the owner's largest param (by elements; the first of the largest) travels last from member
    0 and first from member W - 1. In a group of two its boxes then lie side by side in the receive buffer, in
    member order: for Shard(0) boxes, the param's row-major elements, which the owner's kernel reads where they
    are (muon_dist/paths/shards.in_place) instead of from a joined copy. An owner of one param finds it so in
    any group. Any order moves the same bits; this one only saves the owner the largest param's copy. In a group of
    one (no exchange) param order."""
    order, group_size = list(owned), geometries[owned[0]].group_size if owned else 1
    if len(order) < 2 or group_size == 1 or member not in (0, group_size - 1):
        return order
    at = max(range(len(order)), key=lambda i: (sum(geometries[order[i]].sizes), -i))
    largest = order.pop(at)
    return order + [largest] if member == 0 else [largest] + order


class Packed(list):
    """A batch's directions, already in the exchange's forward send buffer: self[k] is param k's box of its
    direction, a view into `buffer`, whose layout is Batch.send_offsets'. A path that takes them so
    (Path.packed_directions) sends the buffer as it is, with no copy of its own; the views keep it alive."""

    def __init__(self, views: Sequence[Tensor], buffer: Tensor) -> None:
        super().__init__(views)
        self.buffer = buffer


@dataclass
class FailureFlag:
    """A write group's failure check carried by its last data collective (muon_dist/agreement.py), by the paths
    whose record says carries_flag: `local()` says whether this rank's work has failed so far in the step; it is
    read right before the path's last collective, which carries it as one more element per piece, logged under
    `name`; `failed` is then set to the global ranks of the group whose flag was set. The step uses it only
    where the group is the whole world, so every rank learns every rank's flag."""

    local: Callable[[], bool]
    name: str
    failed: list[int] | None = field(default=None)
