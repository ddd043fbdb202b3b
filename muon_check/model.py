"""A small real model for the setup audit (audit.py) and the invariance families (invariance.py).

A two-layer decoder with the layouts that setups route wrongly in the field (docs/field-bugs.md, classes 13-22):

    embed.weight                 (V, d)        embedding (tied: the head reads it too)      AdamW
    layers.0.attn_norm.weight    (d,)          norm                                          AdamW
    layers.0.attn.wqkv.weight    (3d, d)       fused [q, k, v]                               Muon, split_sizes (d, d, d)
    layers.0.attn.wqkv.bias      (3d,)         bias                                          AdamW
    layers.0.attn.wo.weight      (d, d)        hidden matrix                                 Muon
    layers.0.mlp_norm.weight     (d,)          norm                                          AdamW
    layers.0.mlp.up.weight       (f, d)        hidden matrix                                 Muon
    layers.0.mlp.up.bias         (f,)          bias                                          AdamW
    layers.0.mlp.down.weight     (d, f)        hidden matrix                                 Muon
    layers.1.attn_norm.weight    (d,)          norm                                          AdamW
    layers.1.attn.wgqkv.weight   (4d, d)       gated attention [q_gate, q, k, v]             Muon, split_sizes (d, d, d, d)
    layers.1.attn.wo.weight      (d, H * hd)   per-head output projection                    Muon, num_heads H on dim 1
    layers.1.mlp_norm.weight     (d,)          norm                                          AdamW
    layers.1.mlp.router.weight   (E_l, d)      router (a matrix: muon_ref.split sends it to Muon)
    layers.1.mlp.small.weight    (E_s, f, d)   expert stack, E_s = 2 (< W at W = 4)           Muon, per expert
    layers.1.mlp.large.weight    (E_l, d, f)   expert stack, E_l = 6 (> W at W = 4)           Muon, per expert
    norm.weight                  (d,)          final norm                                    AdamW

`MUON_LAYOUTS` is the model's declared Newton-Schulz layout of each matrix (muon_ref layout keys): the claim a
setup that honours fused projections makes. The real forward (`model(tokens)`) runs attention, the gated
attention, a top-1 MoE and the tied head; `model(probe=G)` instead returns sum over params of <p, G[name]>, each
term computed in the forward of the module that holds the param (so FSDP2 unshards each unit, and ZeRO-3 fetches
each module's params, as in training), whose gradient is G
exactly: the audit and the invariance families feed known gradients through the setup's real backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

D, HEADS, HEAD_DIM, FFN, VOCAB = 8, 2, 4, 12, 16
SMALL_EXPERTS, LARGE_EXPERTS = 2, 6

MUON_LAYOUTS: dict[str, dict[str, Any]] = {
    "layers.0.attn.wqkv.weight": {"split_sizes": (D, D, D)},
    "layers.1.attn.wgqkv.weight": {"split_sizes": (D, D, D, D)},
    "layers.1.attn.wo.weight": {"num_heads": HEADS, "split_dim": 1},
}


class _Probed(nn.Module):
    """A module whose forward can return the probe term: its own (direct) params' term plus each child's, through
    the child's own forward (an engine that fetches a module's params in that module's forward, ZeRO-3, sees
    every param read in its module)."""

    prefix = ""

    def probe_term(self, probe: dict[str, Tensor]) -> Tensor:
        total = torch.zeros((), dtype=torch.float32)
        for name, p in self.named_parameters(recurse=False):
            g = probe.get(self.prefix + name)
            if g is not None:
                total = total + (p * g.to(p.dtype)).sum().float()
        for child in self.children():
            for module in child if isinstance(child, nn.ModuleList) else (child,):
                total = total + module(probe=probe)
        return total


class Linear(nn.Linear, _Probed):
    """nn.Linear whose forward also takes the probe."""

    def forward(self, x: Tensor | None = None, probe: dict[str, Tensor] | None = None) -> Tensor:
        return self.probe_term(probe) if probe is not None else super().forward(x)


class Embedding(nn.Embedding, _Probed):
    """nn.Embedding whose forward also takes the probe."""

    def forward(self, x: Tensor | None = None, probe: dict[str, Tensor] | None = None) -> Tensor:
        return self.probe_term(probe) if probe is not None else super().forward(x)


class Attention(_Probed):
    def __init__(self, gated: bool) -> None:
        super().__init__()
        self.gated = gated
        if gated:
            self.wgqkv = Linear(D, 4 * D, bias=False)
            self.wo = Linear(HEADS * HEAD_DIM, D, bias=False)
        else:
            self.wqkv = Linear(D, 3 * D, bias=True)
            self.wo = Linear(D, D, bias=False)

    def forward(self, x: Tensor | None = None, probe: dict[str, Tensor] | None = None) -> Tensor:
        if probe is not None:
            return self.probe_term(probe)
        B, T, _ = x.shape
        if self.gated:
            gate, q, k, v = self.wgqkv(x).split(D, dim=-1)
        else:
            q, k, v = self.wqkv(x).split(D, dim=-1)
        q, k, v = (t.reshape(B, T, HEADS, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
        o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = o.transpose(1, 2).reshape(B, T, HEADS * HEAD_DIM)
        if self.gated:
            o = o * torch.sigmoid(gate)
        return self.wo(o)


class MLP(_Probed):
    def __init__(self) -> None:
        super().__init__()
        self.up = Linear(D, FFN, bias=True)
        self.down = Linear(FFN, D, bias=False)

    def forward(self, x: Tensor | None = None, probe: dict[str, Tensor] | None = None) -> Tensor:
        if probe is not None:
            return self.probe_term(probe)
        return self.down(nn.functional.gelu(self.up(x)))


class Experts(_Probed):
    """A stack of E experts, weight (E, fan_out, fan_in)."""

    def __init__(self, experts: int, fan_out: int, fan_in: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, fan_out, fan_in))

    def forward(self, x: Tensor | None = None, probe: dict[str, Tensor] | None = None) -> Tensor:
        if probe is not None:
            return self.probe_term(probe)
        return torch.einsum("eoi,ti->teo", self.weight, x)


class MoE(_Probed):
    """Top-1 routing over the large experts (d -> f -> d through small's first expert's transpose)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = Linear(D, LARGE_EXPERTS, bias=False)
        self.small = Experts(SMALL_EXPERTS, FFN, D)
        self.large = Experts(LARGE_EXPERTS, D, FFN)

    def forward(self, x: Tensor | None = None, probe: dict[str, Tensor] | None = None) -> Tensor:
        if probe is not None:
            return self.probe_term(probe)
        flat = x.reshape(-1, D)
        choice = self.router(flat).argmax(-1)
        hidden = nn.functional.gelu(self.small(flat).mean(1))  # (T, f)
        out = self.large(hidden)  # (T, E_l, d)
        weight = torch.softmax(self.router(flat), -1)[torch.arange(flat.shape[0]), choice]
        picked = out[torch.arange(flat.shape[0]), choice] * weight[:, None]
        return picked.reshape(x.shape)


class RMSNorm(_Probed):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D))

    def forward(self, x: Tensor | None = None, probe: dict[str, Tensor] | None = None) -> Tensor:
        if probe is not None:
            return self.probe_term(probe)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Layer(_Probed):
    def __init__(self, gated: bool, moe: bool) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(), Attention(gated)
        self.mlp_norm = RMSNorm()
        self.mlp = MoE() if moe else MLP()

    def forward(self, x: Tensor | None = None, probe: dict[str, Tensor] | None = None) -> Tensor:
        if probe is not None:
            return self.probe_term(probe)
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class AuditModel(_Probed):
    """The model of the module docstring; `model(tokens)` the logits, `model(probe=G)` the probe loss."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.embed = Embedding(VOCAB, D)
        self.layers = nn.ModuleList([Layer(gated=False, moe=False), Layer(gated=True, moe=True)])
        self.norm = RMSNorm()
        for name, module in self.named_modules():
            if isinstance(module, _Probed):
                module.prefix = name + "." if name else ""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in sorted(self.named_parameters()):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)

    def forward(
        self, tokens: Tensor | None = None, probe: dict[str, Tensor] | None = None
    ) -> Tensor:
        if probe is not None:  # each module's own forward: an FSDP2 unit unshards there
            return self.probe_term(probe)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x) @ self.embed.weight.T  # the tied head


def shapes() -> dict[str, tuple[int, ...]]:
    """Every param's global shape, in model order."""
    return {name: tuple(p.shape) for name, p in AuditModel().named_parameters()}
