"""Orthogonalisation backends: a registry of kernels with one signature, each checked against muon_ref.

A backend is a frozen record (Backend) whose orthogonalize has the one signature every backend implements
(Orthogonalize: muon_ref.functional.orthogonalize's, declared here once) and meaning. Its contract is bitwise
(muon_ref's own kernel) or a tolerance, stated in its module's docstring with the command that measures it
(`python -m muon_dist.kernels.contracts`, muon_dist/kernels/README.md). BACKENDS maps a name to the function that
imports its module and returns its BACKEND, so an optional dependency (triton) is needed only by its backend;
register(name, load) adds one.

A backend with a stack kernel (Backend.stack: a stack [k, fan_out, fan_in] of matrices that share a shape and a
config) runs several calls at once: orthogonalize_many stacks the matrices of every call by shape and config, one
stack kernel call per stack, the way Dion's megabatches stack same-shape params. Its contract per matrix is the
backend's own: the stack kernel orthogonalises each matrix alone, whatever else the stack holds.

    torch    muon_dist.kernels.reference   muon_ref's newton_schulz (a stack batched where a runtime check shows
                                           it bitwise): bitwise
    triton   muon_dist.kernels.triton_ns   Triton GEMMs, autotuned tiles, one triangle of the symmetric products:
                                           a tolerance
    gram     muon_dist.kernels.gram_ns     Gram Newton-Schulz, batched torch ops: another algorithm, a tolerance
    batched  muon_dist.kernels.batched     muon_ref's Newton-Schulz, every stack batched (bmm): a tolerance

Each module's own Newton-Schulz function (newton_schulz_batched, newton_schulz_triton, gram_newton_schulz_batched)
takes muon_ref's kernel's keyword arguments (muon_ref.newton_schulz, muon_ref.gram_newton_schulz), less those it
refuses: muon_ref declares them, tests/test_kernels.py checks every mirror against it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from muon_ref import MatrixLayout, MuonConfig, map_blocks
from muon_ref.functional import read_block
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
    result (the paths then move it in that dtype); stack: None, or its kernel on a stack [k, fan_out, fan_in]
    under a config, each matrix of the result equal to what orthogonalize gives that matrix as a one-block param
    (bitwise, or within the same tolerance), whatever the other matrices of the stack are (orthogonalize_many);
    batches((fan_out, fan_in), input dtype, device, cfg): whether the stack kernel may run a stack of such
    matrices as one batch (else it loops over them, and stacking calls buys nothing: stacks() says no)."""

    name: str
    orthogonalize: Orthogonalize
    bitwise: bool
    reads_through_cast: bool = False
    stack: Callable[[Tensor, MuonConfig], Tensor] | None = None
    batches: Callable[[tuple[int, int], torch.dtype, torch.device, MuonConfig], bool] = (
        lambda matrix, dtype, device, cfg: True
    )


def _torch() -> Backend:
    from .reference import BACKEND

    return BACKEND


def _triton() -> Backend:
    from .triton_ns import BACKEND  # imports triton

    return BACKEND


def _gram() -> Backend:
    from .gram_ns import BACKEND

    return BACKEND


def _batched() -> Backend:
    from .batched import BACKEND

    return BACKEND


BACKENDS: dict[str, Callable[[], Backend]] = {
    "torch": _torch,
    "triton": _triton,
    "gram": _gram,
    "batched": _batched,
}


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


def with_kernels(
    backend: Backend, wrap: Callable[[Callable[..., Tensor]], Callable[..., Tensor]]
) -> Backend:
    """The backend with each of its kernels, orthogonalize and (where it has one) stack, replaced by wrap(kernel):
    what a tool that watches, counts or times every Newton-Schulz call must replace, since orthogonalize_many sends
    the calls it stacks to the stack kernel, never through orthogonalize. Each wrapped kernel is called with the
    kernel's own arguments: (direction, layout, cfg) for orthogonalize, (stack [k, fan_out, fan_in], cfg) for
    stack."""
    return dataclasses.replace(
        backend,
        orthogonalize=wrap(backend.orthogonalize),
        stack=None if backend.stack is None else wrap(backend.stack),
    )


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


def ns_key(cfg: MuonConfig) -> tuple:
    """What decides a config's Newton-Schulz: its newton_schulz arguments (configs with one key may share a
    stack)."""
    return tuple(sorted((name, repr(value)) for name, value in cfg.ns_kwargs().items()))


# A matrix with more elements than this is orthogonalised in its own call: stacking calls saves their per-call
# overhead (Python, dispatch, a launch), which matters for small matrices only, and a stack holds the workspace of
# all its matrices at once, plus a copy (docs/benchmarks.md, "The expert sets with calls stacked across params":
# 256 x 256 matrices ran no faster stacked and raised the dense set's peak).
STACK_MAX_ELEMENTS = 1 << 15


def stacks(
    backend: Backend,
    layout: MatrixLayout,
    dtype: torch.dtype,
    device: torch.device,
    cfg: MuonConfig,
) -> bool:
    """Whether a call on a direction of this layout, dtype and device should join a stack (orthogonalize_many):
    the backend has a stack kernel and batches every matrix of the layout, none over STACK_MAX_ELEMENTS."""
    if backend.stack is None:
        return False
    matrices = {(b.fan_out, b.fan_in) for b in layout.blocks}
    return all(
        m * n <= STACK_MAX_ELEMENTS and backend.batches((m, n), dtype, device, cfg)
        for m, n in matrices
    )


def orthogonalize_many(
    backend: Backend, calls: Sequence[tuple[Tensor, MatrixLayout, MuonConfig]]
) -> list[Tensor]:
    """[backend.orthogonalize(d, layout, cfg) for d, layout, cfg in calls], with the matrices of all calls stacked.

    Reference equation, for every call i:  orthogonalize_many(B, calls)[i] == B.orthogonalize(*calls[i])
    bitwise where B.stack meets its contract bitwise (Backend: each matrix alone, whatever the stack holds), within
    B's tolerance otherwise. A shared layout's blocks are its batch view [k, fan_out, fan_in]; a separate layout's
    blocks are one matrix each (read_block: a fresh contiguous copy, as map_blocks gives it). The matrices of all
    calls that share (fan_out, fan_in), the direction's dtype and device and the config's Newton-Schulz (ns_key)
    go through B.stack as one stack (torch.cat), in call order, and each call's part is read back: a shared
    layout's result is a view of its stack's output, a separate layout's is written block by block. A backend
    without a stack kernel, and an empty direction, take the one-call path.
    """
    if backend.stack is None:
        return [backend.orthogonalize(d, layout, cfg) for d, layout, cfg in calls]
    groups: dict[tuple, list[tuple[int, object, Tensor]]] = {}  # key -> (call, block, [k, m, n])
    results: list[Tensor | None] = [None] * len(calls)
    for i, (d, layout, cfg) in enumerate(calls):
        if not d.numel():
            results[i] = backend.orthogonalize(d, layout, cfg)
            continue
        pieces = (
            [(b, read_block(d, b).unsqueeze(0)) for b in layout.blocks]
            if layout.separate
            else [(None, d.reshape(layout.matrices_shape))]
        )
        for block, matrices in pieces:
            key = (tuple(matrices.shape[1:]), matrices.dtype, matrices.device, ns_key(cfg))
            groups.setdefault(key, []).append((i, block, matrices))
    for members in groups.values():
        cfg = calls[members[0][0]][2]
        whole = members[0][2] if len(members) == 1 else torch.cat([m for _, _, m in members])
        out = backend.stack(whole, cfg)
        for (i, block, matrices), part in zip(
            members, out.split([m.shape[0] for _, _, m in members])
        ):
            d, layout, _ = calls[i]
            if block is None:
                results[i] = part.reshape(d.shape)
                continue
            if results[i] is None:
                results[i] = torch.empty(layout.shape, dtype=part.dtype, device=part.device)
            results[i][block.index] = part.reshape(block.shape)
    return results  # type: ignore[return-value]  # every call's result is set above


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
