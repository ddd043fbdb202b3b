"""Planted setup bugs: the field's 2026 reports about the setup around Muon, each restated as a small setup that
the audit (audit.py) or the invariance families (invariance.py) must catch, with the finding that names it
(docs/field-bugs.md: the class of each is PLANTED_SETUPS' field_bug). Each is correct but for the one line its docstring names; the
negative controls are the project's own setups (setups.py) and ReducingMuon below, which must draw no finding.

    name                 report (class)                                         caught by, as
    FlatParamRouting     LlamaFactory #8041, DeepSpeed #8438, verl-SpeCo #91    audit: silent fallback
    HSDPGatherFallback   VeOmni #1011                                           audit: fallback
    MuonGroupsWithoutNS  DeepSpeed #8441, ISEEKYAN/Megatron-LM #130             audit: never orthogonalised
    SplitFromLocalShard  NVIDIA/Megatron-LM #7117                               audit: wrong blocks; invariance W
    LocalShardNS         NVIDIA/Megatron-LM #6380                               audit: wrong blocks; invariance W
    NSPerMicroBatch      DeepSpeed #8443                                        audit: partial gradient;
                                                                                invariance: accumulation
    StraddlingUnreduced  DeepSpeed #7807                                        audit: partial gradient; invariance W
    GatedSplitAsQKV      NVIDIA/Megatron-LM #4731                               audit: wrong blocks
    PackedQKVByName      radixark/miles #3096                                   audit: wrong blocks
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from muon_ref import matrix_layout, read_block
from muon_ref.newton_schulz import newton_schulz

from ..audit import Setup
from ..model import D
from .setups import DistributedMuonFSDP, muon_groups


class SimpleMuon(torch.optim.Optimizer):
    """A plain Muon over full, DTensor or plain params, for the planted setups: sum momentum (mu 0.95),
    Newton-Schulz (muon_ref's default kernel) on each block of the group's layout keys, p -= lr * O.

    gather: "full_tensor" (every rank gathers each DTensor gradient whole and orthogonalises it), "local" (each
    rank orthogonalises its own shard as if it were the matrix), "none" (no Newton-Schulz: momentum SGD);
    reduce: all-reduce plain params' gradients (mean) first (a ZeRO-1/2-style optimizer that owns the reduction),
    except those named in `unreduced`."""

    def __init__(
        self,
        params: Any,
        lr: float = 0.02,
        gather: str = "full_tensor",
        reduce: bool = False,
        unreduced: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__(params, dict(lr=lr))
        self.gather, self.reduce, self.unreduced = gather, reduce, unreduced

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        import torch.distributed as dist

        for group in self.param_groups:
            keys = {k: group[k] for k in ("split_sizes", "num_heads", "split_dim") if k in group}
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if self.reduce and id(p) not in self.unreduced:
                    dist.all_reduce(g)
                    g = g / dist.get_world_size()
                dtensor = hasattr(g, "full_tensor")
                if dtensor:
                    g = g.full_tensor() if self.gather != "local" else g.to_local()
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(g))
                buf.mul_(0.95).add_(g)
                shard = dtensor and self.gather == "local"  # its own block, read whole
                u = buf if self.gather == "none" else _orthogonalise(buf, {} if shard else keys)
                if dtensor and self.gather != "local":
                    from torch.distributed.tensor import distribute_tensor

                    u = distribute_tensor(u, p.device_mesh, p.placements).to_local()
                local = p.to_local() if dtensor else p
                local.add_(u, alpha=-group["lr"])


def _orthogonalise(m: Tensor, keys: dict[str, Any]) -> Tensor:
    if m.dim() < 2 or m.numel() == 0:
        return m
    if m.dim() == 3:
        return newton_schulz(m).to(m.dtype)
    out = torch.empty_like(m)
    for block in matrix_layout(tuple(m.shape), **keys).blocks:
        out[block.index] = newton_schulz(read_block(m, block)).reshape(out[block.index].shape)
    return out


class _PlantedSetup(Setup):
    sharding, path = "fsdp2", None

    def optimizer(self, muon: list, other: list, model: nn.Module) -> list[Any]:
        return [SimpleMuon(muon), torch.optim.AdamW(other, lr=1e-3)]

    def build(self, model: nn.Module) -> list[Any]:
        muon, other = self.groups(getattr(model, "module", model))
        return self.optimizer(muon, other, model)

    def groups(self, model: nn.Module) -> tuple[list, list]:
        return muon_groups(model, self.claimed())


def _without_splits(claims: dict[str, dict | None]) -> dict[str, dict | None]:
    """The claims with every fused projection's split_sizes taken out (per-head layouts kept)."""
    return {
        n: None if k is None else {key: v for key, v in k.items() if key != "split_sizes"}
        for n, k in claims.items()
    }


class FlatParamRouting(_PlantedSetup):
    """Routes by `ndim == 2` on the param as the engine shows it: flattened to 1-D (FSDP1's flat params, ZeRO-3's
    partitions, zero.Init's placeholders), every matrix looks like a vector and goes to AdamW."""

    name = "planted: routing by ndim on flattened params"

    def groups(self, model: nn.Module) -> tuple[list, list]:
        muon, other = [], []
        for _, p in model.named_parameters():
            seen = p.to_local().reshape(-1) if hasattr(p, "to_local") else p.reshape(-1)
            (muon if seen.ndim == 2 else other).append(p)
        return [{"params": muon}] if muon else [], other

    def optimizer(self, muon: list, other: list, model: nn.Module) -> list[Any]:
        return ([SimpleMuon(muon)] if muon else []) + [torch.optim.AdamW(other, lr=1e-3)]


class HSDPGatherFallback(_PlantedSetup):
    """Claims DistributedMuon's sharded path; on a 2-D (HSDP) mesh it falls back to gathering every gradient
    whole on every rank (full_tensor) and orthogonalising it there."""

    name = "planted: full_tensor fallback on an HSDP mesh"
    sharding, path = "hsdp", "sharded"

    def optimizer(self, muon: list, other: list, model: nn.Module) -> list[Any]:
        mesh = next(p for g in muon for p in g["params"]).device_mesh
        if mesh.ndim == 2:
            return [SimpleMuon(muon, gather="full_tensor"), torch.optim.AdamW(other, lr=1e-3)]
        return DistributedMuonFSDP().build(model)


class MuonGroupsWithoutNS(_PlantedSetup):
    """Builds Muon groups (use_muon=True) but its step under the default stage never runs Newton-Schulz: the
    matrices get momentum SGD."""

    name = "planted: Muon groups stepped without Newton-Schulz"

    def groups(self, model: nn.Module) -> tuple[list, list]:
        muon, other = super().groups(model)
        return [{**g, "use_muon": True} for g in muon], other

    def optimizer(self, muon: list, other: list, model: nn.Module) -> list[Any]:
        return [SimpleMuon(muon, gather="none"), torch.optim.AdamW(other, lr=1e-3)]


class SplitFromLocalShard(_PlantedSetup):
    """Decides whether a fused projection is split from the param's local shard: `local rows == 3 * d` (or 4 * d)
    holds on one rank and fails once the rows are sharded, so the split is lost at W > 1."""

    name = "planted: fused split decided on the local shard"
    path = "sharded"

    def groups(self, model: nn.Module) -> tuple[list, list]:
        muon, other = muon_groups(model, _without_splits(self.claimed()))
        for g in muon:
            sizes = self.split_of(g["params"][0])
            if sizes is not None:
                g["split_sizes"] = sizes
        return muon, other

    def split_of(self, p: Tensor) -> tuple[int, ...] | None:
        """The split_sizes this setup gives a fused projection, or None (the param stays whole)."""
        rows = p.to_local().shape[0] if hasattr(p, "to_local") else p.shape[0]
        return (D,) * (rows // D) if p.ndim == 2 and rows in (3 * D, 4 * D) else None

    def optimizer(self, muon: list, other: list, model: nn.Module) -> list[Any]:
        from muon_dist import DistributedMuon

        return [DistributedMuon(muon, preset="torch"), torch.optim.AdamW(other, lr=1e-3)]


class LocalShardNS(_PlantedSetup):
    """Orthogonalises each rank's local block of a sharded matrix as if it were the matrix (blockwise mode)."""

    name = "planted: Newton-Schulz on the local shard"

    def optimizer(self, muon: list, other: list, model: nn.Module) -> list[Any]:
        return [SimpleMuon(muon, gather="local"), torch.optim.AdamW(other, lr=1e-3)]


class NSPerMicroBatch(_PlantedSetup):
    """Orthogonalises each micro-batch's gradient in its backward (as a reduction hook would) and steps on the
    sum of the orthogonalised micro-batch updates: Newton-Schulz k times per optimizer step."""

    name = "planted: Newton-Schulz once per micro-batch"

    def optimizer(self, muon: list, other: list, model: nn.Module) -> list[Any]:
        return [SimpleMuon(muon, gather="none"), torch.optim.AdamW(other, lr=1e-3)]

    def train_step(self, model: nn.Module, optimizers: list[Any], probes: list[dict]) -> None:
        muon = [p for g in optimizers[0].param_groups for p in g["params"]]
        keys = {
            id(p): {k: g[k] for k in ("split_sizes", "num_heads", "split_dim") if k in g}
            for g in optimizers[0].param_groups
            for p in g["params"]
        }
        summed: dict[int, Tensor] = {}
        for probe in probes:
            model(probe=probe).backward()
            with torch.no_grad():
                for p in muon:
                    full = p.grad.full_tensor()
                    from torch.distributed.tensor import distribute_tensor

                    o = distribute_tensor(
                        _orthogonalise(full, keys[id(p)]), p.device_mesh, p.placements
                    )
                    summed[id(p)] = summed[id(p)] + o if id(p) in summed else o
                    p.grad = None
        for p in muon:
            p.grad = summed[id(p)]
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)


class ReducingMuon(_PlantedSetup):
    """The negative control of StraddlingUnreduced: a replicated model, an optimizer that all-reduces every
    gradient itself (ZeRO-1/2 style) and orthogonalises on every rank."""

    name = "control: an optimizer that owns the reduction"
    sharding, path = None, "replicated"
    unreduced = True

    def optimizer(self, muon: list, other: list, model: nn.Module) -> list[Any]:
        return [
            SimpleMuon(muon, reduce=True, unreduced=self.skipped(muon, model)),
            SimpleAdamW(other),
        ]

    def skipped(self, muon: list, model: nn.Module) -> frozenset[int]:
        return frozenset()


class StraddlingUnreduced(ReducingMuon):
    """Reduces each gradient only where the param lies inside one rank's partition of the flat buffer: a param
    that straddles a partition boundary is stepped from this rank's own, unreduced gradient."""

    name = "planted: partition-straddling params stepped on unreduced gradients"

    def skipped(self, muon: list, model: nn.Module) -> frozenset[int]:
        import torch.distributed as dist

        W = dist.get_world_size()
        params = list(model.parameters())
        total = sum(p.numel() for p in params)
        edges = [math.ceil(total / W) * r for r in range(1, W)]
        out, offset = set(), 0
        for p in params:
            if any(offset < e < offset + p.numel() for e in edges):
                out.add(id(p))
            offset += p.numel()
        return frozenset(out)


class SimpleAdamW(torch.optim.AdamW):
    """torch's AdamW after a mean all-reduce of every gradient (the control's other optimizer)."""

    def step(self, closure: Any = None) -> Any:
        import torch.distributed as dist

        with torch.no_grad():
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                        p.grad /= dist.get_world_size()
        return super().step(closure)


class GatedSplitAsQKV(SplitFromLocalShard):
    """Splits every fused attention projection by the q, k, v sizes (q = the rows left after k and v): the gated
    layout [q_gate, q, k, v] is cut as [q_gate + q, k, v]."""

    name = "planted: gated attention split as q, k, v"
    path = "sharded"

    def split_of(self, p: Tensor) -> tuple[int, ...] | None:
        if p.ndim == 2 and p.shape[0] in (3 * D, 4 * D):
            return (p.shape[0] - 2 * D, D, D)
        return None


class PackedQKVByName(SplitFromLocalShard):
    """Splits fused projections found by name (`*query_key_value*`, `*qkv_proj*`): a packed QKV named otherwise
    (here `wqkv`, `wgqkv`) is orthogonalised as one matrix."""

    name = "planted: packed QKV under another name"
    patterns = ("*query_key_value*", "*qkv_proj*")

    def groups(self, model: nn.Module) -> tuple[list, list]:
        claims = self.claimed()
        found = {
            n: k for n, k in claims.items() if any(fnmatch.fnmatch(n, p) for p in self.patterns)
        }
        return muon_groups(model, {**_without_splits(claims), **found})


@dataclass(frozen=True)
class PlantedSetup:
    """A planted setup bug: the audit at (world_size, micro_batches) must name `finding`; `breaks`: the
    invariance (invariance.py) its training must break, or None where its params stay invariant (a routing or
    path bug that leaves the arithmetic equal on gloo/CPU). field_bug: its class in docs/field-bugs.md."""

    setup: type[Setup]
    world_size: int
    micro_batches: int
    finding: str
    field_bug: int
    source: str
    breaks: str | None = None


PLANTED_SETUPS: dict[str, PlantedSetup] = {
    "FlatParamRouting": PlantedSetup(
        FlatParamRouting, 2, 1, "silent fallback", 28, "LlamaFactory #8041, verl-SpeCo #91"
    ),
    "HSDPGatherFallback": PlantedSetup(HSDPGatherFallback, 4, 1, "fallback", 15, "VeOmni #1011"),
    "MuonGroupsWithoutNS": PlantedSetup(
        MuonGroupsWithoutNS, 2, 1, "never orthogonalised", 14, "DeepSpeed #8441"
    ),
    "SplitFromLocalShard": PlantedSetup(
        SplitFromLocalShard, 4, 1, "wrong blocks", 29, "Megatron-LM #7117", "world size"
    ),
    "LocalShardNS": PlantedSetup(
        LocalShardNS, 2, 1, "wrong blocks", 30, "Megatron-LM #6380", "world size"
    ),
    "NSPerMicroBatch": PlantedSetup(
        NSPerMicroBatch, 2, 2, "partial gradient", 7, "DeepSpeed #8443", "gradient accumulation"
    ),
    "StraddlingUnreduced": PlantedSetup(
        StraddlingUnreduced, 2, 1, "partial gradient", 6, "DeepSpeed #7807", "world size"
    ),
    "GatedSplitAsQKV": PlantedSetup(GatedSplitAsQKV, 2, 1, "wrong blocks", 31, "Megatron-LM #4731"),
    "PackedQKVByName": PlantedSetup(PackedQKVByName, 2, 1, "wrong blocks", 32, "miles #3096"),
}
# the negative controls: setups that must draw no finding and stay invariant, (setup, world size, micro-batches)
CONTROL_SETUPS: dict[str, tuple[type[Setup], int, int]] = {
    "ReducingMuon": (ReducingMuon, 2, 1),
}
