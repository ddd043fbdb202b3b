"""apply_update's `out` contract (muon_ref/functional.py): written into `out`, whether a fresh tensor or the param
itself, P' has exactly the bits of the call without `out`, for every preset and every branch of the update (decay
forms, weight decay 0, scale_apply forms, scale factor, update dtype, a 0-d tensor lr, mixed param and update
dtypes), on sizes whose elements fall in the vectorised body and in the scalar tail of the CPU kernels."""

from __future__ import annotations

from typing import Any, get_args

import pytest
import torch

from muon_ref import PRESETS, MuonConfig, matrix_layout
from muon_ref.config import ScaleApply
from muon_ref.functional import apply_update

DTYPES = (torch.float32, torch.bfloat16)
# 1 element (tail only), 91 (tail only), 4,160 (body and a tail of 0 after 64 * 65), 65,536 (body only) on a
# 64-element vector chunk; 7x13 and 64x65 also leave tails on any smaller chunk
SHAPES = ((1, 1), (7, 13), (64, 65), (256, 256))
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, NaN-safe (a NaN equals a NaN of the same payload; -0.0 differs from 0.0)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().view(INT_VIEW[a.dtype]), b.contiguous().view(INT_VIEW[b.dtype])
        )
    )


def variants(preset: str) -> list[dict[str, Any]]:
    """The preset, and the preset with each branch of apply_update switched: every scale_apply and decay form,
    weight decay 0, a scale factor, the update dtype set or unset, and lr given as a 0-d tensor."""
    base = PRESETS[preset]
    out: list[dict[str, Any]] = [{}]
    out += [{"scale_apply": s} for s in get_args(ScaleApply) if s != base["scale_apply"]]
    out += [{"weight_decay_form": f} for f in ("mul", "add_self")]
    out += [{"weight_decay": 0.0, "weight_decay_form": f} for f in ("mul", "add_self")]
    out += [{"scale_factor": 0.2, "scale_apply": s} for s in get_args(ScaleApply)]
    out += [{"update_dtype": d} for d in (None, torch.float32, torch.bfloat16)]
    out += [{"lr": torch.tensor(base["lr"]), "scale_apply": s} for s in get_args(ScaleApply)]
    return out


def inputs(
    shape: tuple[int, int],
    param_dtype: torch.dtype,
    update_dtype: torch.dtype,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    param = torch.randn(shape, generator=g).to(device, param_dtype)
    update = torch.randn(shape, generator=g).to(device, update_dtype)
    flat = param.view(-1)
    if flat.numel() > 3:  # an infinity, a NaN and a -0.0 in the param; an infinity in the update
        flat[1], flat[2], flat[3] = float("inf"), float("nan"), -0.0
        update.view(-1)[-1] = float("-inf")
    return param, update


def assert_out_is_the_fresh_result(
    preset: str, param_dtype: torch.dtype, update_dtype: torch.dtype, device: str = "cpu"
) -> None:
    """Over SHAPES and every variant of the preset: apply_update into a fresh tensor and into the param itself
    has the plain call's bits; the fresh out leaves the param alone."""
    for shape in SHAPES:
        param, update = inputs(shape, param_dtype, update_dtype, device)
        layout = matrix_layout(shape)
        for change in variants(preset):
            cfg = MuonConfig(**{**PRESETS[preset], **change})
            want = apply_update(param, update, layout, cfg)
            before = param.clone()
            out = torch.full_like(param, 7.0)
            got = apply_update(param, update, layout, cfg, out=out)
            assert got is out and same_bits(out, want), (shape, change)
            assert same_bits(param, before), (shape, change)
            own = param.clone()
            got = apply_update(own, update, layout, cfg, out=own)
            assert got is own and same_bits(own, want), (shape, change)


# a 0-d tensor lr under "update_lr_cast" goes through torch.tensor(tensor), which warns (the path is unchanged)
@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("param_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("update_dtype", DTYPES, ids=str)
def test_apply_update_into_out_or_into_the_param_itself_is_bitwise_the_fresh_result(
    preset, param_dtype, update_dtype
):
    assert_out_is_the_fresh_result(preset, param_dtype, update_dtype)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_apply_update_into_out_is_bitwise_on_experts_split_heads_and_non_contiguous_tensors(preset):
    """The shared batch layout of experts, a separate layout (each block its own param: computed, then copied)
    and a non-contiguous param and out (computed, then copied) keep the contract too."""
    cfg = MuonConfig(**PRESETS[preset])
    g = torch.Generator().manual_seed(1)
    cases = [
        (torch.randn(4, 24, 13, generator=g), matrix_layout((4, 24, 13))),
        (torch.randn(96, 13, generator=g), matrix_layout((96, 13), num_experts=4)),
        (torch.randn(96, 13, generator=g), matrix_layout((96, 13), split_sizes=(32, 64))),
        (torch.randn(96, 12, generator=g), matrix_layout((96, 12), num_heads=3, split_dim=1)),
    ]
    for param, layout in cases:
        for dtype in DTYPES:
            p = param.to(dtype)
            u = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            want = apply_update(p, u, layout, cfg)
            out = torch.empty_like(p)
            assert same_bits(apply_update(p, u, layout, cfg, out=out), want)
            own = p.clone()
            assert same_bits(apply_update(own, u, layout, cfg, out=own), want)
    p = torch.randn(65, 64, generator=g).t()  # non-contiguous (64, 65)
    u = torch.randn(64, 65, generator=g)
    layout = matrix_layout((64, 65))
    want = apply_update(p, u, layout, cfg)
    out = torch.empty(65, 64).t()
    assert same_bits(apply_update(p, u, layout, cfg, out=out), want)
    own = p.clone().t().contiguous().t()  # the param's strides, a copy
    assert same_bits(apply_update(own, u, layout, cfg, out=own), want)


def test_apply_update_refuses_an_out_of_another_shape_or_dtype():
    cfg, layout = MuonConfig(**PRESETS["torch"]), matrix_layout((4, 4))
    p, u = torch.randn(4, 4), torch.randn(4, 4)
    with pytest.raises(ValueError, match="out of shape"):
        apply_update(p, u, layout, cfg, out=torch.empty(16))
    with pytest.raises(ValueError, match="out of shape"):
        apply_update(p, u, layout, cfg, out=torch.empty(4, 4, dtype=torch.bfloat16))


def test_negative_control_the_bit_check_catches_another_operation_order():
    """The check above can fail: the decay applied after the update instead of before (the same factors, the
    same dtype) differs from apply_update in some bits on these inputs."""
    cfg = MuonConfig(**PRESETS["torch"])
    shape = (64, 65)
    param, update = inputs(shape, torch.float32, torch.float32)
    layout = matrix_layout(shape)
    want = apply_update(param, update, layout, cfg)
    step = cfg.lr * 1.0  # the shape scale of a (64, 65) param under "original" is 1
    reordered = param.add(update, alpha=-step).mul(1 - cfg.lr * cfg.weight_decay)
    assert torch.allclose(reordered.float(), want.float(), equal_nan=True, atol=1e-2)
    assert not same_bits(reordered, want)
