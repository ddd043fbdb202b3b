"""Rank functions of the tensor-parallel tests: a small transformer block under parallelize_module and fully_shard,
trained with DistributedMuon beside muon_ref.Muon on the same (full) gradients."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import muon_ref
from muon_check.fixtures import seeded
from muon_dist import DistributedMuon
from muon_dist.optim import UPDATE_LAYOUT

# tensor parallelism needs the features it splits divisible by tp (2 or 4 here); FSDP2 then cuts the rows of each
# tp piece unevenly (5 rows of qkv's tp piece on 2 dp ranks: 3 and 2), and o's 5 heads of 4 columns straddle the tp
# pieces of 5 columns
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 8, 3, 1, 4, 12
QKV = (
    HEADS * HEAD_DIM,
    KV_HEADS * HEAD_DIM,
    KV_HEADS * HEAD_DIM,
)  # fused q, k, v rows (GQA: unequal blocks)


class Block(nn.Module):
    """A transformer block's matrices: a fused qkv projection, an output projection over the heads, a SwiGLU MLP.
    The mixing in forward is a cheap stand-in for attention; what the test needs is the params and real grads."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, sum(QKV), bias=False)
        self.o = nn.Linear(sum(QKV), HIDDEN, bias=False)
        self.gate = nn.Linear(HIDDEN, FFN, bias=False)
        self.up = nn.Linear(HIDDEN, FFN, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.o(torch.tanh(self.qkv(x)))
        return x + self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def groups(model: Block) -> list[dict]:
    """qkv per block (split_sizes), o per head along its input dim (num_heads, split_dim=1), the MLP plain."""
    return [
        {"params": [model.qkv.weight], "param_names": ["qkv"], "split_sizes": QKV},
        {
            "params": [model.o.weight],
            "param_names": ["o"],
            "num_heads": HEADS + 2 * KV_HEADS,
            "split_dim": 1,
        },
        {
            "params": [model.gate.weight, model.up.weight, model.down.weight],
            "param_names": ["gate", "up", "down"],
        },
    ]


def labelled(model: nn.Module) -> nn.Module:
    """A copy of `model` whose every weight holds its own flat indices (0, 1, 2, ... as float32: exact here)."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape))
    return twin


def assemble(local: torch.Tensor, labels: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The global tensor from every rank's local shard and the flat indices that shard holds (from a labelled twin
    sharded the same way): what FSDP2 and tensor parallelism actually placed where, read without DTensor's
    full_tensor (wrong for uneven _StridedShard in torch 2.9.1) and without muon_dist's or the fixtures' boxes.
    Collective. Every element must come from some rank, and replicas must agree bitwise."""
    pieces: list = [None] * dist.get_world_size()
    dist.all_gather_object(
        pieces, (local.detach().reshape(-1).clone(), labels.detach().reshape(-1).long())
    )
    full = torch.empty(shape.numel(), dtype=local.dtype)
    seen = torch.zeros(shape.numel(), dtype=torch.bool)
    for values, where in pieces:
        assert not (
            seen[where] & (full[where].view(torch.int32) != values.view(torch.int32))
        ).any(), "replicas differ"
        full[where], seen[where] = values, True
    assert seen.all(), f"{int((~seen).sum())} elements held by no rank"
    return full.reshape(shape)


def tp_fsdp_training(dp: int, tp: int, preset: str, steps: int) -> dict:
    """parallelize_module (ColwiseParallel for qkv, gate, up; RowwiseParallel for o, down) over the mesh's tp axis,
    fully_shard over its dp axis, DistributedMuon on the result; muon_ref.Muon on a full copy, fed the full
    gradients of the sharded model. Full tensors are assembled from the local shards and a labelled twin model
    (assemble). Per step: the elements of each param that differ, and the placements."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Block()
    reference, twin = copy.deepcopy(model), labelled(model)
    plan = {
        "qkv": ColwiseParallel(),
        "o": RowwiseParallel(),
        "gate": ColwiseParallel(),
        "up": ColwiseParallel(),
        "down": RowwiseParallel(),
    }
    for m in (model, twin):
        parallelize_module(m, mesh["tp"], plan)
        fully_shard(m, mesh=mesh["dp"])
    labels = {name: p.to_local() for name, p in twin.named_parameters()}
    opt = DistributedMuon(groups(model), preset=preset)
    ref_opt = muon_ref.Muon(groups(reference), preset=preset, update_layout=UPDATE_LAYOUT)
    out = {
        "differs": [],
        "placements": {n: [str(p) for p in w.placements] for n, w in model.named_parameters()},
        "paths": None,
    }
    dp_rank = mesh["dp"].get_local_rank()
    for step in range(steps):
        model(seeded((4, HIDDEN), 1000 * step + dp_rank)).square().mean().backward()
        for (name, p), r in zip(model.named_parameters(), reference.parameters()):
            assert p.grad.placements == p.placements, (name, p.grad.placements)
            r.grad = assemble(p.grad.to_local(), labels[name], p.shape)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        out["differs"].append(
            {
                name: int((assemble(p.to_local(), labels[name], p.shape) != r.detach()).sum())
                for (name, p), r in zip(model.named_parameters(), reference.parameters())
            }
        )
    out["paths"] = opt.last_report.paths
    out["rank"] = dist.get_rank()
    return out
