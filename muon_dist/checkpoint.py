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
Contract: bitwise; both directions only move bits (DTensor.full_tensor gathers, a Replicate -> Shard
redistribution takes torch.chunk's local box without communication).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor

from .optim import DistributedMuon


def _params(opt: torch.optim.Optimizer) -> list[Tensor]:
    """The params in state-dict index order (torch.optim numbers them across groups in order)."""
    return [p for group in opt.param_groups for p in group["params"]]


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def _like_param(full: Tensor, param: Tensor) -> Tensor:
    """This rank's part of `full`, placed like `param` (a copy of full for a plain param)."""
    if not hasattr(param, "device_mesh"):
        return full.detach().clone()
    from torch.distributed.tensor import DTensor, Replicate

    mesh = param.device_mesh
    whole = DTensor.from_local(full.detach().clone(), mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, param.placements)


def to_reference_state_dict(opt: DistributedMuon) -> dict[str, Any]:
    """A muon_ref.Muon state dict (full tensors) of opt's state. Collective: call on every rank."""
    state = opt.state_dict()
    full = {index: {key: _full(value) for key, value in state["state"][index].items()}
            for index in sorted(state["state"])}  # sorted: full_tensor is a collective, same order on every rank
    return {"state": full, "param_groups": copy.deepcopy(state["param_groups"])}


def from_reference_state_dict(ref_state: dict[str, Any], opt: DistributedMuon) -> dict[str, Any]:
    """A DistributedMuon state dict for opt's params from a muon_ref.Muon one (full tensors, the same param
    order). Local: every rank takes its own box. A param muon_ref never stepped gets a zero buffer."""
    params = _params(opt)
    if len(params) != sum(len(g["params"]) for g in ref_state["param_groups"]):
        raise ValueError(f"the reference state dict has {sum(len(g['params']) for g in ref_state['param_groups'])} "
                         f"params, the optimizer {len(params)}")
    state = {}
    for index, param in enumerate(params):
        saved = ref_state["state"].get(index, {})
        buf = saved.get("momentum_buffer")
        if buf is not None and tuple(buf.shape) != tuple(param.shape):
            raise ValueError(f"param {index} of shape {tuple(param.shape)}: the reference momentum buffer has "
                             f"shape {tuple(buf.shape)}")
        state[index] = {"momentum_buffer": torch.zeros_like(param) if buf is None else _like_param(buf, param)}
    return {"state": state, "param_groups": copy.deepcopy(ref_state["param_groups"])}
