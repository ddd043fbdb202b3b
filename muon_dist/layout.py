"""ParamLayout: what a parameter is globally and which box of it this rank holds (read from a DTensor).

Shards follow torch.chunk: a dim of size d over W ranks has chunks of ceil(d / W), so 5 rows on 4 ranks are
2, 2, 1, 0 (torch.distributed.tensor's Shard placement). Everything except `rank`, `local_shape` and
`global_offset` is identical on every rank; `signature()` is that part, and the plan is built from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from muon_ref.functional import MatrixLayout, matrix_layout


def chunk_bounds(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """(offset, length) of chunk `index` of a dim of `size` split as torch.chunk does (trailing chunks may be empty)."""
    chunk = math.ceil(size / num_chunks)
    offset = min(index * chunk, size)
    return offset, min(chunk, size - offset)


@dataclass(frozen=True)
class ParamLayout:
    """Invariants: len(mesh_shape) == len(placements); at most one placement is a Shard; a plain tensor has
    mesh_shape == (world_size,) and placements == ("R",), i.e. it is replicated over the default group.

    placements are strings: "R" (replicate) or "S<d>" (shard tensor dim d). mesh_ranks is the mesh as nested
    tuples of global ranks, so the plan can name the sub-group of a mesh axis without a DeviceMesh.
    """

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    mesh_ranks: tuple
    mesh_dim_names: tuple[str, ...] | None
    placements: tuple[str, ...]
    num_experts: int | None
    flatten: bool
    rank: int
    local_shape: tuple[int, ...]
    global_offset: tuple[int, ...]

    def __post_init__(self) -> None:
        assert len(self.mesh_shape) == len(self.placements), (self.mesh_shape, self.placements)
        assert sum(p.startswith("S") for p in self.placements) <= 1, self.placements

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(torch.tensor(self.mesh_ranks).shape)

    @property
    def shard_axis(self) -> int | None:
        """The mesh axis that shards the tensor, or None when every axis replicates."""
        axes = [i for i, p in enumerate(self.placements) if p.startswith("S")]
        return axes[0] if axes else None

    @property
    def shard_dim(self) -> int | None:
        axis = self.shard_axis
        return None if axis is None else int(self.placements[axis][1:])

    @property
    def matrices(self) -> MatrixLayout:
        return matrix_layout(self.global_shape, self.num_experts, self.flatten, self.name)

    def group_ranks(self) -> tuple[int, ...]:
        """The global ranks of this rank's group along the shard axis (the 1-D mesh when nothing shards).

        On a 2-D mesh (Replicate, Shard(d)) (HSDP) this is the rank's row: every replica row runs the same
        plan on the same bits, so the replicate axis needs no communication (proofs/paths.md#hsdp).
        """
        mesh = torch.tensor(self.mesh_ranks)
        if self.shard_axis is None:
            return tuple(mesh.flatten().tolist())
        coord = [c[0].item() for c in torch.nonzero(mesh == self.rank, as_tuple=True)]
        index = tuple(slice(None) if a == self.shard_axis else coord[a] for a in range(mesh.ndim))
        return tuple(mesh[index].tolist())

    def box(self, group_index: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(global_offset, local_shape) of the shard that member `group_index` of the shard group holds."""
        if self.shard_dim is None:
            return (0,) * len(self.global_shape), self.global_shape
        size = len(self.group_ranks())
        offset, length = chunk_bounds(self.global_shape[self.shard_dim], size, group_index)
        offsets = tuple(offset if d == self.shard_dim else 0 for d in range(len(self.global_shape)))
        shape = tuple(length if d == self.shard_dim else s for d, s in enumerate(self.global_shape))
        return offsets, shape

    def signature(self) -> tuple:
        """The rank-independent part: what every rank must agree on."""
        return (self.name, self.global_shape, self.dtype, self.mesh_ranks, self.mesh_dim_names,
                self.placements, self.num_experts, self.flatten)


def _nested_tuple(x: Any) -> Any:
    return tuple(_nested_tuple(v) for v in x) if isinstance(x, list) else x


def _placement_code(placement: Any, name: str, shape: tuple[int, ...]) -> str:
    if placement.is_replicate():
        return "R"
    if placement.is_shard():
        return f"S{placement.dim % len(shape)}"
    raise ValueError(f"{name} of shape {shape}: placement {placement} is not supported (Replicate or Shard only)")


def read_layout(p: Tensor, name: str, num_experts: int | None, flatten: bool, rank: int, world_size: int) -> ParamLayout:
    """The layout of `p` (a DTensor, or a plain tensor replicated over the default group of `world_size`)."""
    shape = tuple(p.shape)
    if not hasattr(p, "device_mesh"):
        return ParamLayout(name, shape, str(p.dtype), tuple(range(world_size)), None, ("R",), num_experts,
                           flatten, rank, shape, (0,) * len(shape))
    mesh = p.device_mesh
    codes = tuple(_placement_code(pl, name, shape) for pl in p.placements)
    if sum(c.startswith("S") for c in codes) > 1:
        raise ValueError(f"{name} of shape {shape}: placements {p.placements} shard more than one mesh axis "
                         "(only one Shard axis is supported; expert-parallel meshes come later)")
    if "S" not in "".join(codes) and mesh.ndim != 1:
        raise ValueError(f"{name} of shape {shape}: a replicated DTensor must live on a 1-D mesh, got {p.placements}")
    layout = ParamLayout(name, shape, str(p.dtype), _nested_tuple(mesh.mesh.tolist()), mesh.mesh_dim_names, codes,
                         num_experts, flatten, rank, (), ())
    group = layout.group_ranks()
    offset, local = layout.box(group.index(rank))
    if tuple(p.to_local().shape) != local:
        raise ValueError(f"{name} of shape {shape}: local shard {tuple(p.to_local().shape)} is not torch.chunk's {local}")
    return ParamLayout(*layout.signature(), rank, local, offset)
