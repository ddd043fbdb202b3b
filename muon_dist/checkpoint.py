"""Checkpoints across world sizes: DistributedMuon's state dict and muon_ref.Muon's, each into the other.

DistributedMuon.state_dict() is torch.optim's: {"state": {index: {"momentum_buffer": M}}, "param_groups": [...]},
where M is a DTensor placed like its param (a plain tensor for a plain param). Every rank holds the same keys from
construction on (a zero buffer until the param steps), so torch.distributed.checkpoint saves it at world size W
and loads it into an optimizer at any W' (DCP reshards the DTensors); tests/dist/test_checkpoint.py shows the run
continues bitwise like an uninterrupted one. The state holds nothing derived from shapes or hyperparameters (the
lr scale is recomputed from the global shape and the group's values at every step), so a loaded group with new
hyperparameters steps with the new ones.

Reference equations, on every rank after the same steps (muon_ref's missing buffers read as zeros):
    to_reference_state_dict(opt)                          == muon_ref.Muon(full params).state_dict()
    opt.load_state_dict(from_reference_state_dict(sd, opt)); to_reference_state_dict(opt) == sd
Contract: bitwise; both directions only move bits. Both read the boxes of a DTensor from muon_dist's own layout
(muon_dist/geometry.py, what the optimizer steps on), never from DTensor.full_tensor or redistribute, whose rows
are wrong for some uneven tensor-parallel shards in torch 2.9 (docs/compat.md, "Torch behaviours the code works
around").
    to reference: each shard group all-gathers its members' boxes (padded to the largest, flattened; recorded in
                  the optimizer's ledger as "checkpoint") and places each in the global tensor;
    from reference: each rank copies its own box of the global tensor, no communication.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor

from muon_ref.optim import param_name

from .optim import DistributedMuon


def _params(opt: DistributedMuon) -> list[tuple[Tensor, dict[str, Any], str]]:
    """(param, its group, its name) in state-dict index order (torch.optim numbers params across groups in order)."""
    return [
        (p, group, param_name(group, i))
        for group in opt.param_groups
        for i, p in enumerate(group["params"])
    ]


def _full(
    opt: DistributedMuon, t: Tensor, param: Tensor, group: dict[str, Any], name: str
) -> Tensor:
    """The global tensor of `t`, a tensor placed like `param`: a collective over param's shard group."""
    if not hasattr(t, "device_mesh"):
        return t.detach().clone()
    geo = opt.layout(param, group, name).geometry
    local = t.to_local().detach()
    if not geo.sharded:
        return local.clone()
    width = max(geo.sizes)
    mine = torch.zeros(width, dtype=local.dtype, device=local.device)
    mine[: local.numel()] = local.reshape(-1)
    group = opt.shard_group(geo, param.device_mesh)
    pieces = opt.comm.all_gather(mine, group, "checkpoint").reshape(len(geo.boxes), width)
    full = torch.empty(geo.global_shape, dtype=local.dtype, device=local.device)
    for piece, box in zip(pieces, geo.boxes):
        full[box.index] = piece[: box.numel].reshape(box.shape)
    return full


def _like_param(
    opt: DistributedMuon, full: Tensor, param: Tensor, group: dict[str, Any], name: str
) -> Tensor:
    """This rank's box of `full`, placed like `param` (a copy of full for a plain param). Local."""
    if not hasattr(param, "device_mesh"):
        return full.detach().clone()
    geo = opt.layout(param, group, name).geometry
    box = geo.boxes[geo.member(opt.comm.rank)]
    local = full.detach()[box.index].to(param.device).clone(memory_format=torch.contiguous_format)
    return DistributedMuon._like_param(local, param)


def to_reference_state_dict(opt: DistributedMuon) -> dict[str, Any]:
    """A muon_ref.Muon state dict (full tensors) of opt's state. Collective: call on every rank."""
    state, params = opt.state_dict(), _params(opt)
    full = {
        index: {
            key: _full(opt, value, *params[index]) for key, value in state["state"][index].items()
        }
        for index in sorted(state["state"])
    }  # sorted: _full is a collective, same order on every rank
    return {"state": full, "param_groups": copy.deepcopy(state["param_groups"])}


def from_reference_state_dict(ref_state: dict[str, Any], opt: DistributedMuon) -> dict[str, Any]:
    """A DistributedMuon state dict for opt's params from a muon_ref.Muon one (full tensors, the same param
    order). Local: every rank takes its own box. A param muon_ref never stepped gets a zero buffer."""
    params = _params(opt)
    if len(params) != sum(len(g["params"]) for g in ref_state["param_groups"]):
        raise ValueError(
            f"the reference state dict has {sum(len(g['params']) for g in ref_state['param_groups'])} "
            f"params, the optimizer {len(params)}"
        )
    state = {}
    for index, (param, group, name) in enumerate(params):
        saved = ref_state["state"].get(index, {})
        buf = saved.get("momentum_buffer")
        if buf is not None and tuple(buf.shape) != tuple(param.shape):
            raise ValueError(
                f"{name} (param {index}) of shape {tuple(param.shape)}: the reference momentum buffer has "
                f"shape {tuple(buf.shape)}"
            )
        state[index] = {
            "momentum_buffer": torch.zeros_like(param)
            if buf is None
            else _like_param(opt, buf, param, group, name)
        }
    return {"state": state, "param_groups": copy.deepcopy(ref_state["param_groups"])}
