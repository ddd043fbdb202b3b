"""ParamLayout: what a parameter is globally, read from its DTensor (or a plain tensor), identical on every rank.

A layout holds what every rank must agree on: the param's name, global shape and dtype, its mesh (as nested tuples
of global ranks), its placements as codes, and the param-group keys that say how it is read as matrices
(muon_ref.functional.matrix_layout). Placement codes: "R" (Replicate), "S<d>" (Shard(d)), "S<d>:<f>"
(_StridedShard(d, split_factor=f), FSDP2 over tensor parallelism). A plain tensor is replicated over the default
group: mesh (0, ..., W-1) and placements ("R",). Its geometry (muon_dist/geometry.py: shard groups and every
member's box) is derived from the layout, once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from muon_ref.functional import MatrixLayout, matrix_layout

from .geometry import Geometry, geometry


@dataclass(frozen=True)
class ParamLayout:
    """Invariants: placements has one code per mesh axis; the layout's blocks come from muon_ref's matrix_layout."""

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    mesh_ranks: tuple
    placements: tuple[str, ...]
    mesh_dim_names: tuple[str, ...] | None = None
    num_experts: int | None = None
    flatten: bool = False
    split_sizes: tuple[int, ...] | None = None
    num_heads: int | None = None
    split_dim: int = 0

    @property
    def matrices(self) -> MatrixLayout:
        return _matrices(
            self.global_shape,
            self.num_experts,
            self.flatten,
            self.name,
            self.split_sizes,
            self.num_heads,
            self.split_dim,
        )

    @property
    def geometry(self) -> Geometry:
        return geometry(self.global_shape, self.mesh_ranks, self.placements, self.matrices.blocks)

    def shape_key(self) -> tuple:
        """Everything but the name: params with equal keys have the same geometry and blocks."""
        return (
            self.global_shape,
            self.dtype,
            self.mesh_ranks,
            self.placements,
            self.num_experts,
            self.flatten,
            self.split_sizes,
            self.num_heads,
            self.split_dim,
        )


@functools.lru_cache(maxsize=4096)
def _matrices(
    shape: tuple[int, ...],
    num_experts: int | None,
    flatten: bool,
    name: str,
    split_sizes: tuple[int, ...] | None,
    num_heads: int | None,
    split_dim: int,
) -> MatrixLayout:
    return matrix_layout(
        shape,
        num_experts,
        flatten,
        name,
        split_sizes=split_sizes,
        num_heads=num_heads,
        split_dim=split_dim,
    )


def _nested_tuple(x: Any) -> Any:
    return tuple(_nested_tuple(v) for v in x) if isinstance(x, list) else x


def placement_code(placement: Any, name: str, shape: tuple[int, ...]) -> str:
    """The code of one DTensor placement; ValueError naming the param for anything but (strided) Shard and
    Replicate (Partial: the gradient must be reduced before the optimizer runs)."""
    if placement.is_replicate():
        return "R"
    factor = getattr(
        placement, "split_factor", None
    )  # _StridedShard: a Shard subclass in torch 2.9, not in 2.13
    if factor is not None or placement.is_shard():
        dim = placement.dim % len(shape)
        return f"S{dim}" if factor in (None, 1) else f"S{dim}:{int(factor)}"
    raise ValueError(
        f"{name} of shape {shape}: placement {placement} is not supported (Replicate, Shard or "
        f"_StridedShard only)"
    )


def read_layout(
    p: Tensor, name: str, keys: dict[str, Any], world_size: int, rank: int
) -> ParamLayout:
    """The layout of `p` (a DTensor, or a plain tensor replicated over the default group of `world_size`), with the
    param-group layout keys `keys` (num_experts, flatten, split_sizes, num_heads, split_dim); ValueError naming
    the param when its local shard is not the box that its placements give this rank."""
    shape = tuple(p.shape)
    split_sizes = keys.get("split_sizes")
    layout_keys = dict(
        num_experts=keys.get("num_experts"),
        flatten=bool(keys.get("flatten", False)),
        split_sizes=tuple(split_sizes) if split_sizes is not None else None,
        num_heads=keys.get("num_heads"),
        split_dim=keys.get("split_dim", 0),
    )
    if not hasattr(p, "device_mesh"):
        return ParamLayout(
            name, shape, str(p.dtype), tuple(range(world_size)), ("R",), None, **layout_keys
        )
    mesh = p.device_mesh
    codes = tuple(placement_code(pl, name, shape) for pl in p.placements)
    if all(c == "R" for c in codes) and mesh.ndim != 1:
        raise ValueError(
            f"{name} of shape {shape}: a replicated DTensor must live on a 1-D mesh, got {p.placements}"
        )
    layout = ParamLayout(
        name,
        shape,
        str(p.dtype),
        _nested_tuple(mesh.mesh.tolist()),
        codes,
        mesh.mesh_dim_names,
        **layout_keys,
    )
    geo = layout.geometry
    local = geo.boxes[geo.member(rank)].shape
    if tuple(p.to_local().shape) != local:
        raise ValueError(
            f"{name} of shape {shape}: local shard {tuple(p.to_local().shape)} is not the box "
            f"{local} that placements {p.placements} give rank {rank}"
        )
    return layout
