"""Presets: each public Muon as a MuonConfig, so muon_ref reproduces it bit for bit (checked against
each origin by `python -m muon_check --origins` and tests/test_presets.py).
"""

from __future__ import annotations

from typing import Any

import torch

from .config import CONFIG_KEYS, MuonConfig
from .functional import LAYOUT_DEFAULTS
from .schedules import SCHEDULES, Schedule, get_schedule

# What every preset sets unless it says otherwise: torch.optim.Muon's conventions (torch 2.13 torch/optim/_muon.py:
# defaults lr 1e-3, wd 0.1, momentum 0.95, nesterov, eps 1e-7; EMA momentum, Nesterov by lerp, decay by mul, the
# "original" scale with math.sqrt applied as add_'s alpha, Keller's coefficients in addmm form in bf16, the norm
# clamped at eps). Each preset below names only where its origin differs.
BASE: dict[str, Any] = dict(
    lr=1e-3,
    weight_decay=0.1,
    momentum=0.95,
    nesterov=True,
    momentum_style="ema",
    nesterov_form="lerp",
    weight_decay_form="mul",
    lr_scale="original",
    scale_sqrt="sqrt",
    scale_apply="alpha",
    schedule="keller",
    eps=1e-7,
    ns_dtype=torch.bfloat16,
    step_form="addmm",
    eps_mode="clamp",
)


def _preset(**differences: Any) -> dict[str, Any]:
    """BASE with the origin's differences."""
    return {**BASE, **differences}


PRESETS: dict[str, dict[str, Any]] = {
    # torch 2.13 torch/optim/_muon.py: the base, and `_zeropower_via_newtonschulz` returns `ortho_grad.T` for a
    # tall matrix (the update in the kernel's memory order)
    "torch": _preset(update_layout="kernel"),
    # KellerJordan/Muon muon.py (PyPI muon-optimizer 0.1.0): SingleDeviceMuon (lr 0.02, wd 0, momentum 0.95),
    # `max(1, A / B) ** 0.5` multiplied into the update, Keller's `b*A + c*A@A` form, `X / (norm + eps)`
    "keller": _preset(
        lr=0.02,
        weight_decay=0.0,
        scale_sqrt="pow",
        scale_apply="update",
        step_form="keller",
        eps_mode="add",
    ),
    # MoonshotAI/Moonlight examples/toy_train.py (lr 1e-3, wd 0.1, momentum 0.95, nesterov, 5 steps): sum
    # momentum, Nesterov `g + mu * buf`, 0.2 * sqrt(max(A, B)), Keller's form, `X / (norm + eps)`
    "moonlight": _preset(
        momentum_style="sum",
        nesterov_form="add_alpha",
        lr_scale="match_rms_adamw",
        step_form="keller",
        eps_mode="add",
    ),
    # microsoft/dion dion/muon.py at 0c205499 (lr 0.01, mu 0.95, wd 0.01, epsilon 1e-8, nesterov False,
    # adjust_lr "spectral_norm", zeropower_via_newtonschulz5 with the you5 list). Later Dion versions default
    # to Polar Express: schedule="polar_express_modded".
    "dion": _preset(
        lr=0.01,
        weight_decay=0.01,
        nesterov=False,
        momentum_style="sum",
        nesterov_form="mul_add",
        lr_scale="spectral_norm",
        scale_apply="update_lr",
        schedule="you5",
        eps=1e-8,
        step_form="dion",
        eps_mode="add",
    ),
    # InternLM/xtuner xtuner/v1/optim/muon.py at 004bc257 (lr 0.01, mu 0.95, wd 0.01, epsilon 1e-8,
    # nesterov False, adjust_lr "rms_norm", you5); per-expert fan_out = rows // num_experts
    "xtuner": _preset(
        lr=0.01,
        weight_decay=0.01,
        nesterov=False,
        momentum_style="sum",
        nesterov_form="mul_add",
        lr_scale="rms_norm",
        scale_apply="update_lr_cast",
        schedule="you5",
        eps=1e-8,
        step_form="dion",
        eps_mode="add",
    ),
    # NVIDIA-NeMo/Emerging-Optimizers orthogonalized_optimizers/muon.py + muon_utils.py (lr 3e-4,
    # momentum 0.95, wd 0.01 decoupled, nesterov False, "quintic" = you5, 5 steps, scale_mode "spectral",
    # fp32_matmul_prec "medium": F.normalize in fp32 with eps 1e-7, then bf16 steps, result back to fp32)
    "emerging": _preset(
        lr=3e-4,
        weight_decay=0.01,
        nesterov=False,
        weight_decay_form="add_self",
        lr_scale="spectral",
        scale_sqrt="pow",
        scale_apply="update",
        update_dtype=torch.float32,
        schedule="you5",
        normalize_before_cast=True,
    ),
}


def preset_defaults(preset: str | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """Group defaults: MuonConfig's, then the preset's, then the caller's overrides (validated;
    torch's keys translated by resolve_group), plus the layout keys (LAYOUT_DEFAULTS: num_experts,
    split_sizes, num_heads, split_dim; checked per param by matrix_layout when a group is added).
    Preset "torch" also keeps torch's keys (ns_coefficients, adjust_lr_fn) beside the fields they
    set, so that a state dict loads into torch.optim.Muon."""
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
    overrides = resolve_group(overrides, "Muon options")
    default = MuonConfig()  # one instance: its fields are the defaults
    values = {k: getattr(default, k) for k in CONFIG_KEYS}
    values.update(PRESETS.get(preset, {}) if preset else {})
    values.update({k: v for k, v in overrides.items() if k in CONFIG_KEYS})
    MuonConfig(**values)  # validate once, with a message naming the bad option
    if preset == "torch":
        values.update(to_torch_keys(values))
    values.update({k: overrides.get(k, default) for k, default in LAYOUT_DEFAULTS.items()})
    return values


def same_value(key: str, a: Any, b: Any) -> bool:
    """Whether two values of a group key mean the same (schedules by their coefficients)."""
    if key != "schedule":
        return a == b
    sa, sb = get_schedule(a), get_schedule(b)
    return (sa.coefficients, sa.policy == "fixed") == (sb.coefficients, sb.policy == "fixed")


def sync_torch_keys(group: dict[str, Any]) -> None:
    """Refresh torch's keys of a group that carries them from the fields they stand for (dropped
    where torch cannot express the group)."""
    if not any(k in group for k in TORCH_KEYS):
        return
    for key in TORCH_KEYS:
        group.pop(key, None)
    group.update(to_torch_keys(group))


# torch.optim.Muon's arguments after `params`, in its order (torch/optim/_muon.py, torch 2.13);
# `use_addmm` is in the versions whose Newton-Schulz also has a non-addmm loop (pytorch 098e03f9).
TORCH_ARGUMENTS: tuple[str, ...] = (
    "lr",
    "weight_decay",
    "momentum",
    "nesterov",
    "ns_coefficients",
    "eps",
    "ns_steps",
    "adjust_lr_fn",
    "use_addmm",
)
# torch's keys that are not MuonConfig fields: each is translated to the fields it sets
TORCH_KEYS: tuple[str, ...] = ("ns_coefficients", "adjust_lr_fn", "use_addmm")
TORCH_KEY_FIELDS: dict[str, str] = {
    "ns_coefficients": "schedule",
    "adjust_lr_fn": "lr_scale",
    "use_addmm": "step_form",
}
# torch/optim/_muon.py: None and "original" are the same scale; "spectral_unclamped" (sqrt(A / B),
# torch 2.14 and newer) is muon_ref's "spectral_norm"
TORCH_ADJUST_LR: dict[str | None, str] = {
    None: "original",
    "original": "original",
    "match_rms_adamw": "match_rms_adamw",
    "spectral_unclamped": "spectral_norm",
}
LR_SCALE_TO_TORCH: dict[str, str] = {
    "original": "original",
    "match_rms_adamw": "match_rms_adamw",
    "spectral_norm": "spectral_unclamped",
}
# keys that torch.optim itself (Optimizer, LR schedulers) writes into param groups
FRAMEWORK_KEYS: tuple[str, ...] = ("params", "param_names", "initial_lr")


def split_arguments(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[str | None, dict[str, Any]]:
    """(preset, overrides) of `Muon(params, *args, **kwargs)`: a first positional str or None is the
    preset (the repo's form, `Muon(ps, "keller")`); other positionals are torch's, in
    TORCH_ARGUMENTS order (`Muon(ps, 0.01)` is lr=0.01)."""
    preset = kwargs.pop("preset", "torch")
    if args and (args[0] is None or isinstance(args[0], str)):
        preset, args = args[0], args[1:]
    if len(args) > len(TORCH_ARGUMENTS):
        raise TypeError(
            f"Muon takes at most {len(TORCH_ARGUMENTS)} positional arguments after params "
            f"({', '.join(TORCH_ARGUMENTS)}), got {len(args)}"
        )
    for name, value in zip(TORCH_ARGUMENTS, args):
        if name in kwargs:
            raise TypeError(f"Muon got multiple values for argument {name!r}")
        kwargs[name] = value
    return preset, kwargs


def constant_schedule(ns_coefficients: Any) -> str | Schedule:
    """The schedule of torch's `ns_coefficients` (one (a, b, c) for every step): "keller" for
    torch's default, otherwise a one-triple Schedule."""
    if not isinstance(ns_coefficients, (tuple, list)) or len(ns_coefficients) != 3:
        raise ValueError(
            f"ns_coefficients must be a tuple of exactly 3 values (Coefficients must be a tuple "
            f"of exactly 3 values), got {ns_coefficients!r}"
        )
    triple = tuple(float(v) for v in ns_coefficients)
    if (triple,) == SCHEDULES["keller"].coefficients:
        return "keller"
    return Schedule(
        name=f"torch_ns_coefficients{triple}",
        coefficients=(triple,),
        source="torch.optim.Muon ns_coefficients",
        policy="cycle",
        default_steps=5,
    )


def from_torch_keys(keys: dict[str, Any]) -> dict[str, Any]:
    """The MuonConfig fields set by torch's keys among `keys` (validated as torch does)."""
    out: dict[str, Any] = {}
    if "ns_coefficients" in keys:
        out["schedule"] = constant_schedule(keys["ns_coefficients"])
    if "adjust_lr_fn" in keys:
        fn = keys["adjust_lr_fn"]
        if fn not in TORCH_ADJUST_LR:
            raise ValueError(
                f"Adjust learning rate function {fn} is not supported (adjust_lr_fn={fn!r}; "
                f"valid: None, 'original', 'match_rms_adamw', 'spectral_unclamped')"
            )
        out["lr_scale"] = TORCH_ADJUST_LR[fn]
    if "use_addmm" in keys:
        out["step_form"] = "addmm" if keys["use_addmm"] else "keller"
    return out


def to_torch_keys(values: dict[str, Any]) -> dict[str, Any]:
    """torch's keys for a group's MuonConfig fields, where torch can express them (a
    torch.optim.Muon loads a state dict carrying them); {} for a group torch cannot run."""
    sched = get_schedule(values["schedule"])
    if len(sched.coefficients) != 1 or values["lr_scale"] not in LR_SCALE_TO_TORCH:
        return {}
    keys = {
        "ns_coefficients": sched.coefficients[0],
        "adjust_lr_fn": LR_SCALE_TO_TORCH[values["lr_scale"]],
    }
    if values["ns_steps"] is None:  # torch needs the count; a one-triple schedule's default is it
        keys["ns_steps"] = sched.default_steps
    if values["step_form"] in ("addmm", "keller"):  # read only by the torch versions that have it
        keys["use_addmm"] = values["step_form"] == "addmm"
    return keys


def resolve_group(group: dict[str, Any], where: str) -> dict[str, Any]:
    """`group` with torch's keys translated into the MuonConfig fields they set; an explicit field
    that disagrees with a torch key is an error. Every key must be one that Muon applies: a
    MuonConfig field, a layout key, a torch key, or one of torch.optim's own keys."""
    known = set(CONFIG_KEYS) | set(LAYOUT_DEFAULTS) | set(TORCH_KEYS) | set(FRAMEWORK_KEYS)
    unknown = sorted(set(group) - known)
    if unknown:
        raise ValueError(
            f"{where}: unknown Muon options {unknown}; known: {sorted(CONFIG_KEYS)}, torch's "
            f"{list(TORCH_KEYS)} and layout keys {sorted(LAYOUT_DEFAULTS)}"
        )
    translated = {}
    for torch_key in TORCH_KEYS:
        for key, value in from_torch_keys(
            {k: v for k, v in group.items() if k == torch_key}
        ).items():
            if key in group and not same_value(key, group[key], value):
                raise ValueError(
                    f"{where}: {key}={group[key]!r} disagrees with torch's "
                    f"{torch_key}={group[torch_key]!r}, which means {key}={value!r}"
                )
            translated[key] = value
    return {**group, **translated}
