"""Muon's update conventions as configuration: one frozen record per param group.

Every convention found in the field is a field here (docs/conventions.md), and each public
implementation is a preset (muon_ref/presets.py). Names follow fan_out / fan_in (a torch Linear weight is
(fan_out, fan_in)); the learning-rate shape scale is a formula, with each library's name mapped to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

from .newton_schulz import DEFAULT_EPS, EPS_MODES, STACKS, STEP_FORMS
from .schedules import Schedule, get_schedule

MomentumStyle = Literal["ema", "sum"]
NesterovForm = Literal["lerp", "add_alpha", "mul_add"]
WeightDecayForm = Literal["mul", "add_self"]
ScaleApply = Literal["alpha", "update", "update_lr", "update_lr_cast"]
UpdateLayout = Literal["kernel", "contiguous"]
UPDATE_LAYOUTS: tuple[str, ...] = ("kernel", "contiguous")

# The shape scale s(fan_out, fan_in), by formula. Names across libraries (conventions.md):
#   torch adjust_lr_fn "original" = "original"; "match_rms_adamw" = Dion/xtuner "rms_norm";
#   Dion/xtuner "spectral_norm" = Emerging "unit_rms_norm"; Emerging "spectral" = "spectral";
#   Emerging "shape_scaling" = "original".
LR_SCALE_ALIASES: dict[str, str] = {
    "original": "original",
    "shape_scaling": "original",
    "match_rms_adamw": "match_rms_adamw",
    "rms_norm": "match_rms_adamw",
    "spectral_norm": "spectral_norm",
    "unit_rms_norm": "spectral_norm",
    "spectral": "spectral",
    "none": "none",
}


def lr_scale(name: str, fan_out: int, fan_in: int, sqrt: str = "sqrt") -> float:
    """The shape scale, evaluated as each origin does it in Python floats.

    `sqrt` picks the square root's evaluation: "sqrt" (math.sqrt: torch, Moonlight, Dion, xtuner) or
    "pow" (x ** 0.5: KellerJordan, Emerging). They differ in the last bit for some ratios (e.g. 145 / 9; how
    often: docs/conventions.md, "What changes bits"), and the update inherits that bit.

    original:         sqrt(max(1, fan_out / fan_in))   torch "original" (math.sqrt(max(1, A / B)))
    match_rms_adamw:  0.2 * sqrt(max(fan_out, fan_in))  torch "match_rms_adamw", Dion/xtuner "rms_norm"
    spectral_norm:    sqrt(fan_out / fan_in)            Dion/xtuner "spectral_norm", Emerging "unit_rms_norm"
    spectral:         sqrt(max(fan_out, fan_in))        Emerging "spectral" (its default)
    none:             1
    """
    kind = LR_SCALE_ALIASES.get(name)
    if sqrt not in ("sqrt", "pow"):
        raise ValueError(f"sqrt must be 'sqrt' or 'pow', got {sqrt!r}")
    root = math.sqrt if sqrt == "sqrt" else (lambda x: x**0.5)
    if kind == "original":
        return root(max(1, fan_out / fan_in))
    if kind == "match_rms_adamw":
        return 0.2 * root(max(fan_out, fan_in))
    if kind == "spectral_norm":
        return root(fan_out / fan_in)
    if kind == "spectral":
        return root(max(fan_out, fan_in))
    if kind == "none":
        return 1.0
    raise ValueError(f"unknown lr_scale {name!r}; known: {sorted(LR_SCALE_ALIASES)}")


@dataclass(frozen=True)
class MuonConfig:
    """One param group's conventions. Equations (per matrix, G the gradient, M the momentum buffer):

    momentum_style "ema":  M <- lerp(M, G, 1 - mu);  nesterov: D = lerp(G, M, mu)  else D = M
                   "sum":  M <- M * mu + G;          nesterov: D = G.add(M, alpha=mu) ("add_alpha")
                                                                or (M * mu) + G       ("mul_add")
    weight decay   "mul":      P <- P * (1 - lr * wd)      (torch, Keller, Moonlight, Dion, xtuner)
                   "add_self": P <- P.add(P, alpha=-wd*lr) (Emerging)
    O = NS(D) per matrix; s = lr_scale(fan_out, fan_in) (times scale_factor, see apply_update)
    scale_apply    "alpha":     P <- P.add(O, alpha=-lr * s)           (torch, Moonlight)
                   "update":    P <- P.add(O * s, alpha=-lr)           (Keller; Emerging with update_dtype fp32)
                   "update_lr": P <- P - O * (lr * s)                  (Dion: out-of-place _foreach_mul)
                   "update_lr_cast": P <- P - O * cast(lr * s, O.dtype) (xtuner: in-place _foreach_mul_
                         on bf16 rounds the Python scalar to bf16 first; docs/conventions.md, "What changes bits")
    update_layout  "kernel":     O in the memory order Newton-Schulz returns it: for a single tall matrix the
                                 transposed view of its (fan_in, fan_out) iterate (torch/optim/_muon.py
                                 `_zeropower_via_newtonschulz` returns `ortho_grad.T`; every origin's kernel does)
                   "contiguous": O copied into row-major order first (muon_dist.DistributedMuon, whose update
                                 arrives in row shards)
                   Equal values; on CPU a bf16 op on P and O rounds differently for the two orders (scalar loop
                   for mixed strides, vectorised loop for equal ones), so the params' last bits follow the layout.
    ns_stack       "per_matrix": a stack's matrices (3-D experts, fused experts) each orthogonalised alone
                   "batched":    the stack as one batch, each product one batched product (KellerJordan's
                                 zeropower_via_newtonschulz5 on a 3-D param; newton_schulz's `stack`), O in the
                                 kernel's memory order under update_layout "kernel". Equal values; a batched
                                 product may round otherwise than single ones. muon_dist.DistributedMuon has
                                 "per_matrix" only (a matrix's bits never depend on where its stack lies).
    """

    lr: float | torch.Tensor = 1e-3  # a 1-element Tensor is used 0-d, as torch does (group_config)
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    momentum_style: MomentumStyle = "ema"
    nesterov_form: NesterovForm = "lerp"
    weight_decay_form: WeightDecayForm = "mul"
    lr_scale: str = "original"
    scale_sqrt: str = "sqrt"
    scale_factor: float = 1.0
    scale_apply: ScaleApply = "alpha"
    update_dtype: torch.dtype | None = None
    update_layout: UpdateLayout = "kernel"
    schedule: str | Schedule = "keller"
    ns_steps: int | None = None
    eps: float = DEFAULT_EPS
    ns_dtype: torch.dtype | None = torch.bfloat16
    step_form: str = "addmm"
    eps_mode: str = "clamp"
    safety: float | None = None
    normalize_before_cast: bool = False
    precondition: str | None = None
    ns_stack: str = "per_matrix"
    flatten: bool = False
    nonfinite: Literal["raise", "skip"] = "raise"

    def __post_init__(self) -> None:
        if isinstance(self.lr, torch.Tensor) and self.lr.numel() != 1:  # torch.optim's own message
            raise ValueError(f"Tensor lr must be 1-element, got lr of shape {tuple(self.lr.shape)}")
        _check(bool(self.lr >= 0), "lr", self.lr, ">= 0")
        _check(self.weight_decay >= 0, "weight_decay", self.weight_decay, ">= 0")
        _check(0 <= self.momentum, "momentum", self.momentum, ">= 0")
        _check(
            self.momentum_style in ("ema", "sum"),
            "momentum_style",
            self.momentum_style,
            "'ema' or 'sum'",
        )
        allowed = ("lerp",) if self.momentum_style == "ema" else ("add_alpha", "mul_add")
        _check(
            self.nesterov_form in allowed,
            "nesterov_form",
            self.nesterov_form,
            f"one of {allowed} for {self.momentum_style}",
        )
        _check(
            self.weight_decay_form in ("mul", "add_self"),
            "weight_decay_form",
            self.weight_decay_form,
            "'mul' or 'add_self'",
        )
        lr_scale(self.lr_scale, 1, 1, self.scale_sqrt)  # raises on an unknown name or sqrt
        applies = ("alpha", "update", "update_lr", "update_lr_cast")
        _check(self.scale_apply in applies, "scale_apply", self.scale_apply, f"one of {applies}")
        _check(
            self.update_layout in UPDATE_LAYOUTS,
            "update_layout",
            self.update_layout,
            f"one of {UPDATE_LAYOUTS}",
        )
        _check(self.step_form in STEP_FORMS, "step_form", self.step_form, f"one of {STEP_FORMS}")
        _check(self.eps_mode in EPS_MODES, "eps_mode", self.eps_mode, f"one of {EPS_MODES}")
        _check(self.ns_stack in STACKS, "ns_stack", self.ns_stack, f"one of {STACKS}")
        _check(self.eps >= 0, "eps", self.eps, ">= 0")
        _check(
            self.nonfinite in ("raise", "skip"), "nonfinite", self.nonfinite, "'raise' or 'skip'"
        )
        sched = get_schedule(self.schedule)
        sched.steps_for(self.ns_steps)  # raises when a fixed schedule gets another step count

    def ns_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of muon_ref.newton_schulz for this config (the kernel muon_dist runs too)."""
        return dict(
            schedule=self.schedule,
            steps=self.ns_steps,
            eps=self.eps,
            dtype=self.ns_dtype,
            step_form=self.step_form,
            eps_mode=self.eps_mode,
            safety=self.safety,
            normalize_before_cast=self.normalize_before_cast,
            precondition=self.precondition,
        )

    def replace(self, **changes: Any) -> "MuonConfig":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return MuonConfig(**values)


CONFIG_KEYS: tuple[str, ...] = tuple(f.name for f in fields(MuonConfig))


def _check(ok: bool, name: str, value: object, want: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {want}, got {value!r}")
