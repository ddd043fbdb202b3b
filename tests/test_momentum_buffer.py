"""momentum_buffer's contract (muon_ref/functional.py): the new momentum buffer alone, with and without `out` (a fresh
tensor or the buffer itself), has exactly the bits of momentum_direction's first result, for every preset and
momentum form, on sizes whose elements fall in the vectorised body and in the scalar tail of the CPU kernels.
DistributedMuon's write stage relies on it: it computes the buffer again there, written in place, instead of
holding it through the exchange (muon_dist/step.py)."""

from __future__ import annotations

import pytest
import torch

from muon_ref import PRESETS, MuonConfig
from muon_ref.functional import momentum_buffer, momentum_direction
from tests.test_apply_update_out import DTYPES, SHAPES, same_bits

FORMS = [
    {},
    {"momentum_style": "ema", "nesterov_form": "lerp"},
    {"momentum_style": "sum", "nesterov_form": "add_alpha"},
    {"momentum_style": "sum", "nesterov_form": "mul_add"},
    {"nesterov": False},
]


def _inputs(
    shape: tuple[int, int], dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize(
    "form", FORMS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "as is"
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_buffer_alone_has_momentum_directions_bits_with_and_without_out(
    preset, form, dtype
) -> None:
    cfg = MuonConfig(**{**PRESETS[preset], **form})
    for k, shape in enumerate(SHAPES):
        grad, buf = _inputs(shape, dtype, k)
        want, _ = momentum_direction(grad, buf, cfg)
        assert same_bits(momentum_buffer(grad, buf, cfg), want)
        fresh = torch.empty_like(buf)
        assert momentum_buffer(grad, buf, cfg, out=fresh) is fresh and same_bits(fresh, want)
        in_place = buf.clone()
        assert momentum_buffer(grad, in_place, cfg, out=in_place) is in_place
        assert same_bits(in_place, want)


def test_another_order_of_the_same_ema_is_caught() -> None:
    """Negative control: buf + (grad - buf) (1 - mu), the same EMA in another order, differs in bf16 bits."""
    cfg = MuonConfig(**PRESETS["torch"])
    grad, buf = _inputs((64, 65), torch.bfloat16, 0)
    other = buf + (grad - buf) * (1 - cfg.momentum)
    assert not same_bits(other, momentum_buffer(grad, buf, cfg))
