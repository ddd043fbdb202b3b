"""Muon's update as pure functions: they return new tensors and never write their inputs.

One step on a parameter P with gradient G and momentum buffer M (MuonConfig gives every convention):
    M', D = momentum_direction(G, M)          elementwise
    O     = orthogonalize(D)                  Newton-Schulz on each matrix of the parameter's layout
    P'    = apply_update(P, O)                elementwise, with the shape scale of one matrix
The elementwise stages commute with any sharding of P, G and M; only `orthogonalize` needs whole matrices.
muon_dist relies on exactly this split (proofs/paths.md): it runs the two elementwise stages on local shards
and the same `newton_schulz` kernel on reassembled global matrices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import MuonConfig, lr_scale
from .newton_schulz import newton_schulz


@dataclass(frozen=True)
class MatrixLayout:
    """How a parameter is read as matrices: num_matrices independent (fan_out, fan_in) matrices.

    2-D (fan_out, fan_in): one matrix. 2-D fused experts (E * m, n) with num_experts=E: E matrices (m, n).
    3-D (E, m, n): E matrices. ndim >= 3 with flatten=True: one matrix (shape[0], prod(shape[1:])).
    """

    num_matrices: int
    fan_out: int
    fan_in: int

    @property
    def matrices_shape(self) -> tuple[int, int, int]:
        return (self.num_matrices, self.fan_out, self.fan_in)


def matrix_layout(
    shape: tuple[int, ...] | torch.Size, num_experts: int | None = None, flatten: bool = False, name: str = "param"
) -> MatrixLayout:
    """The layout of a parameter of this global shape; ValueError naming the parameter otherwise."""
    shape = tuple(shape)
    if len(shape) < 2:
        raise ValueError(f"{name} of shape {shape} is not a matrix: Muon needs ndim >= 2 (route it to AdamW)")
    if any(d == 0 for d in shape):
        raise ValueError(f"{name} of shape {shape} is empty")
    if num_experts is not None and (not isinstance(num_experts, int) or num_experts < 1):
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r} for {name} of shape {shape}")
    if flatten and len(shape) >= 3:
        if num_experts not in (None, 1):
            raise ValueError(f"{name} of shape {shape}: flatten=True merges experts; num_experts must be 1")
        return MatrixLayout(1, shape[0], math.prod(shape[1:]))
    if len(shape) >= 4:
        raise ValueError(f"{name} of shape {shape} has ndim {len(shape)}: pass flatten=True for conv weights")
    if len(shape) == 3:
        if num_experts not in (None, shape[0]):
            raise ValueError(f"{name} of shape {shape}: num_experts={num_experts} differs from dim 0 ({shape[0]})")
        return MatrixLayout(shape[0], shape[1], shape[2])
    experts = num_experts or 1
    if shape[0] % experts:
        raise ValueError(f"{name} of shape {shape}: num_experts={experts} does not divide {shape[0]} rows")
    return MatrixLayout(experts, shape[0] // experts, shape[1])


def momentum_direction(grad: Tensor, buf: Tensor, cfg: MuonConfig) -> tuple[Tensor, Tensor]:
    """(M', D): the new momentum buffer and the direction handed to Newton-Schulz (elementwise)."""
    mu = cfg.momentum
    if cfg.momentum_style == "ema":
        new_buf = buf.lerp(grad, 1 - mu)
        return new_buf, (grad.lerp(new_buf, mu) if cfg.nesterov else new_buf)
    new_buf = buf.mul(mu).add(grad)
    if not cfg.nesterov:
        return new_buf, new_buf
    if cfg.nesterov_form == "add_alpha":
        return new_buf, grad.add(new_buf, alpha=mu)
    return new_buf, new_buf.mul(mu).add(grad)


def orthogonalize(direction: Tensor, layout: MatrixLayout, cfg: MuonConfig) -> Tensor:
    """Newton-Schulz on each of the layout's matrices; returns direction's shape in the kernel's dtype."""
    matrices = direction.reshape(layout.matrices_shape)
    return newton_schulz(matrices, **cfg.ns_kwargs()).reshape(direction.shape)


def decay(param: Tensor, cfg: MuonConfig) -> Tensor:
    """Decoupled weight decay, in the origin's form (elementwise)."""
    if cfg.weight_decay_form == "mul":
        return param.mul(1 - cfg.lr * cfg.weight_decay)
    if cfg.weight_decay > 0:  # Emerging-Optimizers skips the op at wd == 0
        return param.add(param, alpha=-(cfg.weight_decay * cfg.lr))
    return param


def apply_update(param: Tensor, update: Tensor, layout: MatrixLayout, cfg: MuonConfig) -> Tensor:
    """P' = decay(P) - lr * s * O, in the origin's operation order; elementwise given the layout's scale.

    `update` may be any shard of O aligned with `param`: the scale depends only on the global layout.
    """
    ratio = lr_scale(cfg.lr_scale, layout.fan_out, layout.fan_in, cfg.scale_sqrt)
    p = decay(param, cfg)
    O = update if cfg.update_dtype is None else update.to(cfg.update_dtype)
    if cfg.scale_apply == "alpha":
        step = cfg.lr * ratio if cfg.scale_factor == 1.0 else cfg.lr * ratio * cfg.scale_factor
        new = p.add(O, alpha=-step)
    elif cfg.scale_apply == "update":
        O = O * ratio
        if cfg.scale_factor != 1.0:
            O = O * cfg.scale_factor
        new = p.add(O, alpha=-cfg.lr)
    else:
        step = cfg.lr * ratio if cfg.scale_factor == 1.0 else cfg.lr * ratio * cfg.scale_factor
        if cfg.scale_apply == "update_lr_cast":
            step = torch.tensor(step, dtype=O.dtype)  # the scalar rounded to O's dtype, as _foreach_mul_ does
        new = p.sub(O * step)
    return new.to(param.dtype)


def check_gradient(grad: Tensor, param: Tensor, name: str) -> None:
    """ValueError naming the parameter for a gradient Muon cannot use (before anything is written)."""
    if grad.is_sparse:
        raise ValueError(f"{name} of shape {tuple(param.shape)}: sparse gradients are not supported")
    if grad.shape != param.shape:
        raise ValueError(f"{name} of shape {tuple(param.shape)} has a gradient of shape {tuple(grad.shape)}")
    if grad.is_complex() or not grad.is_floating_point():
        raise ValueError(f"{name} of shape {tuple(param.shape)}: gradient dtype {grad.dtype} is not real floating")


def is_finite(grad: Tensor) -> bool:
    return bool(torch.isfinite(grad).all())


def muon_step(
    param: Tensor, grad: Tensor, buf: Tensor, cfg: MuonConfig, layout: MatrixLayout
) -> tuple[Tensor, Tensor]:
    """One Muon step on one parameter: (P', M'). Pure: param, grad and buf are not written."""
    new_buf, direction = momentum_direction(grad, buf, cfg)
    update = orthogonalize(direction, layout, cfg)
    return apply_update(param, update, layout, cfg), new_buf
