"""The origins: each muon_ref preset against the implementation it names, through the conformance check.

    python -m muon_check --origins        (what `make verify` runs first)

torch      torch.optim.Muon of the installed torch (shipped.TorchMuon), fp32 params
keller     KellerJordan's SingleDeviceMuon, PyPI muon-optimizer 0.1.0 (shipped.KellerSingleDevice), 2-D and 3-D
moonlight, dion, xtuner, emerging: the op-for-op restatements of muon_check/restatements.py, as optimizers
Each claims its preset, with ns_stack="batched" where its origin runs a stack's products on the whole stack
(keller, dion, xtuner: their stack families); its variants switch what its origin exposes (Nesterov, the lr
scale, weight decay), and the families are those its origin supports (KellerJordan's conv4d crash is the shipped
adapter's row, not a preset check). The contract is the check's: every step's params and the final momentum bit
for bit.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from .. import restatements
from . import Adapter
from .cases import FUSED_FAMILIES, MATRIX_FAMILIES
from .shipped import KellerSingleDevice, TorchMuon

FP32 = (
    "float32",
)  # the presets' bitwise claims are for fp32 params (docs/conventions.md, "Noticed in the field")


class Restated(torch.optim.Optimizer):
    """A restated origin's step function `step(params, state, **kwargs)` as an optimizer; its state dict is the
    restatement's own (keyed by param)."""

    def __init__(self, params: list[Tensor], step: Callable[..., None], **kwargs: Any) -> None:
        super().__init__(params, {})
        self.origin_step, self.kwargs, self.origin_state = step, kwargs, {}

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        self.origin_step(self.param_groups[0]["params"], self.origin_state, **self.kwargs)


class RestatedAdapter(Adapter):
    """An adapter over a restatement: `names` maps the check's hyperparameter and option names to the step
    function's keywords, `values` maps option values to the function's spelling."""

    restates: Callable[..., None]
    names: dict[str, str] = {}
    values: dict[str, dict[Any, Any]] = {}
    dtypes = FP32

    def version(self) -> str:
        return "restated"

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        kwargs = {self.names[k]: self.values.get(k, {}).get(v, v) for k, v in hp.items()}
        return Restated(params, type(self).restates, **kwargs)

    def momentum(self, opt: torch.optim.Optimizer, p: Tensor) -> Tensor | None:
        buf = opt.origin_state.get(p, {}).get(self.state_key)
        return None if buf is None else buf.reshape(p.shape)


class Moonlight(RestatedAdapter):
    name, preset, families = "Moonlight examples/toy_train.py", "moonlight", MATRIX_FAMILIES
    restates = staticmethod(restatements.moonlight_step)
    names = {"lr": "lr", "weight_decay": "wd", "momentum": "momentum", "nesterov": "nesterov"}
    variants = ({}, {"nesterov": False})


DION_LR_SCALES = {
    "spectral_norm": "spectral_norm",
    "match_rms_adamw": "rms_norm",
}  # muon_ref name -> Dion's


class Dion(RestatedAdapter):
    name, preset, state_key = "microsoft/dion dion/muon.py", "dion", "momentum"
    families = MATRIX_FAMILIES | {"experts3d"}
    restates = staticmethod(restatements.dion_step)
    names = {
        "lr": "lr",
        "weight_decay": "weight_decay",
        "momentum": "mu",
        "nesterov": "nesterov",
        "lr_scale": "adjust_lr",
    }
    values = {"lr_scale": DION_LR_SCALES}
    variants = ({}, {"nesterov": False, "lr_scale": "match_rms_adamw"})
    overrides = {"ns_stack": "batched"}  # dion_ns runs a stack's products on the whole stack


class Xtuner(Dion):
    name = "InternLM/xtuner v1/optim/muon.py"
    preset, families = "xtuner", MATRIX_FAMILIES | FUSED_FAMILIES
    # xtuner_ns runs its experts' products on the [E, m, n] view at once
    overrides = {"ns_stack": "batched"}
    restates = staticmethod(restatements.xtuner_step)
    names = {**Dion.names, "num_experts": "num_experts"}
    variants = ({}, {"nesterov": False})


class Emerging(RestatedAdapter):
    name, preset, families = "NVIDIA-NeMo/Emerging-Optimizers muon.py", "emerging", MATRIX_FAMILIES
    restates = staticmethod(restatements.emerging_step)
    names = {
        "lr": "lr",
        "weight_decay": "weight_decay",
        "momentum": "momentum_beta",
        "nesterov": "use_nesterov",
    }
    variants = ({}, {"nesterov": False})


TORCH_ADJUST_LR = {
    "original": "original",
    "match_rms_adamw": "match_rms_adamw",
}  # muon_ref name -> torch's


class TorchOrigin(TorchMuon):
    """torch.optim.Muon under its two lr adjustments, with and without Nesterov."""

    families, dtypes = MATRIX_FAMILIES, FP32
    variants = ({}, {"nesterov": False, "lr_scale": "match_rms_adamw"})

    def build(
        self, params: list[Tensor], lr_scale: str = "original", **hp: Any
    ) -> torch.optim.Optimizer:
        return torch.optim.Muon(params, adjust_lr_fn=TORCH_ADJUST_LR[lr_scale], **hp)


class KellerOrigin(KellerSingleDevice):
    """SingleDeviceMuon on 2-D and 3-D params (its domain), with and without weight decay. Its
    zeropower_via_newtonschulz5 runs a 3-D param's products on the whole stack at once: ns_stack "batched"."""

    families, dtypes = MATRIX_FAMILIES | {"experts3d"}, FP32
    overrides = {"ns_stack": "batched"}
    variants = ({}, {"weight_decay": 0.0})


ORIGINS: dict[str, type[Adapter]] = {
    "torch": TorchOrigin,
    "keller": KellerOrigin,
    "moonlight": Moonlight,
    "dion": Dion,
    "xtuner": Xtuner,
    "emerging": Emerging,
}
