"""Orthogonalisation backends: a registry of kernels with one signature, each checked against muon_ref.

A backend is a frozen record (Backend) whose orthogonalize has the one signature every backend implements
(Orthogonalize: muon_ref.functional.orthogonalize's, declared here once) and meaning. Its contract is bitwise
(muon_ref's own kernel) or a tolerance, stated in its module's docstring with the command that measures it
(`python -m muon_dist.kernels.contracts`, muon_dist/kernels/README.md). BACKENDS maps a name to the function that
imports its module and returns its BACKEND, so an optional dependency (triton) is needed only by its backend;
register(name, load) adds one.

    torch    muon_dist.kernels.reference   muon_ref's newton_schulz (a stack batched where a runtime check shows
                                           it bitwise): bitwise
    triton   muon_dist.kernels.triton_ns   Triton GEMMs, autotuned tiles, one triangle of the symmetric products:
                                           a tolerance
    gram     muon_dist.kernels.gram_ns     Gram Newton-Schulz, batched torch ops: another algorithm, a tolerance

Each module's own Newton-Schulz function (newton_schulz_batched, newton_schulz_triton, gram_newton_schulz_batched)
takes muon_ref's kernel's keyword arguments (muon_ref.newton_schulz, muon_ref.gram_newton_schulz), less those it
refuses: muon_ref declares them, tests/test_kernels.py checks every mirror against it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from muon_ref import MatrixLayout, MuonConfig, map_blocks
from muon_ref.newton_schulz import input_cast


class Orthogonalize(Protocol):
    """Every block of `direction` (laid out by `layout`) orthogonalised under `cfg`, as
    muon_ref.functional.orthogonalize(direction, layout, cfg) does: the one kernel signature of every backend."""

    def __call__(self, direction: Tensor, layout: MatrixLayout, cfg: MuonConfig) -> Tensor: ...


@dataclass(frozen=True)
class Backend:
    """name; orthogonalize (Orthogonalize); bitwise: whether it returns muon_ref's bits (else its module's
    docstring states the tolerance); reads_through_cast: whether it reads a direction only through muon_ref's
    input cast (muon_ref.newton_schulz.input_cast), so a direction cast to that dtype first gives the same
    result (the paths then move it in that dtype)."""

    name: str
    orthogonalize: Orthogonalize
    bitwise: bool
    reads_through_cast: bool = False


def _torch() -> Backend:
    from .reference import BACKEND

    return BACKEND


def _triton() -> Backend:
    from .triton_ns import BACKEND  # imports triton

    return BACKEND


def _gram() -> Backend:
    from .gram_ns import BACKEND

    return BACKEND


BACKENDS: dict[str, Callable[[], Backend]] = {"torch": _torch, "triton": _triton, "gram": _gram}


def register(name: str, load: Callable[[], Backend]) -> None:
    """Make the backend that load() returns (its name must be `name`) the backend called `name`."""
    BACKENDS[name] = load


def backend(name: str) -> Backend:
    """The backend called `name`; ValueError naming the known ones otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"ns_backend must be one of {tuple(BACKENDS)}, got {name!r}")
    found = BACKENDS[name]()
    assert found.name == name, (found.name, name)
    return found


def over_stacks(stack_kernel: Callable[[Tensor, MuonConfig], Tensor]) -> Orthogonalize:
    """An orthogonalize from a kernel of stacks [k, fan_out, fan_in]: a shared layout's blocks as one stack (its
    batch view), a separate layout's blocks one by one (each a stack of one, muon_ref's map_blocks)."""

    def orthogonalize(direction: Tensor, layout: MatrixLayout, cfg: MuonConfig) -> Tensor:
        if layout.separate:
            return map_blocks(
                lambda b, d: (stack_kernel(d.unsqueeze(0), cfg).squeeze(0),), layout, direction
            )[0]
        return stack_kernel(direction.reshape(layout.matrices_shape), cfg).reshape(direction.shape)

    return orthogonalize


def own_step_kwargs(cfg: MuonConfig, name: str) -> dict:
    """The config's newton_schulz arguments for a kernel with its own step (no step_form) and no preconditioner:
    ValueError naming the backend when the config asks for the AOL preconditioner."""
    kwargs = cfg.ns_kwargs()
    kwargs.pop("step_form")
    if kwargs.pop("precondition") not in (None, "none"):
        raise ValueError(f"ns_backend={name!r} does not support the AOL preconditioner")
    return kwargs


def direction_bytes(cfg: MuonConfig, param_dtype: torch.dtype) -> int:
    """Bytes of one direction element an owner must receive (the lower bound's b_direction): the kernel's input
    cast where muon_ref's kernel reads its input only through a narrower cast (muon_ref.newton_schulz.input_cast:
    the cast before the exchange gives the same bits), else the param's dtype."""
    sent = input_cast(param_dtype, cfg.ns_dtype, cfg.normalize_before_cast) or param_dtype
    return torch.empty((), dtype=sent).element_size()


def send_dtype(backend: Backend, cfg: MuonConfig, param_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a param's direction travels in when narrower than the param's: the backend's input cast where it
    reads only through it (muon_ref.newton_schulz.input_cast), else None (the param's dtype)."""
    if not backend.reads_through_cast:
        return None
    return input_cast(param_dtype, cfg.ns_dtype, cfg.normalize_before_cast)
