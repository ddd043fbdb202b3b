"""Model-like parameter sets, written out as shape tables (no downloads).

Each table is a list of ParamSpec in model order: what a transformer's optimizer sees. `kind` routes it:
"matrix" and "experts" go to Muon, "embedding", "head" and "vector" go to AdamW (muon_ref.split's rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["matrix", "experts", "embedding", "head", "vector"]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its name, global shape and kind; experts are stacked [E, fan_out, fan_in], or fused
    [E * fan_out, fan_in] with `fused_experts = E`."""

    name: str
    shape: tuple[int, ...]
    kind: Kind
    fused_experts: int | None = None

    @property
    def is_muon(self) -> bool:
        return self.kind in ("matrix", "experts")

    @property
    def num_experts(self) -> int | None:
        if self.kind != "experts":
            return None
        return self.fused_experts or self.shape[0]

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """(fan_out, fan_in) of one matrix (one expert)."""
        rows = self.shape[-2] // self.fused_experts if self.fused_experts else self.shape[-2]
        return rows, self.shape[-1]


def transformer(
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ffn: int,
    vocab: int,
    experts: int = 0,
    expert_ffn: int = 0,
    moe_every: int = 1,
    tie_embeddings: bool = False,
) -> list[ParamSpec]:
    """A decoder-only transformer: attention (q, k, v, o), a SwiGLU MLP or an MoE block, RMSNorms."""
    specs = [ParamSpec("embed.weight", (vocab, hidden), "embedding")]
    for i in range(layers):
        pre = f"layers.{i}."
        specs += [
            ParamSpec(pre + "attn_norm.weight", (hidden,), "vector"),
            ParamSpec(pre + "q_proj.weight", (heads * head_dim, hidden), "matrix"),
            ParamSpec(pre + "k_proj.weight", (kv_heads * head_dim, hidden), "matrix"),
            ParamSpec(pre + "v_proj.weight", (kv_heads * head_dim, hidden), "matrix"),
            ParamSpec(pre + "o_proj.weight", (hidden, heads * head_dim), "matrix"),
            ParamSpec(pre + "mlp_norm.weight", (hidden,), "vector"),
        ]
        if experts and i % moe_every == 0:
            specs += [
                ParamSpec(pre + "router.weight", (experts, hidden), "matrix"),
                ParamSpec(pre + "experts.gate_up", (experts, 2 * expert_ffn, hidden), "experts"),
                ParamSpec(pre + "experts.down", (experts, hidden, expert_ffn), "experts"),
            ]
        else:
            specs += [
                ParamSpec(pre + "gate_proj.weight", (ffn, hidden), "matrix"),
                ParamSpec(pre + "up_proj.weight", (ffn, hidden), "matrix"),
                ParamSpec(pre + "down_proj.weight", (hidden, ffn), "matrix"),
            ]
    specs.append(ParamSpec("final_norm.weight", (hidden,), "vector"))
    if not tie_embeddings:
        specs.append(ParamSpec("lm_head.weight", (vocab, hidden), "head"))
    return specs


def dense_7b() -> list[ParamSpec]:
    # meta-llama/Llama-2-7b-hf config.json: hidden 4096, 32 layers, 32 heads, ffn 11008, vocab 32000
    return transformer(
        layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128, ffn=11008, vocab=32000
    )


def moe_30b_a3b() -> list[ParamSpec]:
    # Qwen/Qwen3-30B-A3B config.json: hidden 2048, 48 layers, 32 q / 4 kv heads of 128, 128 experts of
    # moe_intermediate 768, vocab 151936, every layer MoE
    return transformer(
        layers=48,
        hidden=2048,
        heads=32,
        kv_heads=4,
        head_dim=128,
        ffn=0,
        vocab=151936,
        experts=128,
        expert_ffn=768,
    )


def moe_235b_a22b() -> list[ParamSpec]:
    # Qwen/Qwen3-235B-A22B config.json: hidden 4096, 94 layers, 64 q / 4 kv heads of 128, 128 experts of
    # moe_intermediate 1536, vocab 151936, every layer MoE
    return transformer(
        layers=94,
        hidden=4096,
        heads=64,
        kv_heads=4,
        head_dim=128,
        ffn=0,
        vocab=151936,
        experts=128,
        expert_ffn=1536,
    )


def dense_70b() -> list[ParamSpec]:
    # meta-llama/Meta-Llama-3-70B config.json: hidden 8192, 80 layers, 64 q / 8 kv heads of 128, ffn 28672,
    # vocab 128256
    return transformer(
        layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, ffn=28672, vocab=128256
    )


def tiny_moe() -> list[ParamSpec]:
    """A scaled-down transformer with dense and MoE layers for gloo runs on 2 cores: odd and prime sizes
    so shards are uneven, and more matrices than ranks of some shapes and fewer of others."""
    return transformer(
        layers=3,
        hidden=24,
        heads=3,
        kv_heads=1,
        head_dim=8,
        ffn=40,
        vocab=37,
        experts=4,
        expert_ffn=12,
        moe_every=2,
    )


SHAPE_TABLES = {
    "dense_7b": dense_7b,
    "moe_30b_a3b": moe_30b_a3b,
    "moe_235b_a22b": moe_235b_a22b,
    "dense_70b": dense_70b,
    "tiny_moe": tiny_moe,
}
