"""Muon's update as pure functions: they return new tensors and never write their inputs.

One step on a parameter P with gradient G and momentum buffer M (MuonConfig gives every convention):
    M', D = momentum_direction(G, M)          elementwise
    O     = orthogonalize(D)                  Newton-Schulz on each block (matrix) of the parameter's layout
    P'    = apply_update(P, O)                elementwise, with the shape scale of one matrix
That is a shared layout (plain matrices, experts, flatten). A separate layout (split_sizes, num_heads) steps
each block as its own parameter: the three stages run on each block as its own contiguous tensor, and the
results are written back (map_blocks; proofs/blocks.md#separate).
The elementwise stages commute with any sharding of P, G and M; only `orthogonalize` needs whole matrices.
muon_dist relies on exactly this split (proofs/paths.md): it runs the two elementwise stages on local shards
and the same `newton_schulz` kernel on reassembled global matrices.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from .config import MuonConfig, lr_scale
from .newton_schulz import newton_schulz

# The param-group keys that describe a parameter's layout (not an update convention), with their defaults
# (muon_ref.Muon passes them to matrix_layout); split_dim 0 is the only dim of Dion's split_sizes/num_heads.
LAYOUT_DEFAULTS: dict[str, Any] = {
    "num_experts": None,
    "split_sizes": None,
    "num_heads": None,
    "split_dim": 0,
}


@dataclass(frozen=True)
class Block:
    """One independent matrix of a parameter: a box of the param's global index space, read as a matrix.

    The box is offsets[d] <= i_d < offsets[d] + shape[d] along every tensor dim d, and the matrix is its
    elements in row-major order:  read_block(t, block) == t[block.index].reshape(fan_out, fan_in).
    Invariants: len(offsets) == len(shape) >= 2; offsets >= 0; sizes >= 1; prod(shape) == fan_out * fan_in.
    """

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    fan_out: int
    fan_in: int

    def __post_init__(self) -> None:
        assert len(self.offsets) == len(self.shape) >= 2, self
        assert min(self.offsets) >= 0 and min(self.shape) >= 1, self
        assert math.prod(self.shape) == self.fan_out * self.fan_in, self

    @property
    def index(self) -> tuple[slice, ...]:
        """The box as one slice per tensor dim: t[block.index] is the block's box of t."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.shape))

    def as_param(self) -> MatrixLayout:
        """The layout of this block given as its own 2-D param of shape (fan_out, fan_in)."""
        return matrix_layout((self.fan_out, self.fan_in))


@dataclass(frozen=True)
class MatrixLayout:
    """How a parameter is read as independent matrices (its blocks), and how those are stepped.

    blocks: every independent matrix, as a Block of the param's index space. They tile the param (disjoint,
    covering: proofs/blocks.md#tiling), as consecutive slabs along one dim:
        2-D (fo, fi)                              1 block   (0, 0) + (fo, fi)
        2-D fused experts (E*m, n), num_experts=E E blocks  (e*m, 0) + (m, n)
        3-D (E, m, n)                             E blocks  (e, 0, 0) + (1, m, n), read as (m, n)
        ndim >= 3 with flatten=True               1 block   (0, ..., 0) + shape, read as (shape[0], prod(rest))
        2-D, split_sizes (s_1..s_k), split_dim=0  k blocks  (o_j, 0) + (s_j, fi), o_j = s_1 + ... + s_(j-1)
        2-D, num_heads=H, split_dim=0             H blocks  (h*d, 0) + (d, fi), d = fo / H
        2-D, num_heads=H, split_dim=1             H blocks  (0, h*d) + (fo, d), d = fi / H
    separate=False (shared): momentum, weight decay and the update run on the whole param, Newton-Schulz on
        each block, with one shape scale (every block is (fan_out, fan_in)): experts, as xtuner and Dion do.
    separate=True: each block is stepped as its own param, on its own contiguous tensor (map_blocks): its own
        momentum, decay, Newton-Schulz and shape scale. split_sizes and num_heads.
    num_matrices, fan_out, fan_in: a shared layout's batch view: orthogonalize reads k whole consecutive
        blocks as reshape(k, fan_out, fan_in) with k = num_matrices (len(blocks) for the whole param;
        muon_dist's expert paths pass runs of fewer blocks with a smaller num_matrices). A separate layout has
        no batch view (its blocks can differ in shape, and along dim 1 they are not contiguous):
        num_matrices = len(blocks), fan_out = fan_in = None, and matrices_shape raises.
    """

    num_matrices: int
    fan_out: int | None
    fan_in: int | None
    blocks: tuple[Block, ...]
    separate: bool = False

    def __post_init__(self) -> None:
        assert self.blocks and sum(math.prod(b.shape) for b in self.blocks) == math.prod(
            self.shape
        ), self
        if self.separate:
            assert (self.num_matrices, self.fan_out, self.fan_in) == (
                len(self.blocks),
                None,
                None,
            ), self
            return
        # The batch view relies on this: equal slabs of dim 0, in order, are equal consecutive flat ranges.
        first = self.blocks[0]
        for i, b in enumerate(self.blocks):
            assert b.shape == first.shape and b.offsets == (i * first.shape[0],) + (0,) * (
                len(b.shape) - 1
            ), self
            assert (b.fan_out, b.fan_in) == (self.fan_out, self.fan_in), self

    @functools.cached_property
    def shape(self) -> tuple[int, ...]:
        """The param's shape: the box that the blocks tile (computed once per layout: the record is frozen)."""
        return tuple(
            max(b.offsets[d] + b.shape[d] for b in self.blocks)
            for d in range(len(self.blocks[0].shape))
        )

    @property
    def matrices_shape(self) -> tuple[int, int, int]:
        if self.separate:
            raise ValueError(
                f"a separate layout of shape {self.shape} has no batch view: step each of its blocks"
            )
        return (self.num_matrices, self.fan_out, self.fan_in)


def matrix_layout(
    shape: tuple[int, ...] | torch.Size,
    num_experts: int | None = None,
    flatten: bool = False,
    name: str = "param",
    *,
    split_sizes: tuple[int, ...] | list[int] | None = None,
    num_heads: int | None = None,
    split_dim: int = 0,
) -> MatrixLayout:
    """The layout of a parameter of this global shape (MatrixLayout lists every case); ValueError naming the
    parameter and its shape otherwise.

    split_sizes and num_heads (param-group keys) cut a 2-D param into blocks along split_dim, each stepped as
    its own param (separate=True): blocks of the given sizes (summing to shape[split_dim]), or num_heads equal
    blocks. split_dim=0 (rows) for fused or per-head q/k/v weights [heads * head_dim, d_model]; split_dim=1
    (columns) for per-head o weights [d_model, heads * head_dim]. Both keys are exclusive with each other, with
    num_experts and with flatten=True; 2-D params only. How the libraries spell it (docs/conventions.md, "Fused projections"):
        microsoft/dion @0a059a45 dion/megabatch_base.py: group keys `split_sizes` (>= 2 row blocks) and
            `num_heads` (row heads); rows only, no dim key.
        pytorch/torchtitan @b5bcd76c torchtitan/distributed/flex_shard/dist_muon.py: a per-param ComputeLayout
            with BlockShard(dim=0, block_size=head_dim): heads by their size, rows only.
    """
    shape = tuple(shape)
    _check_param_shape(shape, num_experts, name)
    if split_sizes is not None or num_heads is not None or split_dim != 0:
        return _separate_layout(
            shape,
            f"{name} of shape {shape}",
            num_experts,
            flatten,
            split_sizes,
            num_heads,
            split_dim,
        )
    return _experts_layout(shape, num_experts, flatten, name)


def _check_param_shape(shape: tuple[int, ...], num_experts: int | None, name: str) -> None:
    """ValueError naming the param for a shape Muon cannot step (ndim < 2, empty) or a bad num_experts."""
    if len(shape) < 2:
        raise ValueError(
            f"{name} of shape {shape} is not a matrix: Muon needs ndim >= 2 (route it to AdamW)"
        )
    if any(d == 0 for d in shape):
        raise ValueError(f"{name} of shape {shape} is empty")
    if num_experts is not None and (not isinstance(num_experts, int) or num_experts < 1):
        raise ValueError(
            f"num_experts must be a positive int, got {num_experts!r} for {name} of shape {shape}"
        )


def _experts_layout(
    shape: tuple[int, ...], num_experts: int | None, flatten: bool, name: str
) -> MatrixLayout:
    """The shared layout of a checked shape: one matrix, flattened, a 3-D or fused expert stack (validated)."""
    if flatten and len(shape) >= 3:
        if num_experts not in (None, 1):
            raise ValueError(
                f"{name} of shape {shape}: flatten=True merges experts; num_experts must be 1"
            )
        return _shared_layout(shape, 1, shape[0], math.prod(shape[1:]))
    if len(shape) >= 4:
        raise ValueError(
            f"{name} of shape {shape} has ndim {len(shape)}: pass flatten=True for conv weights"
        )
    if len(shape) == 3:
        if num_experts not in (None, shape[0]):
            raise ValueError(
                f"{name} of shape {shape}: num_experts={num_experts} differs from dim 0 ({shape[0]})"
            )
        return _shared_layout(shape, shape[0], shape[1], shape[2])
    experts = num_experts or 1
    if shape[0] % experts:
        raise ValueError(
            f"{name} of shape {shape}: num_experts={experts} does not divide {shape[0]} rows"
        )
    return _shared_layout(shape, experts, shape[0] // experts, shape[1])


def _slabs(
    shape: tuple[int, ...], dim: int, sizes: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, box shape) of consecutive slabs of these sizes along `dim`, each whole along the other dims."""
    boxes, start = [], 0
    for size in sizes:
        offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
        boxes.append((offsets, tuple(size if d == dim else s for d, s in enumerate(shape))))
        start += size
    return boxes


def _shared_layout(
    shape: tuple[int, ...], num_matrices: int, fan_out: int, fan_in: int
) -> MatrixLayout:
    return _slab_layout(shape, 0, (shape[0] // num_matrices,) * num_matrices, (fan_out, fan_in))


# one entry per distinct layout: muon_check/shapes.py's dense_7b has 3 (224 Muon params), moe_30b_a3b 6 (336)
@functools.lru_cache(maxsize=None)
def _slab_layout(
    shape: tuple[int, ...], dim: int, sizes: tuple[int, ...], matrix: tuple[int, int] | None
) -> MatrixLayout:
    """Blocks that are consecutive slabs of `sizes` along `dim`: shared and each read as `matrix` (fan_out,
    fan_in), or (matrix None) separate and each read as its 2-D box. Cached, as a param's layout is asked for
    at every step (muon_ref.Muon; muon_dist's ParamLayout.matrices, several times) and an expert stack has one
    Block per expert (its build time: docs/gpu.md, "Host work per param")."""
    boxes = _slabs(shape, dim, sizes)
    if matrix is None:
        return MatrixLayout(
            len(boxes), None, None, tuple(Block(o, box, *box) for o, box in boxes), separate=True
        )
    return MatrixLayout(len(boxes), *matrix, tuple(Block(o, box, *matrix) for o, box in boxes))


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _separate_layout(
    shape: tuple[int, ...],
    where: str,
    num_experts: int | None,
    flatten: bool,
    split_sizes: tuple[int, ...] | list[int] | None,
    num_heads: int | None,
    split_dim: int,
) -> MatrixLayout:
    """split_sizes or num_heads blocks along split_dim of a 2-D param, each its own param (validated)."""
    if split_sizes is not None and num_heads is not None:
        raise ValueError(
            f"{where}: split_sizes and num_heads are exclusive (uneven blocks or equal heads, not both)"
        )
    if split_sizes is None and num_heads is None:
        raise ValueError(f"{where}: split_dim={split_dim!r} needs split_sizes or num_heads")
    key = "split_sizes" if split_sizes is not None else "num_heads"
    if num_experts is not None or flatten:
        raise ValueError(f"{where}: {key} is exclusive with num_experts and with flatten=True")
    if len(shape) != 2:
        raise ValueError(f"{where}: {key} needs a 2-D param, got ndim {len(shape)}")
    if split_dim not in (0, 1) or isinstance(split_dim, bool):
        raise ValueError(f"{where}: split_dim must be 0 (rows) or 1 (columns), got {split_dim!r}")
    extent = shape[split_dim]
    if num_heads is not None:
        if not _is_count(num_heads):
            raise ValueError(f"{where}: num_heads must be a positive int, got {num_heads!r}")
        if extent % num_heads:
            raise ValueError(
                f"{where}: num_heads={num_heads} does not divide dim {split_dim} ({extent})"
            )
        sizes = (extent // num_heads,) * num_heads
    else:
        sizes = tuple(split_sizes) if isinstance(split_sizes, (tuple, list)) else ()
        if not sizes or not all(_is_count(s) for s in sizes):
            raise ValueError(
                f"{where}: split_sizes must be a non-empty tuple of positive ints, got {split_sizes!r}"
            )
        if sum(sizes) != extent:
            raise ValueError(
                f"{where}: split_sizes {sizes} sum to {sum(sizes)}, not to dim {split_dim} ({extent})"
            )
    return _slab_layout(shape, split_dim, sizes, None)


def read_block(t: Tensor, block: Block) -> Tensor:
    """The block's box of t as a new contiguous (fan_out, fan_in) tensor: a copy, never a view of t."""
    return (
        t[block.index]
        .reshape(block.fan_out, block.fan_in)
        .clone(memory_format=torch.contiguous_format)
    )


def map_blocks(
    stage: Callable[..., tuple[Tensor, ...]], layout: MatrixLayout, *tensors: Tensor
) -> tuple[Tensor, ...]:
    """`stage` on each block of the layout as its own tensor, its outputs written back into whole tensors.

    Reference equation, for every block b of the layout and every output k:
        map_blocks(stage, layout, *ts)[k][b.index] == stage(b, *(read_block(t, b) for t in ts))[k].reshape(b.shape)
    Contract: stage sees each block as a fresh contiguous (fan_out, fan_in) tensor, with the values, shape,
    strides and dtype that a separate param of that shape has, never as a view of the whole tensor (on CPU a
    bf16 elementwise op's bits depend on an element's position in the call: muon_dist/elementwise.py). The
    tensors are whole params (the boxes are global coordinates; ValueError otherwise); every output element
    is written, because the blocks tile the param.
    """
    for t in tensors:
        if tuple(t.shape) != layout.shape:
            raise ValueError(
                f"map_blocks needs whole tensors of the param's shape {layout.shape}, "
                f"got {tuple(t.shape)}"
            )
    outs: list[Tensor] = []
    for block in layout.blocks:
        results = stage(block, *(read_block(t, block) for t in tensors))
        if not outs:
            outs = [torch.empty(layout.shape, dtype=r.dtype, device=r.device) for r in results]
        for out, r in zip(outs, results):
            out[block.index] = r.reshape(block.shape)
    return tuple(outs)


def momentum_buffer(
    grad: Tensor, buf: Tensor, cfg: MuonConfig, out: Tensor | None = None
) -> Tensor:
    """M': the new momentum buffer (elementwise): momentum_direction's first result, by the same ops. With `out`
    (of M''s shape and dtype; buf itself allowed), the last op's out= form writes it there and returns it."""
    if cfg.momentum_style == "ema":
        if out is None:
            return buf.lerp(grad, 1 - cfg.momentum)
        return torch.lerp(buf, grad, 1 - cfg.momentum, out=out)
    scaled = buf.mul(cfg.momentum)
    return scaled.add(grad) if out is None else torch.add(scaled, grad, out=out)


def momentum_direction(grad: Tensor, buf: Tensor, cfg: MuonConfig) -> tuple[Tensor, Tensor]:
    """(M', D): the new momentum buffer and the direction handed to Newton-Schulz (elementwise)."""
    mu = cfg.momentum
    new_buf = momentum_buffer(grad, buf, cfg)
    if cfg.momentum_style == "ema":
        return new_buf, (grad.lerp(new_buf, mu) if cfg.nesterov else new_buf)
    if not cfg.nesterov:
        return new_buf, new_buf
    if cfg.nesterov_form == "add_alpha":
        return new_buf, grad.add(new_buf, alpha=mu)
    return new_buf, new_buf.mul(mu).add(grad)


def orthogonalize(direction: Tensor, layout: MatrixLayout, cfg: MuonConfig) -> Tensor:
    """Newton-Schulz on each block: O[b.index] = newton_schulz(read_block(D, b)) for every block b of the layout.

    Returns direction's shape in the kernel's dtype. A shared layout runs it as one batch view: the blocks are
    equal consecutive flat ranges of D, so reshape(num_matrices, fan_out, fan_in) stacks them, and newton_schulz
    orthogonalises each matrix of a stack alone (proofs/blocks.md#batch-view), or the stack as one batch under
    ns_stack "batched"; D may be any run of whole consecutive blocks. A separate layout runs each block alone
    (map_blocks) on the whole D.
    """
    if layout.separate:
        return map_blocks(lambda b, d: (newton_schulz(d, **cfg.ns_kwargs()),), layout, direction)[0]
    if direction.ndim == 2 and layout.matrices_shape == (1, *direction.shape):
        # one matrix: the kernel on it directly. update_layout "kernel" keeps the kernel's own memory order (a tall
        # matrix's result is the transposed view of its (fan_in, fan_out) iterate), "contiguous" copies it into
        # row-major order; the values are equal, but on CPU a bf16 elementwise op on P and O rounds differently
        # for the two orders (docs/distributed.md, "Update layout")
        update = newton_schulz(direction, **cfg.ns_kwargs())
        return update if cfg.update_layout == "kernel" else update.contiguous()
    matrices = direction.reshape(layout.matrices_shape)
    # each matrix alone (a contiguous stack) or one batch over the stack (MuonConfig.ns_stack: the kernel's memory
    # order, kept or made row-major by update_layout as for one matrix)
    update = newton_schulz(matrices, **cfg.ns_kwargs(), stack=cfg.ns_stack).reshape(direction.shape)
    return update if cfg.update_layout == "kernel" else update.contiguous()


def decay(param: Tensor, cfg: MuonConfig, out: Tensor | None = None) -> Tensor:
    """Decoupled weight decay, in the origin's form (elementwise). With `out`: the same op written into `out`
    (its out= form), bitwise the result without it; at wd == 0 in the "add_self" form no op runs and param
    itself is returned (out untouched)."""
    if cfg.weight_decay_form == "mul":
        c = 1 - cfg.lr * cfg.weight_decay
        return param.mul(c) if out is None else torch.mul(param, c, out=out)
    if cfg.weight_decay > 0:  # Emerging-Optimizers skips the op at wd == 0
        alpha = -(cfg.weight_decay * cfg.lr)
        if out is None:
            return param.add(param, alpha=alpha)
        return torch.add(param, param, alpha=alpha, out=out)
    return param


def apply_update(
    param: Tensor,
    update: Tensor,
    layout: MatrixLayout,
    cfg: MuonConfig,
    out: Tensor | None = None,
) -> Tensor:
    """P' = decay(P) - lr * s * O, in the origin's operation order; elementwise given the layout's scale.

    Shared layout: one scale s = lr_scale(fan_out, fan_in) for the whole param, and `update` may be any shard
    of O aligned with `param` (the scale depends only on the global layout). Separate layout: each block with
    its own scale, on its own tensor (map_blocks), so param and update are whole tensors.

    `out` (a tensor of param's shape and dtype; it may be `param` itself): P' is written into it and `out` is
    returned, with exactly the bits of the call without `out`:
        torch.equal(apply_update(P, O, layout, cfg, out=X), apply_update(P, O, layout, cfg))  bitwise, NaN too
    A shared layout with contiguous param and out runs the same ops in their out= forms, in the same order
    (each is elementwise, so out may alias param; an op whose promoted dtype is wider than param's computes in
    that dtype and rounds on store, as .to(param.dtype) does). Otherwise (a separate layout, a non-contiguous
    param or out) P' is computed as without out and copied into out.
    """
    if out is not None:
        _check_out(param, out)
        if layout.separate or not (param.is_contiguous() and out.is_contiguous()):
            return out.copy_(apply_update(param, update, layout, cfg))
    if layout.separate:
        return map_blocks(
            lambda b, p, u: (apply_update(p, u, b.as_param(), cfg),), layout, param, update
        )[0]
    ratio = lr_scale(cfg.lr_scale, layout.fan_out, layout.fan_in, cfg.scale_sqrt)
    O = update if cfg.update_dtype is None else update.to(cfg.update_dtype)
    new = _scaled_step(param, O, ratio, cfg, out)
    return new if out is not None else new.to(param.dtype)


def _check_out(param: Tensor, out: Tensor) -> None:
    """ValueError unless `out` has param's shape and dtype (apply_update's out=)."""
    if out.shape != param.shape or out.dtype != param.dtype:
        raise ValueError(
            f"apply_update: out of shape {tuple(out.shape)} and dtype {out.dtype} differs from the "
            f"param's {tuple(param.shape)} and {param.dtype}"
        )


def _lr_step(cfg: MuonConfig, ratio: float) -> float | Tensor:
    """lr * s with s = ratio, times scale_factor only when it is not 1 (a float, or 0-d when lr is a Tensor)."""
    return cfg.lr * ratio if cfg.scale_factor == 1.0 else cfg.lr * ratio * cfg.scale_factor


def _scaled_step(
    param: Tensor, O: Tensor, ratio: float, cfg: MuonConfig, out: Tensor | None
) -> Tensor:
    """P' = decay(P) - lr * s * O in cfg.scale_apply's form (MuonConfig), s = ratio: written into `out` and
    returned when out is given, else returned in the ops' dtype (apply_update casts it to param's)."""
    # The update's scaling before the decay (independent ops: their order changes no bits), so that with `out`
    # the update's temporaries exist before the first write into out (the param itself, in muon_dist).
    if cfg.scale_apply == "alpha":
        step = _lr_step(cfg, ratio)
        p = decay(param, cfg, out)
        if out is not None:
            return torch.add(p, O, alpha=-step, out=out)
        return p.add(O, alpha=-step)
    if cfg.scale_apply == "update":
        O = O * ratio
        if cfg.scale_factor != 1.0:
            O = O * cfg.scale_factor
        p = decay(param, cfg, out)
        if out is not None:
            return torch.add(p, O, alpha=-cfg.lr, out=out)
        return p.add(O, alpha=-cfg.lr)
    step = _lr_step(cfg, ratio)
    if cfg.scale_apply == "update_lr_cast":
        # the scalar rounded to O's dtype, as _foreach_mul_ does
        step = torch.tensor(step, dtype=O.dtype)
    scaled = O * step
    p = decay(param, cfg, out)
    if out is not None:
        return torch.sub(p, scaled, out=out)
    return p.sub(scaled)


def check_gradient(grad: Tensor, param: Tensor, name: str) -> None:
    """ValueError naming the parameter for a gradient Muon cannot use (before anything is written)."""
    if grad.is_sparse:
        raise ValueError(
            f"{name} of shape {tuple(param.shape)}: sparse gradients are not supported"
        )
    if grad.shape != param.shape:
        raise ValueError(
            f"{name} of shape {tuple(param.shape)} has a gradient of shape {tuple(grad.shape)}"
        )
    if grad.is_complex() or not grad.is_floating_point():
        raise ValueError(
            f"{name} of shape {tuple(param.shape)}: gradient dtype {grad.dtype} is not real floating"
        )


def is_finite(grad: Tensor) -> bool:
    return bool(torch.isfinite(grad).all())


def muon_step(
    param: Tensor, grad: Tensor, buf: Tensor, cfg: MuonConfig, layout: MatrixLayout
) -> tuple[Tensor, Tensor]:
    """One Muon step on one parameter: (P', M'). Pure: param, grad and buf are not written.

    Shared layout: the three stages on the whole param (module docstring). Separate layout: the whole step on
    each block as its own param, for every block b and output k (proofs/blocks.md#separate):
        muon_step(P, G, M, cfg, layout)[k][b.index] == muon_step(P_b, G_b, M_b, cfg, b.as_param())[k]
    with X_b = read_block(X, b); so a split or per-head param is bitwise the same blocks given as separate params.
    """
    if layout.separate:
        return map_blocks(
            lambda b, p, g, m: muon_step(p, g, m, cfg, b.as_param()), layout, param, grad, buf
        )
    new_buf, direction = momentum_direction(grad, buf, cfg)
    update = orthogonalize(direction, layout, cfg)
    return apply_update(param, update, layout, cfg), new_buf
