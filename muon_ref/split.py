"""Muon for hidden matrices, AdamW for everything else, in one optimizer object.

`split_params(model)` routes each named parameter: a matrix (ndim >= 2) goes to Muon unless its name
matches one of the AdamW patterns (embeddings, output heads, norms by default); 0-D and 1-D parameters go
to AdamW. `MuonWithAdamW(model)` builds one torch.optim.Optimizer over both: groups carry
`algorithm="muon"` (muon_ref.Muon's keys) or `algorithm="adamw"` (torch.optim.AdamW's keys). Its AdamW
step is torch's own functional Adam with decoupled weight decay, so it is torch.optim.AdamW(foreach=False)
bit for bit, and the state dict round-trips through save and load.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Iterable

import torch
from torch import Tensor, nn
from torch.optim.adam import adam as functional_adam

from .optim import Muon

DEFAULT_ADAMW_PATTERNS: tuple[str, ...] = ("*embed*", "*lm_head*", "*output*", "*head.*", "*norm*")
ADAMW_DEFAULTS: dict[str, Any] = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def split_params(
    named_params: nn.Module | Iterable[tuple[str, Tensor]],
    adamw_patterns: Iterable[str] = DEFAULT_ADAMW_PATTERNS,
) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]]]:
    """(muon, adamw): named parameters split by ndim and fnmatch name patterns (case-insensitive)."""
    items = named_params.named_parameters() if isinstance(named_params, nn.Module) else named_params
    patterns = [p.lower() for p in adamw_patterns]
    muon, adamw = [], []
    for name, p in items:
        if not p.requires_grad:
            continue
        to_adamw = p.ndim < 2 or any(fnmatch.fnmatchcase(name.lower(), pat) for pat in patterns)
        (adamw if to_adamw else muon).append((name, p))
    return muon, adamw


class MuonWithAdamW(Muon):
    """One optimizer: muon_ref.Muon on the "muon" groups, torch's AdamW on the "adamw" groups.

    MuonWithAdamW(model, preset="torch", adamw=dict(lr=3e-4), adamw_patterns=..., **muon_overrides)
    or MuonWithAdamW(param_groups) with an explicit `algorithm` key in each group.
    """

    def __init__(
        self,
        params: nn.Module | Iterable[Any],
        preset: str | None = "torch",
        *,
        adamw: dict[str, Any] | None = None,
        adamw_patterns: Iterable[str] = DEFAULT_ADAMW_PATTERNS,
        **overrides: Any,
    ) -> None:
        self._adamw_defaults = {**ADAMW_DEFAULTS, **(adamw or {})}
        if isinstance(params, nn.Module):
            muon_named, adamw_named = split_params(params, adamw_patterns)
            params = [
                {
                    "params": [p for _, p in muon_named],
                    "param_names": [n for n, _ in muon_named],
                    "algorithm": "muon",
                },
                {
                    "params": [p for _, p in adamw_named],
                    "param_names": [n for n, _ in adamw_named],
                    "algorithm": "adamw",
                },
            ]
            params = [g for g in params if g["params"]]
        super().__init__(params, preset, **overrides)

    extra_group_keys = ("algorithm",)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # this class's own state dicts only (AdamW groups have keys Muon does not know)
        torch.optim.Optimizer.load_state_dict(self, state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        algorithm = param_group.setdefault("algorithm", "muon")
        if algorithm == "muon":
            return super().add_param_group(param_group)
        if algorithm != "adamw":
            raise ValueError(f"algorithm must be 'muon' or 'adamw', got {algorithm!r}")
        for key, value in self._adamw_defaults.items():
            param_group.setdefault(key, value)
        torch.optim.Optimizer.add_param_group(self, param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon_groups = [g for g in self.param_groups if g["algorithm"] == "muon"]
        saved, self.param_groups = self.param_groups, muon_groups
        try:
            super().step()
        finally:
            self.param_groups = saved
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                self._adamw_group_step(group)
        return loss

    def _adamw_group_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:  # torch.optim.Adam._init_group's state, so state dicts interoperate
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        functional_adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=False,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
