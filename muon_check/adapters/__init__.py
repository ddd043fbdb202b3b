"""Adapters: how `python -m muon_check` builds any Muon and what it claims to compute.

An adapter is a small class. It builds the candidate optimizer from parameters and hyperparameters, and it
states the claim the oracle checks:
    claim:   muon_ref.Muon(params, preset=adapter.preset, **adapter.overrides, **hyperparameters)
    contract (per case, per step s, per rank r): box_r(P_candidate_s) == box_r(P_reference_s) bit for bit,
             and the momentum buffer too where `momentum()` exposes it.
`distributed` says how the candidate sees its parameters: None (plain tensors, one process), "dtensor" (DTensor
Shard(0) on a 1-D gloo mesh, torch.chunk boxes as FSDP2 makes them), "replicated" (the same plain tensor and the
same reduced gradient on every rank: DDP style, after DDP's all-reduce) or "unreduced" (the same plain tensor on
every rank and each rank's own gradient: a candidate that owns the reduction, DDP or ZeRO-1/2 style, and must step
on the mean over ranks). `families` names the case families it supports (muon_check/adapters/cases.py);
`hyperparameters` the ones it accepts (the others keep its defaults, which the claim must match); `variants` the
option sets it is also checked under (each a dict of hyperparameters and muon_ref options that `build` receives and
maps to its own arguments, and that the claim takes over; `({},)`: the defaults only).

Write one (then `python -m muon_check --adapter mymodule:MyAdapter`):

    class MyAdapter(Adapter):
        name, preset, overrides = "my-muon", "moonlight", {"lr_scale": "spectral_norm"}
        def build(self, params, **hp):
            return my_package.Muon(params, **hp)

Or, without writing a class, for any optimizer class by import path (a local checkout included):
    ImportPath("path/to/dion_clone:dion.muon:Muon", preset="dion", hp_names={"momentum": "mu"})
    python -m muon_check --adapter path/to/dion_clone:dion.muon:Muon --preset dion
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import torch
from torch import Tensor

from .cases import DIST_FAMILIES, REPLICATED_FAMILIES, SINGLE_FAMILIES, UNREDUCED_FAMILIES

HYPERPARAMETERS = frozenset({"lr", "weight_decay", "momentum", "nesterov"})


class Adapter:
    """The protocol. Subclasses set the class attributes and implement `build` (and `momentum` when the
    optimizer keeps its buffer under another state key or shape)."""

    name: str = "adapter"
    preset: str | None = "torch"
    overrides: dict[str, Any] = {}
    distributed: str | None = None  # None | "dtensor" | "replicated" | "unreduced"
    families: frozenset[str] = SINGLE_FAMILIES
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    hyperparameters: frozenset[str] = HYPERPARAMETERS
    variants: tuple[dict[str, Any], ...] = ({},)
    state_key: str | None = "momentum_buffer"
    routing: str | None = (
        None  # the rule by which it sends params to another optimizer (routing.py), if it states one
    )

    def version(self) -> str:
        return "local"

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        raise NotImplementedError(
            f"adapter {self.name!r} must implement build(params, **hyperparameters)"
        )

    def momentum(self, opt: torch.optim.Optimizer, p: Tensor) -> Tensor | None:
        """The momentum buffer of p (None when this rank holds none), viewed as p's local shape."""
        buf = opt.state.get(p, {}).get(self.state_key) if self.state_key else None
        if buf is None:
            return None
        local = buf.to_local() if hasattr(buf, "to_local") else buf
        shape = p.to_local().shape if hasattr(p, "to_local") else p.shape
        return local.reshape(shape)

    def save_checkpoint(
        self, opt: torch.optim.Optimizer, module: torch.nn.Module, path: str
    ) -> None:
        """The checkpoint families' save, as the candidate's users save: by default torch.distributed.checkpoint of
        the params and of the optimizer state as torch.distributed.checkpoint.state_dict gives it (keys are
        parameter names, DTensor state stays sharded). A candidate that saves through its own engine overrides
        this and `load_checkpoint`."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        dcp.save(
            {"model": module.state_dict(), "optim": get_optimizer_state_dict(module, opt)},
            checkpoint_id=path,
        )

    def load_checkpoint(
        self, opt: torch.optim.Optimizer, module: torch.nn.Module, path: str
    ) -> None:
        """The resume: a fresh candidate on zero params loads `path` into `module`'s params and its state (by
        default the candidate's own state dict is the template, set_optimizer_state_dict installs it)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        state = {"model": module.state_dict(), "optim": get_optimizer_state_dict(module, opt)}
        dcp.load(state, checkpoint_id=path)
        module.load_state_dict(state["model"])
        set_optimizer_state_dict(module, opt, state["optim"])

    def describe(self) -> str:
        claim = ", ".join(f"{k}={v!r}" for k, v in self.overrides.items())
        return f"{self.name} {self.version()} (claims preset {self.preset!r}{', ' + claim if claim else ''})"


def package_version(dist_name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return "not installed"


def import_module_as_python_m(module: str) -> Any:
    """importlib.import_module with the current directory first on sys.path, as `python -m` puts it: the
    console scripts (muon-conformance, muon-verify) start without it, so an adapter module in the directory a
    user runs them from would not import otherwise."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)
    return importlib.import_module(module)


# Constructor keywords that other Muons use for the check's hyperparameters (ImportPath maps by signature, where
# exactly one of them is a keyword of the class): the field's spellings (pytorch_optimizer, timm, heavyball, keras,
# Dion's `mu`, Emerging's `weight_decay`)
SYNONYMS: dict[str, tuple[str, ...]] = {
    "lr": ("lr", "learning_rate"),
    "weight_decay": ("weight_decay", "wd", "decay"),
    "momentum": ("momentum", "mu", "beta", "beta1", "momentum_beta", "betas"),
    "nesterov": ("nesterov", "use_nesterov"),
}


def keyword_map(cls: type) -> tuple[dict[str, str | None], dict[str, Any]]:
    """(our hyperparameter -> the class's keyword or None, the class's defaults of the mapped keywords) by its
    signature: our own name where the class has it; else the keyword of SYNONYMS the class has when it has exactly
    one; our own name where it takes **kwargs and has none of them; None (not passed: the claim keeps its preset's
    value) otherwise."""
    import inspect

    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return {k: k for k in HYPERPARAMETERS}, {}
    varkw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    names: dict[str, str | None] = {}
    for ours, spellings in SYNONYMS.items():
        present = [n for n in spellings if n in params]
        if ours in params:  # its own name wins over a synonym
            names[ours] = ours
        else:
            names[ours] = (
                present[0] if len(present) == 1 else (ours if varkw and not present else None)
            )
    defaults = {
        n: params[n].default
        for n in names.values()
        if n in params and params[n].default is not inspect.Parameter.empty
    }
    return names, defaults


class ImportPath(Adapter):
    """Any optimizer class by import path: "[checkout_dir:]module:Class". The checkout dir (if given) goes on
    sys.path first; `hp_names` maps our hyperparameter names to the class's (None: it has no such argument; by
    default read from its signature, keyword_map); `kwargs` are passed as they are, and `group` keys go into the
    one param group it is given; `routing` is the rule by which it states it sends params elsewhere
    (muon_check/adapters/routing.py)."""

    def __init__(
        self,
        target: str,
        preset: str | None = "torch",
        overrides: dict[str, Any] | None = None,
        hp_names: dict[str, str | None] | None = None,
        kwargs: dict[str, Any] | None = None,
        distributed: str | None = None,
        families: frozenset[str] | None = None,
        state_key: str | None = "momentum_buffer",
        group: dict[str, Any] | None = None,
        routing: str | None = None,
    ) -> None:
        parts = target.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(
                f"adapter target {target!r} must be 'module:Class' or 'checkout_dir:module:Class'"
            )
        self.target, self.preset = target, preset
        # JSON cannot spell a dtype: "bfloat16" for update_dtype / ns_dtype means torch.bfloat16
        self.overrides = {
            k: getattr(torch, v) if k.endswith("_dtype") and isinstance(v, str) else v
            for k, v in (overrides or {}).items()
        }
        mapped, self.keyword_defaults = self._signature()
        self.hp_names = {**mapped, **dict(hp_names or {})}
        self.hyperparameters = frozenset(k for k, v in self.hp_names.items() if v is not None)
        self.kwargs, self.distributed, self.state_key = dict(kwargs or {}), distributed, state_key
        self.group, self.routing = dict(group or {}), routing
        default = {
            None: SINGLE_FAMILIES,
            "dtensor": SINGLE_FAMILIES | DIST_FAMILIES,
            "replicated": SINGLE_FAMILIES | REPLICATED_FAMILIES,
            "unreduced": SINGLE_FAMILIES | UNREDUCED_FAMILIES,
        }[distributed]
        self.families = families or default
        self.name = parts[-1]

    def _signature(self) -> tuple[dict[str, str | None], dict[str, Any]]:
        """keyword_map of the class, or our own names where it does not import here (the run says why)."""
        try:
            return keyword_map(self._class())
        except Exception:  # noqa: BLE001 - an import failure is reported by the run, with its error
            return {k: k for k in HYPERPARAMETERS}, {}

    def _class(self) -> type:
        *root, module, cls = self.target.split(":")
        if root and root[0] not in sys.path:
            sys.path.insert(0, root[0])
        return getattr(import_module_as_python_m(module), cls)

    def required_keywords(self) -> list[str]:
        """The class's constructor keywords without a default (besides params)."""
        import inspect

        try:
            params = inspect.signature(self._class()).parameters
        except (TypeError, ValueError, ImportError):
            return []
        return [
            n
            for n, p in params.items()
            if n != "params"
            and p.default is inspect.Parameter.empty
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        ]

    def version(self) -> str:
        from importlib.metadata import packages_distributions

        top = self._class().__module__.split(".")[0]
        dists = packages_distributions().get(top, [])
        return str(
            getattr(sys.modules[top], "__version__", None)
            or (package_version(dists[0]) if dists else "local")
        )

    def describe(self) -> str:
        renamed = {k: v for k, v in self.hp_names.items() if v != k}
        note = ", ".join(f"{k} as {v or 'not passed'}" for k, v in sorted(renamed.items()))
        return super().describe() + (f" [keywords: {note}]" if note else "")

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        named = {}
        for k, v in hp.items():
            keyword = self.hp_names.get(k)
            if keyword == "betas":  # (beta1, beta2): the momentum is beta1, beta2 keeps its default
                second = tuple(self.keyword_defaults.get("betas", (v, 0.999)))[1:]
                named["betas"] = (v, *second)
            elif keyword:
                named[keyword] = v
        given = [{"params": params, **self.group}] if self.group else params
        return self._class()(given, **named, **self.kwargs)


def load_adapter(spec: str, **import_path_options: Any) -> Adapter:
    """'module:Name' naming an Adapter subclass or instance, or an optimizer class (wrapped in ImportPath);
    'checkout_dir:module:Class' for a local checkout. ValueError naming the spec otherwise."""
    parts = spec.split(":")
    if len(parts) == 3:
        return ImportPath(spec, **import_path_options)
    if len(parts) != 2:
        raise ValueError(f"--adapter {spec!r}: expected MODULE:NAME or CHECKOUT_DIR:MODULE:CLASS")
    obj = getattr(import_module_as_python_m(parts[0]), parts[1], None)
    if obj is None:
        raise ValueError(f"--adapter {spec!r}: module {parts[0]!r} has no {parts[1]!r}")
    if isinstance(obj, Adapter):
        return obj
    if isinstance(obj, type) and issubclass(obj, Adapter):
        return obj()
    if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer):
        return ImportPath(spec, **import_path_options)
    raise ValueError(f"--adapter {spec!r} is neither an Adapter nor a torch.optim.Optimizer class")


__all__ = [
    "Adapter",
    "HYPERPARAMETERS",
    "ImportPath",
    "SYNONYMS",
    "keyword_map",
    "load_adapter",
    "package_version",
]
