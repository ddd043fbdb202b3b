"""ParamLayout: what a parameter is globally and which box of it this rank holds (read from a DTensor).

Shards follow torch.chunk: a dim of size d over W ranks has chunks of ceil(d / W), so 5 rows on 4 ranks are
2, 2, 1, 0 (torch.distributed.tensor's Shard placement). Several mesh axes may shard the same dim, as an
(ep, fsdp) mesh with placements (Shard(0), Shard(0)) does: DTensor chunks left to right, so the outer axis (EP)
cuts the dim and each inner axis (FSDP) cuts its outer block again (measured equal to distribute_tensor on
gloo, meshes 2x2 to 4x2, 1-19 rows). The shard group is then every rank of those axes, in mesh order, and its
boxes are contiguous and in member order. Everything except `rank`, `local_shape` and `global_offset` is
identical on every rank; `signature()` is that part, and the plan is built from it.
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
    """Invariants: len(mesh_shape) == len(placements); every Shard placement shards the same dim; a plain tensor
    has mesh_shape == (world_size,) and placements == ("R",), i.e. it is replicated over the default group.

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
        assert len({p for p in self.placements if p.startswith("S")}) <= 1, self.placements

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(torch.tensor(self.mesh_ranks).shape)

    @property
    def shard_axes(self) -> tuple[int, ...]:
        """The mesh axes that shard the tensor, outer first (empty when every axis replicates)."""
        return tuple(i for i, p in enumerate(self.placements) if p.startswith("S"))

    @property
    def shard_axis(self) -> int | None:
        """The outermost mesh axis that shards the tensor, or None when every axis replicates."""
        return self.shard_axes[0] if self.shard_axes else None

    @property
    def shard_dim(self) -> int | None:
        axis = self.shard_axis
        return None if axis is None else int(self.placements[axis][1:])

    @property
    def matrices(self) -> MatrixLayout:
        return matrix_layout(self.global_shape, self.num_experts, self.flatten, self.name)

    def all_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every shard group of the mesh (one per coordinate of the replicating axes), members in mesh order.

        On a 2-D mesh (Replicate, Shard(d)) (HSDP) a group is a row: every replica row runs the same plan on
        the same bits, so the replicate axis needs no communication (proofs/paths.md#hsdp). On (Shard(0),
        Shard(0)) the group is the whole mesh, flattened (EP-major).
        """
        return mesh_groups(torch.tensor(self.mesh_ranks), self.shard_axes)

    def group_ranks(self) -> tuple[int, ...]:
        """The global ranks of this rank's shard group (the whole mesh when nothing shards)."""
        return next(g for g in self.all_groups() if self.rank in g)

    def box(self, group_index: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(global_offset, local_shape) of the shard that member `group_index` of the shard group holds:
        torch.chunk of the dim along each shard axis in turn (nested chunks)."""
        if self.shard_dim is None:
            return (0,) * len(self.global_shape), self.global_shape
        dim, offset, length = self.shard_dim, 0, self.global_shape[self.shard_dim]
        sizes = [self.mesh_shape[a] for a in self.shard_axes]
        coords = torch.unravel_index(torch.tensor(group_index), sizes)
        for size, coord in zip(sizes, coords):
            inner, length = chunk_bounds(length, size, int(coord))
            offset += inner
        offsets = tuple(offset if d == dim else 0 for d in range(len(self.global_shape)))
        shape = tuple(length if d == dim else s for d, s in enumerate(self.global_shape))
        return offsets, shape

    @property
    def expert_rows(self) -> int | None:
        """Length along the shard dim of one expert, when this is an expert stack sharded on its expert dim
        (3-D [E, m, n]: 1; fused [E * m, n] with num_experts: m); None for every other layout."""
        if self.shard_dim != 0 or self.flatten:
            return None
        if len(self.global_shape) == 3:
            return 1
        return self.matrices.fan_out if self.num_experts is not None else None

    def expert_components(self) -> tuple[tuple[int, ...], ...]:
        """The shard group's members joined wherever two hold rows of the same expert (member indices, in order).

        A component's boxes tile a run of whole experts; members with an empty box are components alone. So
        each component can orthogonalise its experts without the rest of the group.
        """
        unit, components, last = self.expert_rows, [], None  # last: (last expert, component) of a non-empty box
        assert unit is not None, self
        for j in range(len(self.group_ranks())):
            (offset, *_), (length, *_) = self.box(j)
            if length and last is not None and offset // unit == last[0]:
                last[1].append(j)
            else:
                components.append([j])
            if length:
                last = ((offset + length - 1) // unit, next(c for c in components if j in c))
        return tuple(tuple(c) for c in components)

    def signature(self) -> tuple:
        """The rank-independent part: what every rank must agree on."""
        return (self.name, self.global_shape, self.dtype, self.mesh_ranks, self.mesh_dim_names,
                self.placements, self.num_experts, self.flatten)


def mesh_groups(mesh: Tensor, axes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The groups of global ranks that vary along `axes` of `mesh` (all axes when empty), in mesh order."""
    axes = axes or tuple(range(mesh.ndim))
    rest = tuple(a for a in range(mesh.ndim) if a not in axes)
    rows = mesh.permute(*rest, *axes).reshape(-1, math.prod(mesh.shape[a] for a in axes))
    return tuple(tuple(row) for row in rows.tolist())


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
    if len({c for c in codes if c.startswith("S")}) > 1:
        raise ValueError(f"{name} of shape {shape}: placements {p.placements} shard more than one mesh axis along "
                         "different dims (several Shard axes must shard the same dim, as (Shard(0), Shard(0)) on an "
                         "(ep, fsdp) mesh does)")
    if "S" not in "".join(codes) and mesh.ndim != 1:
        raise ValueError(f"{name} of shape {shape}: a replicated DTensor must live on a 1-D mesh, got {p.placements}")
    layout = ParamLayout(name, shape, str(p.dtype), _nested_tuple(mesh.mesh.tolist()), mesh.mesh_dim_names, codes,
                         num_experts, flatten, rank, (), ())
    group = layout.group_ranks()
    offset, local = layout.box(group.index(rank))
    if tuple(p.to_local().shape) != local:
        raise ValueError(f"{name} of shape {shape}: local shard {tuple(p.to_local().shape)} is not torch.chunk's {local}")
    return ParamLayout(*layout.signature(), rank, local, offset)
