"""The shipped adapters: muon_ref itself (the known-good controls) and the public Muons installable here.

Each states its claim: the muon_ref preset (plus overrides) that should reproduce it bit for bit. The claims
are read from each package's source (versions pinned in pyproject.toml's dev extra).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from muon_dist import DistributedMuon

from . import Adapter, package_version
from .cases import DIST_FAMILIES, REPLICATED_FAMILIES, SINGLE_FAMILIES, UNREDUCED_FAMILIES
from .field import DionMuon, GramNewtonSchulzMuon, TorchtitanDistMuon, TorchtitanDistMuonOnCpu

_2D = frozenset({"tall", "wide", "square", "row", "primes", "tiny"})


def _groups(params: list[Tensor]) -> list[dict[str, Any]]:
    """One group per param; 4-D conv weights read as (out, -1) matrices (flatten=True)."""
    return [{"params": [p], "flatten": p.ndim >= 4} for p in params]


class Reference(Adapter):
    """muon_ref.Muon under the torch preset: conforms by construction (the control of the CLI's tests)."""

    name = "muon_ref.Muon"

    def version(self) -> str:
        return package_version("muon-ref")

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        import muon_ref

        return muon_ref.Muon(_groups(params), preset=self.preset, **self.overrides, **hp)


class DistributedReference(Reference):
    """muon_dist.DistributedMuon on DTensor shards: bitwise equal to muon_ref by its proofs (the control)."""

    name = "muon_dist.DistributedMuon"
    distributed = "dtensor"
    families = SINGLE_FAMILIES | DIST_FAMILIES
    overrides = {
        "update_layout": "contiguous"
    }  # the layout it implements (muon_dist/optim.py UPDATE_LAYOUT)

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        return DistributedMuon(_groups(params), preset=self.preset, **self.overrides, **hp)


class ReplicatedReference(Reference):
    """muon_dist.DistributedMuon on plain tensors, the same on every rank (its replicated path): the control of the
    replicated families."""

    name = "muon_dist.DistributedMuon (replicated)"
    distributed = "replicated"
    families = REPLICATED_FAMILIES
    overrides = {"update_layout": "contiguous"}

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        return DistributedMuon(_groups(params), preset=self.preset, **self.overrides, **hp)


class DdpReference(ReplicatedReference):
    """ReplicatedReference behind DDP's reduction: each rank's gradient is replaced by the mean over ranks before
    DistributedMuon steps (torch DDP's default hook divides by W, then all-reduces; here the sum comes first: the
    unreduced families' gradients make both exact). The control of the unreduced families."""

    name = "muon_dist.DistributedMuon (behind a DDP mean)"
    distributed = "unreduced"
    families = UNREDUCED_FAMILIES

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        return _MeanOfRanks(_groups(params), preset=self.preset, **self.overrides, **hp)


class _MeanOfRanks(DistributedMuon):
    """DistributedMuon whose step first replaces every gradient by the mean over ranks: all_reduce(SUM), then / W."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(dist.get_world_size())
        return super().step(closure)


class TorchMuon(Adapter):
    """torch.optim.Muon (installed torch): 2-D parameters only (its constructor refuses others); nesterov_off shows
    its in-place normalisation of a bf16 momentum buffer (field bug 11)."""

    name, preset, families = "torch.optim.Muon", "torch", _2D | {"nesterov_off"}

    def version(self) -> str:
        return torch.__version__

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        return torch.optim.Muon(params, **hp)


class KellerSingleDevice(Adapter):
    """KellerJordan's SingleDeviceMuon (PyPI muon-optimizer); its docstring claims conv weights (viewed 2-D)."""

    name, preset = "muon.SingleDeviceMuon", "keller"
    hyperparameters = frozenset({"lr", "weight_decay", "momentum"})  # Nesterov is always on

    def version(self) -> str:
        return package_version("muon-optimizer")

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        import muon

        return muon.SingleDeviceMuon(params, **hp)


class KellerDistributed(KellerSingleDevice):
    """KellerJordan's distributed Muon: replicated params; each rank updates params base_i + rank, then
    all_gather of each batch of W."""

    name, distributed = "muon.Muon", "replicated"
    families = SINGLE_FAMILIES | REPLICATED_FAMILIES

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        import muon

        return muon.Muon(params, **hp)


class MuonFsdp2(Adapter):
    """muon-fsdp2 (samsja; PyPI): gather to an owner, NS (keller coefficients, torch.compile'd loop), scatter.
    Default rms_scale=True: update *= 0.2 * sqrt(max(fan_out, fan_in)) in the grad's dtype, then
    P.mul_(1 - lr*wd); P.add_(update, alpha=-lr)."""

    name, preset, distributed = "muon_fsdp2.Muon", "keller", "dtensor"
    overrides = {"lr_scale": "match_rms_adamw", "scale_sqrt": "sqrt", "update_dtype": torch.float32}
    families = SINGLE_FAMILIES | DIST_FAMILIES

    def version(self) -> str:
        return package_version("muon-fsdp2")

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        import muon_fsdp2

        return muon_fsdp2.Muon([dict(params=params, use_muon=True, **hp)])


class Muonium(Adapter):
    """muonium (PyPI): sum momentum in fp32, Polar Express (modded coefficients, / (norm*1.02 + 1e-6)),
    P <- P - (lr * s) * u with s = sqrt(max(1, fo/fi)) stored as fp32 tensors; the whole update under
    torch.compile(dynamic=True). Weight decay is folded into u (u + wd*P, cautious by default) and is scaled
    by lr*s, which no muon_ref option expresses: the claim is checked at wd = 0. DTensors: full_tensor(),
    NS on every rank, redistribute."""

    name, preset, distributed = "muonium.Muon", None, "dtensor"
    overrides = {
        "momentum_style": "sum",
        "nesterov_form": "mul_add",
        "lr_scale": "original",
        "scale_apply": "update_lr",
        "update_dtype": torch.float32,
        "schedule": "polar_express_modded",
        "eps": 1e-6,
        "eps_mode": "add",
        "step_form": "dion",
        "weight_decay": 0.0,
    }
    families = SINGLE_FAMILIES | DIST_FAMILIES
    hyperparameters = frozenset({"lr", "momentum", "nesterov"})

    def version(self) -> str:
        return package_version("muonium")

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        import muonium

        return muonium.Muon([{"params": params, "flatten": params[0].ndim >= 4}], wd=0.0, **hp)


class MuoniumNoTriton(Muonium):
    """muonium with its NS routed to its own non-Triton loop (pe_loop): as shipped, zeropower() defaults to
    use_triton=True, whose Gram kernel asserts d_in.is_cuda, so no step runs on CPU. A patch, stated."""

    name = "muonium.Muon (pe_loop, no Triton)"

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        import muonium.orthogonalize.orthogonalize as orth

        if not getattr(orth, "_conformance_no_triton", False):
            original = orth._get_orthogonalization_fn
            orth._get_orthogonalization_fn = lambda strategy, use_triton: original(strategy, False)
            orth._conformance_no_triton = True
        return super().build(params, **hp)


SHIPPED: dict[str, type[Adapter]] = {
    "torch": TorchMuon,
    "keller": KellerSingleDevice,
    "keller-distributed": KellerDistributed,
    "muon-fsdp2": MuonFsdp2,
    "muonium": Muonium,
    "muonium-no-triton": MuoniumNoTriton,
    "torchtitan": TorchtitanDistMuon,
    "torchtitan-cpu": TorchtitanDistMuonOnCpu,
    "gram-newton-schulz": GramNewtonSchulzMuon,
}
# Dion is a checkout, not a package: in the set only when $MUON_DION_CHECKOUT names one (a clone may lack it)
if DionMuon.checkout_from_environment():
    SHIPPED["dion"] = DionMuon
