"""Adapters: how `python -m muon_dist.harness.conformance` builds any Muon and what it claims to compute.

An adapter is a small class. It builds the candidate optimizer from parameters and hyperparameters, and it
states the claim the oracle checks:
    claim:   muon_ref.Muon(params, preset=adapter.preset, **adapter.overrides, **hyperparameters)
    contract (per case, per step s, per rank r): box_r(P_candidate_s) == box_r(P_reference_s) bit for bit,
             and the momentum buffer too where `momentum()` exposes it.
`distributed` says how the candidate sees its parameters: None (plain tensors, one process), "dtensor" (DTensor
Shard(0) on a 1-D gloo mesh, torch.chunk boxes as FSDP2 makes them), "replicated" (the same plain tensor and the
same reduced gradient on every rank: DDP style, after DDP's all-reduce) or "unreduced" (the same plain tensor on
every rank and each rank's own gradient: a candidate that owns the reduction, DDP or ZeRO-1/2 style, and must step
on the mean over ranks). `families` names the case families it supports (muon_dist/harness/adapters/cases.py);
`hyperparameters` the ones it accepts (the others keep its defaults, which the claim must match); `variants` the
option sets it is also checked under (each a dict of hyperparameters and muon_ref options that `build` receives and
maps to its own arguments, and that the claim takes over; `({},)`: the defaults only).

Write one (then `python -m muon_dist.harness.conformance --adapter mymodule:MyAdapter`):

    class MyAdapter(Adapter):
        name, preset, overrides = "my-muon", "moonlight", {"lr_scale": "spectral_norm"}
        def build(self, params, **hp):
            return my_package.Muon(params, **hp)

Or, without writing a class, for any optimizer class by import path (a local checkout included):
    ImportPath("path/to/dion_clone:dion.muon:Muon", preset="dion", hp_names={"momentum": "mu"})
    python -m muon_dist.harness.conformance --adapter path/to/dion_clone:dion.muon:Muon --preset dion
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


class ImportPath(Adapter):
    """Any optimizer class by import path: "[checkout_dir:]module:Class". The checkout dir (if given) goes on
    sys.path first; `hp_names` maps our hyperparameter names to the class's (None: it has no such argument);
    `kwargs` are passed as they are."""

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
        self.hp_names = {k: k for k in HYPERPARAMETERS} | dict(hp_names or {})
        self.hyperparameters = frozenset(k for k, v in self.hp_names.items() if v is not None)
        self.kwargs, self.distributed, self.state_key = dict(kwargs or {}), distributed, state_key
        default = {
            None: SINGLE_FAMILIES,
            "dtensor": SINGLE_FAMILIES | DIST_FAMILIES,
            "replicated": SINGLE_FAMILIES | REPLICATED_FAMILIES,
            "unreduced": SINGLE_FAMILIES | UNREDUCED_FAMILIES,
        }[distributed]
        self.families = families or default
        self.name = parts[-1]

    def _class(self) -> type:
        *root, module, cls = self.target.split(":")
        if root and root[0] not in sys.path:
            sys.path.insert(0, root[0])
        return getattr(import_module_as_python_m(module), cls)

    def version(self) -> str:
        from importlib.metadata import packages_distributions

        top = self._class().__module__.split(".")[0]
        dists = packages_distributions().get(top, [])
        return str(
            getattr(sys.modules[top], "__version__", None)
            or (package_version(dists[0]) if dists else "local")
        )

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        named = {self.hp_names[k]: v for k, v in hp.items() if self.hp_names.get(k)}
        return self._class()(params, **named, **self.kwargs)


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


__all__ = ["Adapter", "HYPERPARAMETERS", "ImportPath", "load_adapter", "package_version"]
