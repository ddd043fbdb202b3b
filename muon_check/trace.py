"""Newton-Schulz calls and collectives seen from below any optimizer (the setup audit's instrument).

A TorchDispatchMode sees every aten and c10d op a rank runs inside it, whatever the optimizer's code. Every
Newton-Schulz variant (standard, Gram, batched, distributed) starts from the Gram product of its input: X @ X^T or
X^T @ X, an mm / addmm / bmm / baddbmm whose two operands are one tensor and its transpose (same storage and data
pointer, the last two sizes and strides swapped). A call is told from its own later iterations by data flow:

    taint(t) = the call whose Gram product t derives from (an op's outputs take the first tainted input's call;
               out= buffers and the self of copy_, fill_, zero_ take their sources', not their old contents';
               a collective's written buffers none: they hold other ranks' data, whose calls are traced there)
    a Gram product of an untainted X starts a call: its X is that call's input (`Call.inputs`, one matrix per
    batch element); of a tainted X it is one more iteration of the call that X derives from
    a collective with a tainted input followed by another Gram product of the same call marks the call
    distributed (its Gram matrix or iterate is combined across ranks: tensor-parallel Newton-Schulz); one that
    only carries the call's result back to the param's holders does not

Taint is kept per byte range of a storage (a view covers its base's bytes between its first and last element;
writing a range replaces the taint of the ranges inside it) and cleared when the mode is entered. Only plain tensors are
read: a DTensor op is seen once, with its global shape, as `dtensor` (its local ops run below the mode); its output's
local tensor takes its inputs' taint as a plain op's would (else memory the allocator hands from a freed call's
buffer to a DTensor would keep that call's taint, and the next call read from it would be merged into it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
# op -> the positions of its two factors
_PRODUCTS = {
    aten.mm.default: (0, 1),
    aten.bmm.default: (0, 1),
    aten.addmm.default: (1, 2),
    aten.baddbmm.default: (1, 2),
}


@dataclass
class Call:
    """One Newton-Schulz call: its input matrices (float64 copies, in the orientation of the Gram product's first
    factor), how many Gram products it ran, and whether a collective read its data."""

    inputs: list[torch.Tensor]
    dtype: torch.dtype
    grams: int = 1
    collectives_at: list[int] = field(default_factory=list)

    @property
    def distributed(self) -> bool:
        """A collective read the call's data before its last Gram product (not only its result on the way
        back to the param's holders)."""
        return any(at < self.grams for at in self.collectives_at)


@dataclass
class Collective:
    name: str
    elements: int
    in_call: bool


@dataclass
class Trace(TorchDispatchMode):
    """Use as `with Trace() as t: train_step()`; then t.calls and t.collectives."""

    calls: list[Call] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)
    dtensor_grams: list[tuple[int, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()
        self._taint: dict[int, list[tuple[int, int, int]]] = {}

    def __enter__(self):
        self._taint = {}
        return super().__enter__()

    @staticmethod
    def _span(t: Any) -> tuple[int, int, int] | None:
        """(storage, first byte, end byte) of the memory a plain tensor covers (a DTensor's: its local tensor's,
        whose own ops run below the mode)."""
        t = getattr(t, "_local_tensor", t)
        if type(t) is not torch.Tensor or t.numel() == 0:
            return None
        extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
        start = t.storage_offset() * t.element_size()
        return t.untyped_storage().data_ptr(), start, start + extent * t.element_size()

    def _of(self, tensors: list[Any]) -> int | None:
        for t in tensors:
            span = self._span(t)
            if span is None:
                continue
            for a, b, call in self._taint.get(span[0], ()):
                if a < span[2] and span[1] < b:
                    return call
        return None

    def _mark(self, t: Any, call: int | None, fresh: bool) -> None:
        """t's bytes now derive from `call` (None: from no call); fresh: t is a new allocation (its storage's
        earlier ranges belong to freed memory)."""
        span = self._span(t)
        if span is None:
            return
        key, start, end = span
        earlier = () if fresh else self._taint.get(key, ())
        kept = [(a, b, c) for a, b, c in earlier if not (start <= a and b <= end)]
        if call is not None:
            kept.append((start, end, call))
        self._taint[key] = kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        base = func._schema.name.split("::")[-1]
        overwritten = _overwritten(func, args, kwargs, base)
        inputs = [
            t
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and not any(t is w for w in overwritten)
        ]
        written = _written(func, args, kwargs)
        if base in (
            "lift_fresh",
            "lift_fresh_copy",
        ):  # a tensor made outside the mode (torch.tensor(...)):
            out = func(*args, **kwargs)  # new memory, wherever freed memory was traced before
            self._mark(out, None, fresh=True)
            return out
        source = self._of(inputs)
        if _collective(func):
            self.collectives.append(
                Collective(str(func), sum(t.numel() for t in inputs), source is not None)
            )
            if source is not None:
                self.calls[source].collectives_at.append(self.calls[source].grams)
        product = _PRODUCTS.get(func)
        if product is not None:
            a, b = args[product[0]], args[product[1]]
            if _is_gram(a, b):
                if type(a) is not torch.Tensor:
                    self.dtensor_grams.append(tuple(a.shape))
                else:
                    own = self._of([a])
                    if own is None:
                        batch = a.detach().to(torch.float64).reshape(-1, *a.shape[-2:])
                        self.calls.append(Call([m.cpu().clone() for m in batch], a.dtype))
                        source = len(self.calls) - 1
                    else:
                        self.calls[own].grams += 1
                        source = own
        out = func(*args, **kwargs)
        aliases = any(r.alias_info is not None for r in func._schema.returns)
        for t in tree_flatten(out)[0]:
            self._mark(t, source, fresh=not aliases)
        for t in (
            written
        ):  # a collective's received data: from other ranks, whose calls are not traced here
            self._mark(t, None if _collective(func) else source, fresh=False)
        return out


def _collective(func: Any) -> bool:
    return func.namespace in ("c10d", "_c10d_functional")


def _overwritten(func: Any, args: tuple, kwargs: dict, base: str) -> list[Any]:
    """The written arguments whose old contents the op does not read: out= buffers, a collective's output
    buffers, and self for copy_, fill_ and zero_ (every other in-place op reads its self)."""
    out: list[Any] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        reads = arg.name == "self" and base not in ("copy_", "fill_", "zero_", "set_")
        if _collective(func):
            reads = "output" not in arg.name
        if not reads:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            out += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return out


def _written(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The tensors an op writes in place (its schema's mutable arguments), flattened."""
    out: list[Any] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return out


def _is_gram(a: Any, b: Any) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() < 2:
        return False
    if type(a) is not torch.Tensor:  # a DTensor: the same object's transpose
        return (
            tuple(a.shape[-2:]) == tuple(b.shape[-2:])[::-1]
            and a.shape[-1] != 1
            and (
                getattr(b, "_local_tensor", None) is not None
                and a._local_tensor.data_ptr() == b._local_tensor.data_ptr()
            )
        )
    if a.numel() == 0 or a.data_ptr() != b.data_ptr():
        return False
    return (
        tuple(a.shape[-2:]) == tuple(b.shape[-2:])[::-1]
        and tuple(a.stride()[-2:]) == tuple(b.stride()[-2:])[::-1]
        and (a.shape[-2] != a.shape[-1] or a.stride()[-1] != a.stride()[-2])
    )
