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

Position-free stages. Where a stage's bits do not depend on an element's place in the call at all, the shard is the
reference's call as far as each element is concerned, and the stage runs on it as it is (run_stage's `free`): no
padded copy, no tail call. position_free decides it at runtime, once per stage, config (its learning rate aside: a
scalar operand of the same ops), input dtypes, device and thread count: only for plain CPU tensors, only for a
stage whose every pointwise op computes in float32 or float64, outputs and intermediates alike (a bf16 op can
differ between body and tail on a few rare inputs, which no probe can rule out), and only where a probe finds every
probed element's bits equal in the whole call, in calls shifted against the vector blocks and in calls too short
for a vector body (probe_position_free). In float32 a body and a tail that differ run different formulas (a fused
multiply-add against a multiply and an add, a constant rounded to another precision), which shows on a large share
of Gaussian inputs; the probe also holds NaNs, infinities, signed zeros and subnormals. Contract: bitwise when
chosen (the probe's verdict); elsewhere the padded calls above. docs/distributed.md, "Elementwise stages on
shards", has the measurements.

on_box runs a stage on a box of a param whose layout may hold separate blocks (each block a param of its own,
as muon_ref steps it); momentum_on_box and update_on_box are the step's two stages, and buffer_on_box the new
momentum buffer alone, which the step computes again when it writes rather than hold it through the exchange.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import Callable, Sequence

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from muon_ref import MatrixLayout, MuonConfig
from muon_ref.functional import apply_update, momentum_buffer, momentum_direction

from .geometry import Box

# A multiple of every vector chunk of at::vec on CPU (a 512-bit register holds 32 bf16 values; loops
# unroll by 2): the body/tail boundary of any of them is a multiple of 64.
BLOCK = 64
# the write stage's and the momentum stage's slabs (write_slabs): at most about this many elements each, so that
# a stage's temporaries are a slab's (256 KiB of float32), not a whole large box's
SLAB_ELEMENTS = 1 << 16

Stage = Callable[..., tuple[Tensor, ...]]

# position_free: the dtypes a stage's outputs must all have; the probe's length (not a multiple of any vector
# chunk: its whole call has a tail), the shifts of its shifted calls, the starts of its short calls (BLOCK - 1
# elements each: no vector body), the special values it plants; at most POSITION_FREE_KEYS verdicts are kept
POSITION_FREE_DTYPES = (torch.float32, torch.float64)
PROBE_ELEMENTS = 64 * BLOCK + 45
PROBE_SHIFTS = (1, 7, 33, BLOCK - 1)
PROBE_SHORT_STARTS = (0, 5, 1000, PROBE_ELEMENTS - (BLOCK - 1))
PROBE_SPECIALS = (math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-40, -3e38)
POSITION_FREE_KEYS = 1024
_POSITION_FREE: dict[tuple, bool] = {}
_INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_PLAIN = (Tensor, torch.nn.Parameter)
# what keys a config's verdict: every field but the learning rate, a scalar operand of the same ops (a schedule
# changes it every step; the ops, and which of their code paths run, stay the same)
_KEY_FIELDS = tuple(f.name for f in dataclasses.fields(MuonConfig) if f.name != "lr")


def stage_key(cfg: MuonConfig) -> tuple:
    """What position_free's verdict for a stage under cfg depends on: cfg's fields but lr."""
    return tuple(getattr(cfg, name) for name in _KEY_FIELDS)


# stage_key -> an object standing for it (hashed by identity); id(cfg) -> (cfg, its token): a step's configs are
# new objects that the stages ask about many times, and hashing a config's fields each time would cost more than
# the padding saved. The caches change under _LOCK (ranks may be threads of one process: muon_dist.comm.ThreadComm)
_TOKENS: dict[tuple, object] = {}
_TOKEN_OF: dict[int, tuple[MuonConfig, object]] = {}
_LOCK = threading.Lock()


def _token(cfg: MuonConfig) -> object:
    hit = _TOKEN_OF.get(id(cfg))
    if hit is not None and hit[0] is cfg:
        return hit[1]
    key = stage_key(cfg)
    with _LOCK:
        if (
            len(_TOKENS) >= POSITION_FREE_KEYS
        ):  # the verdicts are keyed by tokens: they go with them
            _TOKENS.clear()
            _TOKEN_OF.clear()
            _POSITION_FREE.clear()
        token = _TOKENS.setdefault(key, object())
        if len(_TOKEN_OF) >= 256:
            del _TOKEN_OF[next(iter(_TOKEN_OF))]
        _TOKEN_OF[id(cfg)] = (cfg, token)
    return token


def _bits(t: Tensor) -> Tensor:
    """t's bit patterns as integers of its width (torch.equal calls -0.0 and +0.0 equal, and NaN unequal)."""
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def _same_bits(a: Tensor, b: Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


@functools.lru_cache(maxsize=64)
def probe_inputs(dtypes: tuple[torch.dtype, ...], device: torch.device) -> tuple[Tensor, ...]:
    """The probe's inputs: Gaussian (seed 0, drawn in float32) with PROBE_SPECIALS planted at a few places, each
    input's specials at other places than the others', cast to each dtype. Cached: never written."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for k, dtype in enumerate(dtypes):
        x = torch.randn(PROBE_ELEMENTS, generator=gen)
        for j, value in enumerate(PROBE_SPECIALS):
            for at in (3 + 11 * j + 5 * k, 2000 + 13 * j + 7 * k, PROBE_ELEMENTS - 1 - 3 * j - k):
                x[at] = value
        out.append(x.to(dtype).to(device))
    return tuple(out)


class _PointwiseDtypes(TorchDispatchMode):
    """Records the dtype of every floating output of every pointwise aten op run inside it (torch.Tag.pointwise:
    the arithmetic, not the casts, copies and views)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.Tag.pointwise in func.tags:
            for y in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(y, Tensor) and y.is_floating_point():
                    self.dtypes.add(y.dtype)
        return out


def probe_position_free(stage: Stage, dtypes: Sequence[torch.dtype], device: torch.device) -> bool:
    """Whether `stage`, on inputs of these dtypes, gives every probed element the same bits wherever it sits in a
    call: every pointwise op of its whole call on probe_inputs computes in POSITION_FREE_DTYPES (its outputs, and
    its intermediates: an fp32 update of a bf16 O scaled in bf16 first is not taken), and the whole call equals bit
    for bit calls on the same inputs shifted by PROBE_SHIFTS and short calls at PROBE_SHORT_STARTS."""
    xs = probe_inputs(tuple(dtypes), torch.device(device))
    with _PointwiseDtypes() as seen:
        whole = stage(*xs)
    if any(y.dtype not in POSITION_FREE_DTYPES for y in whole) or not seen.dtypes <= set(
        POSITION_FREE_DTYPES
    ):
        return False
    calls = [(s, PROBE_ELEMENTS) for s in PROBE_SHIFTS]
    calls += [(start, start + BLOCK - 1) for start in PROBE_SHORT_STARTS]
    for lo, hi in calls:
        part = stage(*(x[lo:hi] for x in xs))
        if not all(_same_bits(w[lo:hi], p) for w, p in zip(whole, part)):
            return False
    return True


def position_free(kind: str, cfg: MuonConfig, stage: Stage, inputs: Sequence[Tensor]) -> bool:
    """Whether `stage` (the stage `kind` under cfg) may run on a shard as it is: CPU inputs that are plain tensors
    (not a subclass: a fake or traced tensor has no bits to probe), and probe_position_free's verdict for their
    dtypes, cached per kind, stage_key(cfg), dtypes, device and thread count (module docstring, "Position-free
    stages")."""
    device = inputs[0].device
    if device.type != "cpu" or any(type(x) not in _PLAIN for x in inputs):
        return False
    dtypes = tuple(x.dtype for x in inputs)
    key = (kind, _token(cfg), dtypes, device, torch.get_num_threads())
    verdict = _POSITION_FREE.get(key)
    if verdict is None:
        verdict = probe_position_free(stage, dtypes, device)
        with _LOCK:
            if len(_POSITION_FREE) >= POSITION_FREE_KEYS:
                del _POSITION_FREE[next(iter(_POSITION_FREE))]
            _POSITION_FREE[key] = verdict
    return verdict


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


def runs_as_is(
    inputs: Sequence[Tensor], global_shape: tuple[int, ...], box: Box, free: bool = False
) -> bool:
    """Whether run_stage runs the stage on these inputs as they are, without padding or a tail call: the stage is
    position-free (`free`), the box is the whole tensor (the reference's own call), or the shard is contiguous, a
    multiple of BLOCK elements and holds no tail element (every element in the body on both sides). Then
    stage(*inputs) has the reference's bits for every element, and so has any bitwise out= form of it."""
    if free or tuple(box.shape) == tuple(global_shape):
        return True
    local_idx, _, _ = tail_positions(tuple(global_shape), box)
    return (
        not local_idx.numel()
        and inputs[0].numel() % BLOCK == 0
        and all(x.is_contiguous() for x in inputs)
    )


def run_stage(
    stage: Stage,
    inputs: Sequence[Tensor],
    global_shape: tuple[int, ...],
    box: Box,
    free: bool = False,
) -> tuple[Tensor, ...]:
    """stage(*inputs) on the shard `box` of a tensor of `global_shape`, each element with the bits that
    stage(*full_inputs) gives it (see module doc). A box that is the whole tensor is the reference's own call
    (the same values, shape, strides and dtype), and a position-free stage (`free`: position_free's verdict)
    gives an element its bits wherever it sits: either runs on the inputs as they are, without padding."""
    if free or tuple(box.shape) == tuple(global_shape):
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
    kind: tuple[str, MuonConfig] | None = None,
) -> tuple[Tensor, ...]:
    """stage(matrices)(*inputs) on this rank's box with the reference's bits (run_stage): on the whole param for a
    shared layout; for a separate layout (split_sizes, num_heads) on each block's part of the box, as the
    block's own tensor (muon_ref steps each block as a param of its own: muon_ref.functional.map_blocks).
    `kind`: the stage's name and config, for position_free (None: the stage is never taken as position-free)."""

    def run(fn: Stage, xs: Sequence[Tensor], shape: tuple[int, ...], part: Box):
        free = (
            kind is not None
            and part.numel > 0
            and not runs_as_is(xs, shape, part)
            and position_free(*kind, fn, xs)
        )
        return run_stage(fn, xs, shape, part, free)

    if not matrices.separate:
        return run(stage(matrices), inputs, global_shape, box)
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
        results = run(
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
        _momentum_stage(cfg),
        [grad, buf],
        matrices,
        global_shape,
        box,
        ("momentum_direction", cfg),
    )
    return new_buf, direction


def _momentum_stage(cfg: MuonConfig) -> Callable[[MatrixLayout], Stage]:
    """The stage (grad, buf) -> muon_ref.functional.momentum_direction's (new buffer, direction) under cfg."""
    return lambda m: lambda g, b: momentum_direction(g, b, cfg)


def _buffer_stage(cfg: MuonConfig) -> Callable[[MatrixLayout], Stage]:
    """The stage (grad, buf) -> (muon_ref.functional.momentum_buffer's new buffer,) under cfg."""
    return lambda m: lambda g, b: (momentum_buffer(g, b, cfg),)


def _update_stage(cfg: MuonConfig) -> Callable[[MatrixLayout], Stage]:
    """The stage (param, update) -> (muon_ref.functional.apply_update's new param,) under cfg, for layout m."""
    return lambda m: lambda p, u: (apply_update(p, u, m, cfg),)


def _shared_free(
    kind: tuple[str, MuonConfig],
    stage: Callable[[MatrixLayout], Stage],
    matrices: MatrixLayout,
    inputs: Sequence[Tensor],
    box: Box,
) -> bool:
    """position_free's verdict for a shared layout's stage on a non-empty box (False otherwise), as on_box asks."""
    return not matrices.separate and box.numel > 0 and position_free(*kind, stage(matrices), inputs)


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
    key = ("momentum_buffer", cfg)
    if (
        in_place
        and grad.dtype == buf.dtype
        and _writes_in_place(key, _buffer_stage(cfg), matrices, [grad, buf], global_shape, box, ())
    ):
        return momentum_buffer(grad, buf, cfg, out=buf)
    (new_buf,) = on_box(_buffer_stage(cfg), [grad, buf], matrices, global_shape, box, key)
    return new_buf


def writes_in_place(
    matrices: MatrixLayout,
    inputs: Sequence[Tensor],
    global_shape: tuple[int, ...],
    box: Box,
    skipped_blocks: tuple[int, ...],
    free: bool = False,
) -> bool:
    """Whether update_on_box may write a param (inputs: its local param and update) into its destination by
    apply_update's out= form, bitwise the fresh result (muon_ref.functional.apply_update): a shared layout, no
    skipped block, and a box on which run_stage runs the stage on the inputs as they are (runs_as_is; `free`:
    the stage is position-free there)."""
    return (
        not matrices.separate and not skipped_blocks and runs_as_is(inputs, global_shape, box, free)
    )


def _writes_in_place(
    kind: tuple[str, MuonConfig],
    stage: Callable[[MatrixLayout], Stage],
    matrices: MatrixLayout,
    inputs: Sequence[Tensor],
    global_shape: tuple[int, ...],
    box: Box,
    skipped_blocks: tuple[int, ...],
) -> bool:
    """writes_in_place, asking position_free only where the box alone does not allow it (with `free`,
    writes_in_place asks only for a shared layout and no skipped block, which _shared_free and the test here give)."""
    return writes_in_place(matrices, inputs, global_shape, box, skipped_blocks) or (
        not skipped_blocks and _shared_free(kind, stage, matrices, inputs, box)
    )


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
    key = ("apply_update", cfg)
    if out is not None and _writes_in_place(
        key, _update_stage(cfg), matrices, [param, update], global_shape, box, skipped_blocks
    ):
        return apply_update(param, update.reshape(box.shape), matrices, cfg, out=out)
    (new,) = on_box(_update_stage(cfg), [param, update], matrices, global_shape, box, key)
    keep_blocks(new, param, matrices, box, skipped_blocks)
    return new if out is None else out.copy_(new)


def write_slabs(box: Box, elements: int | None = None) -> list[Box]:
    """The box cut along its first dim into consecutive slabs that tile it, each of at most `elements` elements
    (SLAB_ELEMENTS when None), or of the fewest whole rows that make a multiple of BLOCK elements where that is
    more, and every slab but the last a multiple of BLOCK elements: so an element lies in the body or the tail of
    its slab's call as it does in the box's (runs_as_is), and each slab runs as is wherever the box does. The box
    itself where it is no larger, is empty or has no dims."""
    elements = SLAB_ELEMENTS if elements is None else elements
    if not box.shape or box.numel <= elements:
        return [box]
    row = math.prod(box.shape[1:])
    unit = BLOCK // math.gcd(BLOCK, row) if row else 1
    rows = max(unit, elements // max(row, 1) // unit * unit)
    if rows >= box.shape[0]:
        return [box]
    return [
        Box(
            (box.offsets[0] + r,) + tuple(box.offsets[1:]),
            (min(rows, box.shape[0] - r),) + tuple(box.shape[1:]),
        )
        for r in range(0, box.shape[0], rows)
    ]


def _in_slabs(
    box: Box, elements: int | None, tensors: Sequence[Tensor]
) -> list[tuple[Box, list[Tensor]]] | None:
    """(slab, each tensor's rows of it) for write_slabs(box, elements), the tensors given on the box (contiguous,
    each of the box's elements in row-major order); None where there is only one slab or a tensor is not
    contiguous (the caller then runs on the box as it is)."""
    slabs = write_slabs(box, elements)
    if len(slabs) == 1 or not all(t.is_contiguous() for t in tensors):
        return None
    tensors = [t.view(box.shape) for t in tensors]
    out = []
    for slab in slabs:
        first = slab.offsets[0] - box.offsets[0]
        out.append((slab, [t[first : first + slab.shape[0]] for t in tensors]))
    return out


def update_in_slabs(
    cfg: MuonConfig,
    param: Tensor,
    update: Tensor,
    matrices: MatrixLayout,
    global_shape: tuple[int, ...],
    box: Box,
    out: Tensor,
    skipped_blocks: tuple[int, ...] = (),
    elements: int | None = None,
) -> Tensor:
    """update_on_box(..., out=out) run on each of write_slabs(box, elements) in turn, written into out's slab;
    `out` returned. The same bits as one call on the box: update_on_box's contract holds on every box, a slab too.
    What it saves is memory: the stage's temporaries are one slab's, not the box's (on CPU an op whose inputs have
    different dtypes copies the narrower one to the common dtype first, as TensorIterator promotes inputs: a bf16
    update added to a float32 param is a float32 copy of the whole update otherwise)."""
    slabs = _in_slabs(box, elements, [param, update, out])
    if slabs is None:
        return update_on_box(cfg, param, update, matrices, global_shape, box, out, skipped_blocks)
    for slab, (p, u, o) in slabs:
        update_on_box(cfg, p, u, matrices, global_shape, slab, o, skipped_blocks)
    return out


def direction_in_slabs(
    cfg: MuonConfig,
    grad: Tensor,
    buf: Tensor,
    matrices: MatrixLayout,
    global_shape: tuple[int, ...],
    box: Box,
    out: Tensor,
    elements: int | None = None,
) -> Tensor:
    """momentum_on_box's direction written into `out` (a tensor of the box's shape, in any dtype: copy_ casts as
    .to does) one slab of write_slabs(box, elements) at a time; `out` returned. The same bits as the direction of
    one call on the box, cast: momentum_on_box's contract holds on every box, and the cast is elementwise with
    each element in the body or the tail of its call as it is in the box's (every slab but the last a multiple of
    BLOCK elements). The new buffer and the float32 direction exist for one slab at a time, not for the box."""
    slabs = _in_slabs(box, elements, [grad, buf, out])
    if slabs is None:
        return out.copy_(momentum_on_box(cfg, grad, buf, matrices, global_shape, box)[1])
    for slab, (g, b, o) in slabs:
        o.copy_(momentum_on_box(cfg, g, b, matrices, global_shape, slab)[1])
    return out


def keep_blocks(
    new: Tensor, old: Tensor, matrices: MatrixLayout, box: Box, blocks: tuple[int, ...]
) -> None:
    """Exact copies of old's bits into new (both the box's tensors) on the given blocks' parts of the box: a
    skipped block keeps its param and momentum bits."""
    for b in blocks:
        if (part := box.intersect(matrices.blocks[b])) is not None:
            mine = part.within(box).index
            new[mine] = old[mine]


def measure(cases: int, seed: int = 0) -> int:
    """For every preset and param dtype (float32, float64, bfloat16): position_free's verdict for the step's three
    stages, and over `cases` random matrices cut by rows into two shards, the elements whose bits differ between the
    whole call and the unpadded call on a shard. Prints a row each; returns how many (preset, dtype, stage) the
    probe took as position-free yet differed somewhere (0 is the contract)."""
    import random

    from muon_ref.functional import matrix_layout
    from muon_ref.optim import group_config
    from muon_ref.presets import PRESETS, preset_defaults

    violations = 0
    print(
        f"{'preset':<12} {'dtype':<9} {'free (momentum, buffer, update)':<32} {'elements':>9} differing"
    )
    for preset in sorted(PRESETS):
        cfg = group_config(preset_defaults(preset, {}))
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            rng = random.Random(seed)
            update_dtype = cfg.ns_dtype or dtype
            stages = {
                "momentum_direction": _momentum_stage(cfg),
                "momentum_buffer": _buffer_stage(cfg),
                "apply_update": _update_stage(cfg),
            }
            dtypes = {
                "momentum_direction": (dtype, dtype),
                "momentum_buffer": (dtype, dtype),
                "apply_update": (dtype, update_dtype),
            }
            free = {
                kind: position_free(
                    kind,
                    cfg,
                    stage(matrix_layout((8, 8))),
                    [torch.zeros(1, dtype=d) for d in dtypes[kind]],
                )
                for kind, stage in stages.items()
            }
            differing, elements = dict.fromkeys(stages, 0), 0
            for case in range(cases):
                shape = (rng.randint(2, 300), rng.randint(1, 300))
                cut = rng.randint(1, shape[0] - 1)
                gen = torch.Generator().manual_seed(seed * 100003 + case)
                for kind, stage in stages.items():
                    fn = stage(matrix_layout(shape))
                    xs = [torch.randn(shape, generator=gen).to(d) for d in dtypes[kind]]
                    whole = fn(*xs)
                    for rows in (slice(0, cut), slice(cut, shape[0])):
                        for w, p in zip(whole, fn(*(x[rows].contiguous() for x in xs))):
                            differing[kind] += int((_bits(w[rows]) != _bits(p)).sum())
                elements += shape[0] * shape[1]
            violations += sum(1 for kind in stages if free[kind] and differing[kind])
            verdicts = ", ".join(str(free[kind]) for kind in stages)
            counts = ", ".join(str(differing[kind]) for kind in stages)
            print(
                f"{preset:<12} {str(dtype).split('.')[1]:<9} {verdicts:<32} {elements:>9} {counts}"
            )
    return violations
