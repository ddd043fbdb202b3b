"""The rank side of the conformance run: module-level functions that muon_dist.launch.RankPool runs on every
rank (picklable arguments, small picklable results)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import Adapter
from .cases import Case, gradients, initial_params, local_box

_MESHES: dict[tuple[int, str], Any] = {}


def _mesh(world_size: int, device: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if (world_size, device) not in _MESHES:
        _MESHES[world_size, device] = init_device_mesh(device, (world_size,), mesh_dim_names=("fsdp",))
    return _MESHES[world_size, device]


def _on_rank(full: torch.Tensor, case: Case) -> torch.Tensor:
    """This rank's view of a full tensor: a DTensor Shard(0) with its torch.chunk box, or a plain copy."""
    if case.mode != "dtensor":
        return full.clone()
    from torch.distributed.tensor import DTensor, Shard

    box = local_box(full, "dtensor", dist.get_rank(), case.world_size).clone()
    mesh = _mesh(case.world_size, case.device)
    return DTensor.from_local(box, mesh, [Shard(0)], shape=full.shape, stride=full.stride())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def candidate_steps(adapter: Adapter, case: Case, hp: dict[str, Any]) -> dict[str, Any]:
    """case.steps steps of the candidate; this rank's params after every step and its final momentum (CPU copies:
    results travel to the parent through a pipe)."""
    params = [torch.nn.Parameter(_on_rank(p, case)) for p in initial_params(case)]
    opt = adapter.build(params, **hp)
    per_step = []
    for step in range(case.steps):
        for p, g in zip(params, gradients(case, step)):
            p.grad = _on_rank(g, case)
        opt.step()
        per_step.append([_local(p.detach()).cpu().clone() for p in params])
    momenta = [adapter.momentum(opt, p) for p in params]
    return {"params": per_step, "momentum": [None if m is None else m.detach().cpu().clone() for m in momenta]}
