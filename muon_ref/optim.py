"""muon_ref.Muon: a thin torch.optim.Optimizer over the pure functional core (muon_ref/functional.py).

The class owns validation and state; the math is muon_step. Param-group keys are MuonConfig's fields plus
the layout keys (muon_ref.functional.LAYOUT_DEFAULTS): `num_experts` (fused 2-D expert bundles [E * m, n]),
`split_sizes` or `num_heads` with `split_dim` (blocks of a 2-D param, each stepped as its own param: fused
q/k/v, per-head Muon). State per parameter: "momentum_buffer" only, one tensor of the param's shape for every
layout; nothing derived from shapes is stored, so a state dict loads into any world size or shape-equivalent
model.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from .config import CONFIG_KEYS, MuonConfig
from .functional import (
    LAYOUT_DEFAULTS, Block, MatrixLayout, check_gradient, is_finite, matrix_layout, muon_step, read_block,
)
from .presets import preset_defaults


def group_config(group: dict[str, Any]) -> MuonConfig:
    """The MuonConfig of a param group (validated)."""
    return MuonConfig(**{k: group[k] for k in CONFIG_KEYS})


def param_name(group: dict[str, Any], index: int) -> str:
    names = group.get("param_names")
    return names[index] if names else f"param {index} of its group"


def check_param(p: Tensor, name: str) -> None:
    """ValueError naming the parameter for a tensor Muon cannot optimise."""
    if p.is_sparse:
        raise ValueError(f"{name} of shape {tuple(p.shape)} is sparse: Muon needs dense matrices")
    if p.is_complex() or not p.is_floating_point():
        raise ValueError(f"{name} of shape {tuple(p.shape)} has dtype {p.dtype}: Muon needs a real floating dtype")


def all_finite(grads: list[Tensor]) -> list[bool]:
    """Whether each gradient is finite, with one device-to-host copy for all of them (a per-param bool() would
    wait for the device once per param)."""
    if not grads:
        return []
    flags = [torch.isfinite(g).all() for g in grads]
    return torch.stack([f.to(flags[0].device) for f in flags]).tolist()


def skipped_blocks(grad: Tensor, layout: MatrixLayout) -> tuple[Block, ...]:
    """The blocks that the "skip" policy leaves unchanged for a non-finite gradient: every block of a shared
    layout (the whole param), and the blocks with a non-finite gradient of a separate one (each its own param)."""
    if not layout.separate:
        return layout.blocks
    return tuple(b for b in layout.blocks if not is_finite(read_block(grad, b)))


class Muon(torch.optim.Optimizer):
    """The reference Muon. `Muon(params, preset="torch" | "keller" | "moonlight" | "dion" | "xtuner" |
    "emerging", **overrides)`; any MuonConfig field or layout key (`num_experts`, `split_sizes`, `num_heads`,
    `split_dim`) may be overridden per group. A bad layout key raises ValueError naming the parameter and its
    shape when the group is added.

    Non-finite gradients: `nonfinite="raise"` (default) raises ValueError naming the parameter before any
    parameter or state is written; "skip" leaves that parameter and its momentum unchanged for the step (with
    split_sizes or num_heads, only its blocks whose gradient is non-finite, as separate params would be).
    Zero gradients give a zero orthogonalised update (only weight decay acts). Params whose grad is None
    are skipped.
    """

    def __init__(self, params: Iterable[Any], preset: str | None = "torch", **overrides: Any) -> None:
        defaults = preset_defaults(preset, overrides)
        self.preset = preset
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group_config(group)  # a bad per-group override fails here, naming the option
        for i, p in enumerate(group["params"]):
            name = param_name(group, i)
            check_param(p, name)
            self.layout_of(p, group, name)

    @staticmethod
    def layout_of(p: Tensor, group: dict[str, Any], name: str = "param") -> MatrixLayout:
        keys = {k: group.get(k, default) for k, default in LAYOUT_DEFAULTS.items()}
        return matrix_layout(p.shape, flatten=group["flatten"], name=name, **keys)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found = []
        for group in self.param_groups:  # validate everything before writing anything
            cfg = group_config(group)
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                name = param_name(group, i)
                check_gradient(p.grad, p, name)
                found.append((p, cfg, self.layout_of(p, group, name), name))
        work = []
        for (p, cfg, layout, name), finite in zip(found, all_finite([p.grad for p, *_ in found])):
            skipped = ()
            if not finite:
                if cfg.nonfinite == "raise":
                    raise ValueError(f"{name} of shape {tuple(p.shape)} has a non-finite gradient (NaN or Inf)")
                skipped = skipped_blocks(p.grad, layout)
                if len(skipped) == len(layout.blocks):
                    continue
            work.append((p, cfg, layout, skipped))
        for p, cfg, layout, skipped in work:
            state = self.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            new_p, new_buf = muon_step(p, p.grad, buf, cfg, layout)
            for b in skipped:  # exact copies: the skipped blocks keep their param and momentum bits
                new_p[b.index], new_buf[b.index] = p[b.index], buf[b.index]
            p.copy_(new_p)
            state["momentum_buffer"] = new_buf
        return loss
