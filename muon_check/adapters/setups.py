"""Training setups under the audit (audit.py) and the invariance families (invariance.py): the project's own.

Each builds its optimizers from the model as a user of the project would: the matrices muon_ref.split routes to
Muon (with the model's declared layouts as param-group keys: model.MUON_LAYOUTS), the rest to AdamW.

    DistributedMuonFSDP    FSDP2 (fully_shard per layer and root, 1-D mesh) + DistributedMuon + torch AdamW
    DistributedMuonHSDP    the same on a (W/2 replicate, 2 shard) mesh
    MuonWithAdamWSingle    muon_ref.split.MuonWithAdamW on one device (every rank alone)
    MuonWithAdamWDDP       DistributedDataParallel + MuonWithAdamW (every rank steps the reduced gradient)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..audit import Setup


def muon_groups(
    model: nn.Module, claims: dict[str, dict | None], **extra: Any
) -> tuple[list, list]:
    """(Muon groups, one per param with its layout keys, the other optimizer's params) by the claim."""
    muon, other = [], []
    for name, p in model.named_parameters():
        keys = claims.get(name)
        if keys is None:
            other.append(p)
        else:
            muon.append({"params": [p], **keys, **extra})
    return muon, other


class DistributedMuonFSDP(Setup):
    name = "DistributedMuon + FSDP2"
    sharding, path = "fsdp2", "sharded"
    shardings = ("fsdp2", "hsdp")

    def build(self, model: nn.Module) -> list[Any]:
        from muon_dist import DistributedMuon

        muon, other = muon_groups(getattr(model, "module", model), self.claimed())
        return [DistributedMuon(muon, preset="torch"), torch.optim.AdamW(other, lr=1e-3)]


class DistributedMuonHSDP(DistributedMuonFSDP):
    name = "DistributedMuon + HSDP"
    sharding = "hsdp"


class MuonWithAdamWSingle(Setup):
    name = "muon_ref MuonWithAdamW"
    sharding, path = None, None

    def build(self, model: nn.Module) -> Any:
        from muon_ref.split import MuonWithAdamW

        muon, other = muon_groups(getattr(model, "module", model), self.claimed(), algorithm="muon")
        return MuonWithAdamW(muon + [{"params": other, "algorithm": "adamw"}], preset="torch")


class MuonWithAdamWDDP(MuonWithAdamWSingle):
    name = "muon_ref MuonWithAdamW + DDP"
    sharding, path = "ddp", "replicated"
    shardings = ("ddp",)
