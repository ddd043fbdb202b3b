"""Building a path's batch by hand (for tests that run one path alone): a layout on a 1-D or (ep, fsdp) mesh, the
batch of `count` params of it on `path` with the path's own owners, and each rank's box of a full tensor."""

from __future__ import annotations

import torch

from muon_dist import Batch, ParamLayout
from muon_dist.paths import PATHS


def layout_1d(
    shape: tuple[int, ...], placement: str, world_size: int, dtype: torch.dtype | str
) -> ParamLayout:
    """A param of `shape` on a 1-D mesh of world_size ranks: "S<d>" sharded, "R" replicated."""
    return ParamLayout(
        "p", tuple(shape), str(dtype), tuple(range(world_size)), (placement,), ("fsdp",)
    )


def layout_ep(
    shape: tuple[int, ...],
    ep: int,
    fsdp: int,
    dtype: torch.dtype | str,
    num_experts: int | None = None,
) -> ParamLayout:
    """An expert stack on an (ep, fsdp) mesh with (Shard(0), Shard(0)); fused [E * m, n] when num_experts is set."""
    mesh = tuple(tuple(range(i * fsdp, (i + 1) * fsdp)) for i in range(ep))
    return ParamLayout(
        "p", tuple(shape), str(dtype), mesh, ("S0", "S0"), ("ep", "fsdp"), num_experts
    )


def batch_of(path: str, layout: ParamLayout, count: int, update_dtype: torch.dtype | str) -> Batch:
    """`count` params of `layout` as one batch on `path`, owned as the path owns them."""
    geometry = layout.geometry
    return Batch(
        path,
        tuple(range(count)),
        (geometry,) * count,
        PATHS[path].owners(count, geometry.group_size),
        layout.dtype,
        str(update_dtype),
    )


def box(full: torch.Tensor, layout: ParamLayout, rank: int) -> torch.Tensor:
    """This rank's box of `full` under the layout (contiguous)."""
    geometry = layout.geometry
    return full[geometry.boxes[geometry.member(rank)].index].contiguous()
