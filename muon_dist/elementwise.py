"""Elementwise stages on a shard with the bits the reference gets on the whole tensor.

Measured on an x86 CPU with AVX-512 (torch 2.13, one thread): a bf16 `add(other, alpha=a)` gives different bits in
the vectorised body than in the scalar tail of the same kernel (the body rounds alpha to bf16, the tail does
not), so the same element changes bits with its position: 1,174 of 4,096 elements of a.add(b, alpha=0.95)
differed between a whole-tensor call and one-element calls. fp32 stages showed no such difference here.

Model (TensorIterator's vectorised loop, one thread): in a contiguous call on N elements, element i runs the
vector body iff i < C * floor(N / C), for a chunk C that divides BLOCK. So with T0 = N - N % BLOCK:
  * an element with global flat index i < T0 is in the body in the reference; we run the stage on the local
    shard padded with zeros to a multiple of BLOCK, where every element is in the body (a contiguous shard of a
    multiple of BLOCK elements, none of them in the tail, needs no padding: the stage runs on it as it is);
  * an element with i >= T0 sits at j = i - T0 of a buffer of length N - T0; j is in the body of that
    buffer iff i is in the body of the reference (T0 is a multiple of C). At most BLOCK - 1 such elements.
Other elements' values never change an element's bits (the stage is elementwise), so padding is zeros.

The model holds for a reference that runs on one thread: with more, at::parallel_for cuts tensors above its
grain size (32,768 elements) into per-thread ranges, each with its own tail, so muon_ref's bf16 bits depend
on torch.get_num_threads() (measured: 9 of 301,301 elements of a moonlight bf16 direction, 1 vs 2 threads).
run_stage reproduces the one-thread reference.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import torch
from torch import Tensor

from .geometry import Box

# A multiple of every vector chunk of at::vec on CPU (a 512-bit register holds 32 bf16 values; loops
# unroll by 2): the body/tail boundary of any of them is a multiple of 64.
BLOCK = 64

Stage = Callable[..., tuple[Tensor, ...]]


@functools.lru_cache(maxsize=4096)
def tail_positions(global_shape: tuple[int, ...], box: Box) -> tuple[Tensor, Tensor, int]:
    """(local flat indices, their positions in the tail buffer, the tail length) of the tail elements that lie in
    `box` (the shard's box of the whole tensor). Cached: a pure function of the geometry."""
    numel = math.prod(global_shape)
    start = numel - numel % BLOCK
    flat = torch.arange(start, numel)
    coords = (
        torch.stack(torch.unravel_index(flat, global_shape))
        if flat.numel()
        else torch.empty(len(global_shape), 0, dtype=torch.long)
    )
    offset = torch.tensor(box.offsets).unsqueeze(1)
    size = torch.tensor(box.shape).unsqueeze(1)
    inside = ((coords >= offset) & (coords < offset + size)).all(dim=0)
    local = coords[:, inside] - offset
    strides = torch.tensor([math.prod(box.shape[d + 1 :]) for d in range(len(box.shape))])
    return (local * strides.unsqueeze(1)).sum(dim=0), flat[inside] - start, numel - start


def _padded(x: Tensor, length: int) -> Tensor:
    out = x.new_zeros(length)
    out[: x.numel()] = x.reshape(-1)
    return out


def runs_as_is(inputs: Sequence[Tensor], global_shape: tuple[int, ...], box: Box) -> bool:
    """Whether run_stage runs the stage on these inputs as they are, without padding or a tail call: the box is
    the whole tensor (the reference's own call), or the shard is contiguous, a multiple of BLOCK elements and
    holds no tail element (every element in the body on both sides). Then stage(*inputs) has the reference's
    bits for every element, and so has any bitwise out= form of it."""
    if tuple(box.shape) == tuple(global_shape):
        return True
    local_idx, _, _ = tail_positions(tuple(global_shape), box)
    return (
        not local_idx.numel()
        and inputs[0].numel() % BLOCK == 0
        and all(x.is_contiguous() for x in inputs)
    )


def run_stage(
    stage: Stage, inputs: Sequence[Tensor], global_shape: tuple[int, ...], box: Box
) -> tuple[Tensor, ...]:
    """stage(*inputs) on the shard `box` of a tensor of `global_shape`, each element with the bits that
    stage(*full_inputs) gives it (see module doc). A box that is the whole tensor is the reference's own call
    (the same values, shape, strides and dtype): the stage runs on it as it is, without padding."""
    if tuple(box.shape) == tuple(global_shape):
        return tuple(stage(*inputs))
    if runs_as_is(inputs, global_shape, box):
        # all in the body on both sides and no padding to add: the padded call without its copies
        return tuple(y.reshape(box.shape) for y in stage(*(x.reshape(-1) for x in inputs)))
    numel = inputs[0].numel()
    local_idx, tail_pos, tail_len = tail_positions(tuple(global_shape), box)
    body = stage(*(_padded(x, math.ceil(numel / BLOCK) * BLOCK) for x in inputs))
    outs = [y[:numel].clone() for y in body]
    if local_idx.numel():
        tail_in = []
        for x in inputs:
            buf = x.new_zeros(tail_len)
            buf[tail_pos.to(x.device)] = x.reshape(-1)[local_idx.to(x.device)]
            tail_in.append(buf)
        for out, y in zip(outs, stage(*tail_in)):
            out[local_idx.to(out.device)] = y[tail_pos.to(out.device)]
    return tuple(out.reshape(box.shape) for out in outs)
