"""Presets: each public Muon as a MuonConfig, so muon_ref reproduces it bit for bit (checked against each origin by
`python -m muon_dist.harness.conformance --origins` and tests/test_presets.py).
"""

from __future__ import annotations

from typing import Any

import torch

from .config import CONFIG_KEYS, MuonConfig
from .functional import LAYOUT_DEFAULTS

PRESETS: dict[str, dict[str, Any]] = {
    # torch 2.13 torch/optim/_muon.py: Muon defaults (lr 1e-3, wd 0.1, momentum 0.95, nesterov, eps 1e-7)
    "torch": dict(
        lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, momentum_style="ema", nesterov_form="lerp",
        weight_decay_form="mul", lr_scale="original", scale_sqrt="sqrt", scale_apply="alpha",
        schedule="keller", eps=1e-7, ns_dtype=torch.bfloat16, step_form="addmm", eps_mode="clamp",
    ),
    # KellerJordan/Muon muon.py (PyPI muon-optimizer 0.1.0): SingleDeviceMuon (lr 0.02, wd 0, momentum 0.95)
    "keller": dict(
        lr=0.02, weight_decay=0.0, momentum=0.95, nesterov=True, momentum_style="ema", nesterov_form="lerp",
        weight_decay_form="mul", lr_scale="original", scale_sqrt="pow", scale_apply="update",
        schedule="keller", eps=1e-7, ns_dtype=torch.bfloat16, step_form="keller", eps_mode="add",
    ),
    # MoonshotAI/Moonlight examples/toy_train.py (lr 1e-3, wd 0.1, momentum 0.95, nesterov, 5 steps)
    "moonlight": dict(
        lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, momentum_style="sum", nesterov_form="add_alpha",
        weight_decay_form="mul", lr_scale="match_rms_adamw", scale_sqrt="sqrt", scale_apply="alpha",
        schedule="keller", eps=1e-7, ns_dtype=torch.bfloat16, step_form="keller", eps_mode="add",
    ),
    # microsoft/dion dion/muon.py at 0c205499 (lr 0.01, mu 0.95, wd 0.01, epsilon 1e-8, nesterov False,
    # adjust_lr "spectral_norm", zeropower_via_newtonschulz5 with the you5 list). Later Dion versions default
    # to Polar Express: schedule="polar_express_modded".
    "dion": dict(
        lr=0.01, weight_decay=0.01, momentum=0.95, nesterov=False, momentum_style="sum", nesterov_form="mul_add",
        weight_decay_form="mul", lr_scale="spectral_norm", scale_sqrt="sqrt", scale_apply="update_lr",
        schedule="you5", eps=1e-8, ns_dtype=torch.bfloat16, step_form="dion", eps_mode="add",
    ),
    # InternLM/xtuner xtuner/v1/optim/muon.py at 004bc257 (lr 0.01, mu 0.95, wd 0.01, epsilon 1e-8,
    # nesterov False, adjust_lr "rms_norm", you5); per-expert fan_out = rows // num_experts
    "xtuner": dict(
        lr=0.01, weight_decay=0.01, momentum=0.95, nesterov=False, momentum_style="sum", nesterov_form="mul_add",
        weight_decay_form="mul", lr_scale="rms_norm", scale_sqrt="sqrt", scale_apply="update_lr_cast",
        schedule="you5", eps=1e-8, ns_dtype=torch.bfloat16, step_form="dion", eps_mode="add",
    ),
    # NVIDIA-NeMo/Emerging-Optimizers orthogonalized_optimizers/muon.py + muon_utils.py (lr 3e-4,
    # momentum 0.95, wd 0.01 decoupled, nesterov False, "quintic" = you5, 5 steps, scale_mode "spectral",
    # fp32_matmul_prec "medium": F.normalize in fp32 with eps 1e-7, then bf16 steps, result back to fp32)
    "emerging": dict(
        lr=3e-4, weight_decay=0.01, momentum=0.95, nesterov=False, momentum_style="ema", nesterov_form="lerp",
        weight_decay_form="add_self", lr_scale="spectral", scale_sqrt="pow", scale_apply="update",
        update_dtype=torch.float32, schedule="you5", eps=1e-7, ns_dtype=torch.bfloat16,
        step_form="addmm", eps_mode="clamp", normalize_before_cast=True,
    ),
}


def preset_defaults(preset: str | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """Group defaults: MuonConfig's, then the preset's, then the caller's overrides (validated), plus the
    layout keys (LAYOUT_DEFAULTS: num_experts, split_sizes, num_heads, split_dim; checked per param by
    matrix_layout when a group is added)."""
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
    unknown = set(overrides) - set(CONFIG_KEYS) - set(LAYOUT_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown Muon options {sorted(unknown)}; known: {sorted(CONFIG_KEYS)} and layout keys "
                         f"{sorted(LAYOUT_DEFAULTS)}")
    values = {k: getattr(MuonConfig(), k) for k in CONFIG_KEYS}
    values.update(PRESETS.get(preset, {}) if preset else {})
    values.update({k: v for k, v in overrides.items() if k not in LAYOUT_DEFAULTS})
    MuonConfig(**values)  # validate once, with a message naming the bad option
    values.update({k: overrides.get(k, default) for k, default in LAYOUT_DEFAULTS.items()})
    return values
