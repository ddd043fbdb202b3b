"""FSDP-Canzona's Muon (liangyuwang/FSDP-Canzona, the FSDP port of Megatron-Canzona; arXiv 2602.06079), run from
a folder named by $MUON_CANZONA_CHECKOUT that holds its `matrix_based_optimizer` package. No Canzona code is copied
here: its modules are imported from that folder as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .cases import MATRIX_FAMILIES
from .systems import FromCheckout, LocalShardStep, import_without_package_inits

CANZONA_CHECKOUT_ENV = "MUON_CANZONA_CHECKOUT"
CANZONA_MUON_MODULE = "matrix_based_optimizer.optimizers.muon"


class CanzonaMuon(FromCheckout):
    """FSDP-Canzona's `Muon` (`matrix_based_optimizer/optimizers/muon.py` over `optimizers/base_optim.py` and
    `load_balanced_fsdp_executor.py`, liangyuwang/FSDP-Canzona at 13a920590750f2b614329be60fe38ba07e910358, with
    `split_grad_and_state.py` and `utils.py` at 426e8c50363cc3401e64eeb80c9e6e2451ea2ed4), from a folder holding the
    `matrix_based_optimizer` package ($MUON_CANZONA_CHECKOUT). Imported with its parent packages bare
    (`import_without_package_inits`: the package __init__ also imports its SOAP and plotting modules).

    Built as its README's FSDP contract and `scripts/canzona/example.py` build it: one group `{"params": the local
    shards, "use_muon": True, "is_fsdp_sharded": True, "fsdp_group": the mesh's process group,
    "fsdp_full_shapes", "fsdp_local_shapes", "fsdp_shard_dims": 0}`, `Muon(groups, lr, weight_decay, momentum,
    nesterov)` with its defaults (ns_steps 5, "simple" coefficients, ns_norm_eps 1e-7, fsdp_balance "global",
    fsdp_balance_cost "numel", fsdp_fused_comm True, fsdp_overlap "none"); one device: the plain params in one
    `use_muon` group. Keys set away from its defaults: none.

    The claim, read from muon.py: EMA momentum `buf.lerp_(grad, 1 - mu)` in the gradient's dtype, Nesterov
    `grad.lerp(buf, mu)` (193-198); NS `zeropower_via_newtonschulz5` (53-86): transposed when rows > cols,
    `F.normalize(G, dim=(-2, -1), eps=1e-7)` in the gradient's dtype, then bf16, Keller's coefficients in `addmm`
    form; `u * 0.2 * sqrt(max(A, B))` on the bf16 result (168-176, 201-202), cast to the gradient's dtype
    (base_optim.py:69); `p.mul_(1 - lr*wd)`, `p.add_(u, alpha=-lr)` (181-182): preset `torch` with lr_scale
    "match_rms_adamw", scale_apply "update" and normalize_before_cast.
    Layout: at W >= 2 each matrix's gradient boxes are gathered on one host rank (`all_to_all_single` with split
    sizes), which keeps the full-shape momentum and runs NS, and `torch.chunk` pieces of the update go back; hosts
    are assigned each step by cost over the params that have a gradient on that rank. Uniform shards only
    (load_balanced_fsdp_executor.py:141-148 raises on rows % W != 0): the families with rows % W == 0, or one
    device; 2-D params only. The momentum is compared where a rank's buffer has its box's shape (one device, W = 1);
    at W >= 2 it lives whole on the host rank and is not compared. The checkout is `checkout`, else
    $MUON_CANZONA_CHECKOUT."""

    name, preset, distributed = "FSDP-Canzona Muon", "torch", "dtensor"
    overrides = {
        "lr_scale": "match_rms_adamw",
        "scale_apply": "update",
        "normalize_before_cast": True,
    }
    families = (
        MATRIX_FAMILIES
        | {"micro_batches", "nesterov_off", "even", "remainder"}
        | {
            "accumulation",
            "asym_none",
        }
    )
    checkout_env = CANZONA_CHECKOUT_ENV

    def version(self) -> str:
        return f"liangyuwang/FSDP-Canzona, {super().version()}"

    def module(self) -> Any:
        root = self.root("matrix_based_optimizer/optimizers/muon.py")
        return import_without_package_inits(root, CANZONA_MUON_MODULE)

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        muon = self.module()
        shards, group = [], None
        for p in params:
            if hasattr(p, "to_local"):
                shard = torch.nn.Parameter(p.to_local(), requires_grad=True)
                group = p.device_mesh.get_group()
            else:
                shard = p
            shards.append(shard)
        if group is None:
            return muon.Muon([{"params": params, "use_muon": True}], **hp)
        inner = muon.Muon(
            [
                {
                    "params": shards,
                    "use_muon": True,
                    "is_fsdp_sharded": True,
                    "fsdp_group": group,
                    "fsdp_full_shapes": [torch.Size(p.shape) for p in params],
                    "fsdp_local_shapes": [torch.Size(s.shape) for s in shards],
                    "fsdp_shard_dims": [0] * len(shards),
                }
            ],
            **hp,
        )
        return LocalShardStep(inner, params, shards)

    def momentum(self, opt: torch.optim.Optimizer, p: Tensor) -> Tensor | None:
        inner, shard = opt, p
        if isinstance(opt, LocalShardStep):
            inner = opt.inner
            shard = next(s for q, s in zip(opt.params, opt.shards) if q is p)
        buf = inner.state.get(shard, {}).get("momentum_buffer")
        if buf is None or buf.numel() != shard.numel():
            return None  # the full-shape buffer on the host rank (W >= 2): not a box
        return buf.reshape(shard.shape)


__all__ = ["CANZONA_CHECKOUT_ENV", "CanzonaMuon"]
