"""Elementwise stages (momentum, update) on a rank's box with the bits the reference gets on the whole tensor.

Reference equation, for an elementwise stage f, a tensor X of global_shape and any box b of it:
    run_stage(f, [X[b]], global_shape, b) == f(X)[b]        bitwise, for a reference f that runs on one thread
Why it needs care (docs/distributed.md, "Elementwise stages on shards", has the measurement): on CPU a bf16 op
can round an element differently in the vectorised body of its loop and in the scalar tail, so an element's
bits depend on where the call's tensor ends. Model (TensorIterator's vectorised loop, one thread): in a
contiguous call on N elements, element i runs the vector body iff i < C * floor(N / C), for a chunk C that
divides BLOCK. So with T0 = N - N % BLOCK:
  * an element with global flat index i < T0 is in the body in the reference; the stage runs on the local
    shard padded with zeros to a multiple of BLOCK, where every element is in the body (a contiguous shard of a
    multiple of BLOCK elements, none of them in the tail, needs no padding: the stage runs on it as it is);
  * an element with i >= T0 sits at j = i - T0 of a buffer of length N - T0; j is in the body of that
    buffer iff i is in the body of the reference (T0 is a multiple of C). At most BLOCK - 1 such elements.
Other elements' values never change an element's bits (the stage is elementwise), so padding is zeros
(proofs/paths.md, Lemma E). With more threads at::parallel_for cuts large tensors into per-thread ranges, each
with its own tail, so muon_ref's bf16 bits depend on torch.get_num_threads(); run_stage reproduces the
one-thread reference.

on_box runs a stage on a box of a param whose layout may hold separate blocks (each block a param of its own,
as muon_ref steps it); momentum_on_box and update_on_box are the step's two stages, and buffer_on_box the new
momentum buffer alone, which the step computes again when it writes rather than hold it through the exchange.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Sequence

import torch
from torch import Tensor

from muon_ref import MatrixLayout, MuonConfig
from muon_ref.functional import apply_update, momentum_buffer, momentum_direction

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


def on_box(
    stage: Callable[[MatrixLayout], Stage],
    inputs: Sequence[Tensor],
    matrices: MatrixLayout,
    global_shape: tuple[int, ...],
    box: Box,
) -> tuple[Tensor, ...]:
    """stage(matrices)(*inputs) on this rank's box with the reference's bits (run_stage): on the whole param for a
    shared layout; for a separate layout (split_sizes, num_heads) on each block's part of the box, as the
    block's own tensor (muon_ref steps each block as a param of its own: muon_ref.functional.map_blocks)."""
    if not matrices.separate:
        return run_stage(stage(matrices), inputs, global_shape, box)
    if (
        not box.numel
    ):  # nothing here: any block's stage on the empty inputs gives the empty outputs' dtypes
        return run_stage(stage(matrices.blocks[0].as_param()), inputs, global_shape, box)
    outs: list[Tensor] = []
    for block in matrices.blocks:
        part = box.intersect(block)
        if part is None:
            continue
        mine = part.within(box)
        results = run_stage(
            stage(block.as_param()),
            [x[mine.index].contiguous() for x in inputs],
            block.shape,
            part.within(block),
        )
        if not outs:
            outs = [torch.empty(box.shape, dtype=r.dtype, device=r.device) for r in results]
        for out, r in zip(outs, results):
            out[mine.index] = r
    return tuple(outs)


def momentum_on_box(
    cfg: MuonConfig,
    grad: Tensor,
    buf: Tensor,
    matrices: MatrixLayout,
    global_shape: tuple[int, ...],
    box: Box,
) -> tuple[Tensor, Tensor]:
    """(new buffer, direction) on the box: muon_ref.functional.momentum_direction's bits (on_box)."""
    new_buf, direction = on_box(
        lambda m: lambda g, b: momentum_direction(g, b, cfg),
        [grad, buf],
        matrices,
        global_shape,
        box,
    )
    return new_buf, direction


def buffer_on_box(
    cfg: MuonConfig,
    grad: Tensor,
    buf: Tensor,
    matrices: MatrixLayout,
    global_shape: tuple[int, ...],
    box: Box,
    in_place: bool = False,
) -> Tensor:
    """The new buffer alone on the box: muon_ref.functional.momentum_buffer's bits (on_box), which are
    momentum_on_box's first result's (the same ops on the same inputs). With in_place, written into buf itself
    by the op's out= form where that is bitwise (writes_in_place, and the new buffer has buf's dtype), and buf
    returned; else a new tensor."""
    if (
        in_place
        and grad.dtype == buf.dtype
        and writes_in_place(matrices, [grad, buf], global_shape, box, ())
    ):
        return momentum_buffer(grad, buf, cfg, out=buf)
    (new_buf,) = on_box(
        lambda m: lambda g, b: (momentum_buffer(g, b, cfg),),
        [grad, buf],
        matrices,
        global_shape,
        box,
    )
    return new_buf


def writes_in_place(
    matrices: MatrixLayout,
    inputs: Sequence[Tensor],
    global_shape: tuple[int, ...],
    box: Box,
    skipped_blocks: tuple[int, ...],
) -> bool:
    """Whether update_on_box may write a param (inputs: its local param and update) into its destination by
    apply_update's out= form, bitwise the fresh result (muon_ref.functional.apply_update): a shared layout, no
    skipped block, and a box on which run_stage runs the stage on the inputs as they are (runs_as_is)."""
    return not matrices.separate and not skipped_blocks and runs_as_is(inputs, global_shape, box)


def update_on_box(
    cfg: MuonConfig,
    param: Tensor,
    update: Tensor,
    matrices: MatrixLayout,
    global_shape: tuple[int, ...],
    box: Box,
    out: Tensor | None = None,
    skipped_blocks: tuple[int, ...] = (),
) -> Tensor:
    """The new param on the box: muon_ref.functional.apply_update's bits (on_box); the blocks in skipped_blocks
    keep param's bits. With `out`, the result is written there and returned: in place by apply_update's own ops
    where that is bitwise (writes_in_place), else computed without it (padding, tails, per-block calls, skipped
    blocks) and copied."""
    if out is not None and writes_in_place(
        matrices, [param, update], global_shape, box, skipped_blocks
    ):
        return apply_update(param, update.reshape(box.shape), matrices, cfg, out=out)
    (new,) = on_box(
        lambda m: lambda p, u: (apply_update(p, u, m, cfg),),
        [param, update],
        matrices,
        global_shape,
        box,
    )
    keep_blocks(new, param, matrices, box, skipped_blocks)
    return new if out is None else out.copy_(new)


def keep_blocks(
    new: Tensor, old: Tensor, matrices: MatrixLayout, box: Box, blocks: tuple[int, ...]
) -> None:
    """Exact copies of old's bits into new (both the box's tensors) on the given blocks' parts of the box: a
    skipped block keeps its param and momentum bits."""
    for b in blocks:
        if (part := box.intersect(matrices.blocks[b])) is not None:
            mine = part.within(box).index
            new[mine] = old[mine]
