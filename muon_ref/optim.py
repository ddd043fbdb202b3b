"""muon_ref.Muon: a thin torch.optim.Optimizer over the pure functional core
(muon_ref/functional.py).

The class owns validation and state; the math is muon_step. Param-group keys are MuonConfig's fields
plus the layout keys (muon_ref.functional.LAYOUT_DEFAULTS): `num_experts` (fused 2-D expert bundles
[E * m, n]), `split_sizes` or `num_heads` with `split_dim` (blocks of a 2-D param, each stepped as
its own param: fused q/k/v, per-head Muon). State per parameter: "momentum_buffer" only, one tensor
of the param's shape for every layout; nothing derived from shapes is stored, so a state dict loads
into any world size or shape-equivalent model.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from .config import CONFIG_KEYS, MuonConfig
from .functional import (
    LAYOUT_DEFAULTS,
    Block,
    MatrixLayout,
    check_gradient,
    is_finite,
    matrix_layout,
    muon_step,
    read_block,
)
from .presets import (
    TORCH_KEY_FIELDS,
    TORCH_KEYS,
    from_torch_keys,
    preset_defaults,
    resolve_group,
    split_arguments,
    sync_torch_keys,
)


def group_config(group: dict[str, Any]) -> MuonConfig:
    """The MuonConfig of a param group (validated). A Tensor lr of one element is used 0-d, as
    torch.optim's _to_scalar does, so that the step's arithmetic is torch.optim.Muon's."""
    values = {k: group[k] for k in CONFIG_KEYS}
    lr = values["lr"]
    if isinstance(lr, Tensor) and lr.dim() != 0 and lr.numel() == 1:
        values["lr"] = lr.reshape(())
    return MuonConfig(**values)


def follow_torch_keys(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> dict[str, Any]:
    """Keeps a group's torch keys and the fields they stand for together, and returns the group. A
    torch key edited since the group was added, loaded or last stepped sets its fields (torch's way
    to change a group: `group["adjust_lr_fn"] = ...`; a bad value is a ValueError naming it);
    otherwise the fields are authoritative (`group["lr_scale"] = ...`) and torch's keys are
    refreshed from them."""
    seen = optimizer.__dict__.setdefault("_torch_keys_seen", {})
    now = {k: group[k] for k in TORCH_KEYS if k in group}
    if not now:
        return group
    before = seen.get(id(group))
    if before is not None and now != before:
        group.update(from_torch_keys({k: v for k, v in now.items() if before.get(k) != v}))
    sync_torch_keys(group)
    seen[id(group)] = {k: group[k] for k in TORCH_KEYS if k in group}
    return group


def add_group_checked(
    optimizer: torch.optim.Optimizer, param_group: dict[str, Any]
) -> dict[str, Any]:
    """torch.optim.Optimizer.add_param_group with torch's keys translated, every key validated (an
    unknown key is an error, never ignored) and the group's torch keys refreshed; returns the new
    group."""
    if isinstance(param_group, dict):
        extra = getattr(
            optimizer, "extra_group_keys", ()
        )  # a subclass's own keys (MuonWithAdamW's algorithm)
        keys = {k: v for k, v in param_group.items() if k != "params" and k not in extra}
        param_group = {**param_group, **resolve_group(keys, "param group")}
    torch.optim.Optimizer.add_param_group(optimizer, param_group)
    group = optimizer.param_groups[-1]
    sync_torch_keys(group)
    group_config(
        follow_torch_keys(optimizer, group)
    )  # a bad per-group override fails here, naming it
    return group


def torch_state_dict_groups(state_dict: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """A state dict whose param groups carry every key Muon reads: a torch.optim.Muon checkpoint's
    groups (lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn) get
    the fields torch's keys stand for and the optimizer's defaults for the rest; where a group saved
    both a field and its torch key, the field is kept and the key refreshed from it. A key Muon does
    not apply is a ValueError naming it. Per-param state ("momentum_buffer") is the same in both and
    passes unchanged."""
    groups = []
    for i, saved in enumerate(state_dict["param_groups"]):
        # a field saved beside its torch key is authoritative (this class's own state dicts)
        keys = {k: v for k, v in saved.items() if TORCH_KEY_FIELDS.get(k) not in saved}
        group = resolve_group(keys, f"state dict param group {i}")
        groups.append({**{k: v for k, v in defaults.items() if k not in TORCH_KEYS}, **group})
        sync_torch_keys(groups[-1])
    return {**state_dict, "param_groups": groups}


def param_name(group: dict[str, Any], index: int) -> str:
    names = group.get("param_names")
    return names[index] if names else f"param {index} of its group"


class ParamError(ValueError, RuntimeError):
    """A param Muon cannot optimise. A ValueError (the caller's mistake) that is also the
    RuntimeError torch.optim.Muon raises for it at its first step, so code catching either keeps
    working."""


def check_param(p: Tensor, name: str) -> None:
    """ParamError naming the parameter for a tensor Muon cannot optimise, raised when its group is
    added (torch's wording kept). A complex param is accepted here and refused by check_step_param
    at the first step, where torch.optim.Muon refuses it (its OptimizerInfo's error inputs)."""
    if p.is_sparse:
        raise ParamError(
            f"Muon does not support sparse gradients: {name} of shape {tuple(p.shape)} is "
            f"sparse; Muon needs dense matrices"
        )
    if not p.is_floating_point() and not p.is_complex():
        raise ParamError(
            f"{name} of shape {tuple(p.shape)} has dtype {p.dtype}: Muon needs a real "
            f"floating dtype"
        )


def check_step_param(p: Tensor, name: str) -> None:
    """ParamError for a param with a gradient that Muon cannot step (before anything is written):
    a complex param, refused at the step as torch.optim.Muon refuses it ("Muon does not support
    complex parameters", a RuntimeError there)."""
    if p.is_complex():
        raise ParamError(
            f"Muon does not support complex parameters: {name} of shape {tuple(p.shape)} has "
            f"dtype {p.dtype}"
        )


def all_finite(grads: list[Tensor]) -> list[bool]:
    """Whether each gradient is finite, with one device-to-host copy for all of them (a per-param
    bool() would wait for the device once per param)."""
    if not grads:
        return []
    flags = [torch.isfinite(g).all() for g in grads]
    return torch.stack([f.to(flags[0].device) for f in flags]).tolist()


def skipped_blocks(grad: Tensor, layout: MatrixLayout) -> tuple[Block, ...]:
    """The blocks that the "skip" policy leaves unchanged for a non-finite gradient: every block of
    a shared layout (the whole param), and the blocks with a non-finite gradient of a separate one
    (each its own param)."""
    if not layout.separate:
        return layout.blocks
    return tuple(b for b in layout.blocks if not is_finite(read_block(grad, b)))


class Muon(torch.optim.Optimizer):
    """The reference Muon. `Muon(params, preset="torch" | "keller" | "moonlight" | "dion" | "xtuner"
    |
    "emerging", **overrides)`; any MuonConfig field or layout key (`num_experts`, `split_sizes`,
    `num_heads`,
    `split_dim`) may be overridden per group. A bad layout key raises ValueError naming the
    parameter and its
    shape when the group is added; a key Muon does not apply raises ValueError naming it.

    torch.optim.Muon's signature is accepted as is: `Muon(params, lr, weight_decay, momentum,
    nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn)` (positional or keyword, `lr` a float or
    a 1-element Tensor; `use_addmm` where torch has it), in constructor and param groups, translated
    by muon_ref.presets.resolve_group; preset "torch" keeps torch's keys in its groups, and
    torch.optim.Muon's state dicts load (torch_state_dict_groups). Intended differences from torch:
    docs/torch-dropin.md.

    Non-finite gradients: `nonfinite="raise"` (default) raises ValueError naming the parameter
    before any parameter or state is written; "skip" leaves that parameter and its momentum
    unchanged for the step (with split_sizes or num_heads, only its blocks whose gradient is
    non-finite, as separate params would be). Zero gradients give a zero orthogonalised update (only
    weight decay acts). Params whose grad is None are skipped.
    """

    extra_group_keys: tuple[str, ...] = ()  # group keys a subclass adds and reads itself

    def __init__(self, params: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        preset, overrides = split_arguments(args, kwargs)
        defaults = preset_defaults(preset, overrides)
        self.preset = preset
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = add_group_checked(self, param_group)
        for i, p in enumerate(group["params"]):
            name = param_name(group, i)
            check_param(p, name)
            self.layout_of(p, group, name)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads this class's state dicts and torch.optim.Muon's (torch_state_dict_groups)."""
        super().load_state_dict(torch_state_dict_groups(state_dict, self.defaults))
        for group in self.param_groups:
            follow_torch_keys(self, group)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "preset": self.preset}

    @staticmethod
    def layout_of(p: Tensor, group: dict[str, Any], name: str = "param") -> MatrixLayout:
        keys = {k: group.get(k, default) for k, default in LAYOUT_DEFAULTS.items()}
        return matrix_layout(p.shape, flatten=group["flatten"], name=name, **keys)

    def param_step(
        self, p: Tensor, grad: Tensor, buf: Tensor, cfg: MuonConfig, layout: MatrixLayout
    ) -> tuple[Tensor, Tensor]:
        """(P', M') of one param: muon_step (pure). The one place a subclass changes the math of a step
        (muon_check's oracle runs the elementwise stages per shard box here); validation, the
        non-finite policy and the state stay this class's."""
        return muon_step(p, grad, buf, cfg, layout)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found = []
        for group in self.param_groups:  # validate everything before writing anything
            cfg = group_config(follow_torch_keys(self, group))
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                name = param_name(group, i)
                check_step_param(p, name)
                check_gradient(p.grad, p, name)
                found.append((p, cfg, self.layout_of(p, group, name), name))
        work = []
        for (p, cfg, layout, name), finite in zip(found, all_finite([p.grad for p, *_ in found])):
            skipped = ()
            if not finite:
                if cfg.nonfinite == "raise":
                    raise ValueError(
                        f"{name} of shape {tuple(p.shape)} has a non-finite gradient (NaN or Inf)"
                    )
                skipped = skipped_blocks(p.grad, layout)
                if len(skipped) == len(layout.blocks):
                    continue
            work.append((p, cfg, layout, skipped))
        for p, cfg, layout, skipped in work:
            state = self.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            new_p, new_buf = self.param_step(p, p.grad, buf, cfg, layout)
            for b in skipped:  # exact copies: the skipped blocks keep their param and momentum bits
                new_p[b.index], new_buf[b.index] = p[b.index], buf[b.index]
            p.copy_(new_p)
            state["momentum_buffer"] = new_buf
        return loss
