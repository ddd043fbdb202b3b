"""The peers timed beside DistributedMuon on the same Shard(0) DTensors: torch.optim.Muon and, given a checkout of
microsoft/dion (`--dion PATH`), dion.Muon. Timing only, except torch.optim.Muon at W = 1 (below).

    torch_muon   torch.optim.Muon(nesterov=True) with the "torch" preset's lr, weight decay and momentum (the
                 conventions muon_ref's preset "torch" restates). At W = 1 on the params' local tensors (the whole
                 tensors: what a single-device user runs), compared with muon_ref bit for bit; at W > 1 on the
                 DTensors as they are (DTensor's sharded matmuls: neither a distributed Muon nor bitwise).
    dion         dion.Muon over the params' mesh, Polar Express off (so its Newton-Schulz is the quintic of
                 muon_ref's bf16 kernel), the same lr, momentum and weight decay, nesterov=True; Dion's own
                 conventions otherwise (never compared). Its modules are imported with TORCHDYNAMO_DISABLE=1:
                 their torch.compile needs a C++ compiler on the CPU.
torch.optim.Muon takes 2-D params only (the sets of matrices: `dense`); dion.Muon also takes the expert sets, a 3-D
stack [E, m, n] as E matrices (its default flatten=False: Newton-Schulz batched over the leading dim).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

PEERS = ("torch_muon", "dion")


def hyperparameters() -> dict[str, float]:
    from .gpu import hyperparameters as preset_torch

    return preset_torch()


class LocalTorchMuon:
    """torch.optim.Muon on the local tensors of DTensor params, their gradients' local tensors as its grads for
    the step (dropped after it: the DTensor gradients keep the storage, so no step frees a previous gradient,
    which benchmarks.memory would count against the step's peak)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.local = [p.to_local() for p in params]
        self.opt = torch.optim.Muon(self.local, nesterov=True, **hyperparameters())

    def step(self) -> None:
        for local, p in zip(self.local, self.params):
            local.grad = p.grad.to_local()
        self.opt.step()
        for local in self.local:
            local.grad = None


def torch_muon(params: list[torch.Tensor], world_size: int) -> Any:
    if world_size == 1:
        return LocalTorchMuon(params)
    return torch.optim.Muon(params, nesterov=True, **hyperparameters())


# Bench.dion's value for an installed dion package (not a checkout's path)
INSTALLED = "installed"


def installed_dion() -> str | None:
    return INSTALLED if importlib.util.find_spec("dion") is not None else None


def load_dion(path: str) -> Any:
    """The dion package of the checkout at `path` (INSTALLED: the installed one), with torch.compile off (read
    when its modules load)."""
    from .gpu import load_dion as load

    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    return importlib.import_module("dion") if path == INSTALLED else load(path)


def dion_muon(dion: Any, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    hp = hyperparameters()
    return dion.Muon(
        params,
        distributed_mesh=params[0].device_mesh,
        lr=hp["lr"],
        mu=hp["momentum"],
        weight_decay=hp["weight_decay"],
        nesterov=True,
        use_polar_express=False,
    )
