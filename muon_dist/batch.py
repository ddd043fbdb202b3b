"""Batch: params that move together along one communication path in a step (a frozen part of the plan).

Every field is rank-independent: the geometry of each param (its shard groups and every member's box), which
member orthogonalises each param, and the dtypes that travel (the direction's and the kernel output's). The
path module named by `path` states and checks the invariants that path needs (muon_dist/paths).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from .geometry import Box, Geometry

# orthogonalise the whole blocks of a param that lie inside `box`, given x = the param's part in that box
Kernel = Callable[[Tensor, Box], Tensor]


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
