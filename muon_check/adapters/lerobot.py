"""LeRobot's DistributedMuon (huggingface/lerobot PR 4658, open, not released), run from a folder named by
$MUON_LEROBOT_CHECKOUT that holds `src/lerobot/optim/muon.py` as the PR proposes it. No LeRobot code is copied
here: the file is loaded alone (it imports torch only) and built as LeRobot's `lingbot_muon` optimizer config
builds it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from .cases import DIST_FAMILIES, SINGLE_FAMILIES
from .systems import FromCheckout, load_file_as

LEROBOT_CHECKOUT_ENV = "MUON_LEROBOT_CHECKOUT"
LEROBOT_MUON_PATH = "src/lerobot/optim/muon.py"
# `_DEFAULT_ADAMW_NAME_PATTERNS` of muon.py; the names this adapter gives its params ("params.<i>") match none
ADAMW_BETAS, ADAMW_EPS = (0.9, 0.95), 1e-8


class LerobotDistributedMuon(FromCheckout):
    """LeRobot's `DistributedMuon` (`src/lerobot/optim/muon.py` of huggingface/lerobot at commit
    85b2fd6ca41c5617118fdea0b654041651adbacc, the one stored version of that path, 755 lines where PR 4658
    "feat(optim): add DistributedMuon optimizer with FSDP2/3D-MoE support" states 586: a revision of the file on
    its way through PR 3967 and PR 4658, not confirmed as PR 4658's head), from a folder holding that file at
    that path ($MUON_LEROBOT_CHECKOUT). The file imports torch only; its NS constants and `_adjust_lr` come from
    `torch.optim._muon` (muon.py:37-45; torch 2.13: 3.4445, -4.775, 2.0315, 5 steps, eps 1e-7).

    Built as `LingbotMuonConfig.build` (`src/lerobot/optim/optimizers.py`, `@OptimizerConfig.register_subclass(
    "lingbot_muon")`, the config that builds it at that commit) builds it: params by name, a param whose ndim is
    not 2 or 3 or whose name holds "embed_tokens", "embedding", "lm_head" or "output_layer" goes to AdamW
    (betas (0.9, 0.95), eps 1e-8), the rest to one DistributedMuon group `{"params", "lr", "name": "other"}`
    (experts matching `layers.<N>.mlp.experts.` get a second group at `lr * expert_lr_scale`, 1.0 by default):
    `DistributedMuon(groups, lr, weight_decay, momentum, nesterov, ns_steps=5, adjust_lr_fn="match_rms_adamw")`,
    both inside its `CombinedOptimizer`. The check's hyperparameters are the config's fields of the same names.
    The builder refuses a model without a 2-D or 3-D param ("found no Muon-eligible (2D/3D) parameters"), so the
    one-param conv4d family is not run; the check's params are named `params.<i>` and all go to DistributedMuon.

    The claim, read from muon.py: EMA momentum `buf.lerp_(g, 1 - mu)`, Nesterov `g.lerp(buf, mu)` (396-400,
    502-506); NS `batched_newton_schulz` (96-141): bf16, transposed when rows > cols, `X / norm.clamp(min=eps)`,
    `addmm` steps (`baddbmm` on a stack), cast back to the param's dtype; `p.mul_(1 - lr*wd)` where wd != 0,
    `p.add_(O, alpha=-torch's _adjust_lr(lr, "match_rms_adamw", shape[-2:]))` (423-429, 565-569): preset `torch`
    with lr_scale "match_rms_adamw".
    Layout: a plain tensor, or a 3-D DTensor sharded on dim 0 only, is orthogonalised where it lies (expert stacks:
    each rank its own experts); the Shard(0) 2-D DTensors of one global shape and dtype are stacked, padded to
    ceil(rows / W) rows, all-gathered (`dist.all_gather`), unpadded by the rule "the first rows % W ranks hold
    ceil(rows / W) rows, the others floor(rows / W)" (536-545), orthogonalised as one batch, and each rank narrows
    its rows back at `rank * floor + min(rank, rows % W)` (553-557). The checkout is `checkout`, else
    $MUON_LEROBOT_CHECKOUT."""

    name, preset, distributed = "LeRobot DistributedMuon (PR 4658)", "torch", "dtensor"
    overrides = {"lr_scale": "match_rms_adamw"}
    families = (SINGLE_FAMILIES - {"conv4d"}) | DIST_FAMILIES
    routing = "ndim < 2 or ndim > 3"
    checkout_env = LEROBOT_CHECKOUT_ENV
    path = LEROBOT_MUON_PATH

    def version(self) -> str:
        return f"huggingface/lerobot {super().version()} ({self.path}; the file PR 4658 adds)"

    def module(self) -> Any:
        return load_file_as("lerobot_pr4658_muon", os.path.join(self.root(self.path), self.path))

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        muon = self.module()
        lr = hp.get("lr", 1e-5)
        weight_decay = hp.get("weight_decay", 0.0)
        named = {f"params.{i}": p for i, p in enumerate(params)}
        to_muon, to_adamw = [], []
        for name, p in named.items():
            lowered = name.lower()
            routed = p.ndim not in (2, 3) or any(
                pattern in lowered for pattern in muon._DEFAULT_ADAMW_NAME_PATTERNS
            )
            (to_adamw if routed else to_muon).append(p)
        inner: list[torch.optim.Optimizer] = [
            muon.DistributedMuon(
                [{"params": to_muon, "lr": lr, "name": "other"}],
                lr=lr,
                weight_decay=weight_decay,
                momentum=hp.get("momentum", 0.95),
                nesterov=hp.get("nesterov", True),
                ns_steps=5,
                adjust_lr_fn="match_rms_adamw",
            )
        ]
        if to_adamw:
            inner.append(
                torch.optim.AdamW(
                    [{"params": to_adamw, "lr": lr, "name": "other"}],
                    lr=lr,
                    betas=ADAMW_BETAS,
                    eps=ADAMW_EPS,
                    weight_decay=weight_decay,
                    fused=False,
                )
            )
        return muon.CombinedOptimizer(inner)


__all__ = ["LEROBOT_CHECKOUT_ENV", "LerobotDistributedMuon"]
