"""muon_dist.agreement's non-finite flags without ranks: one flag per gradient piece, exactly "holds a NaN or an
infinity", in every floating dtype. The flags are read by a sum first and by aminmax only where the sum is not
finite, so the cases that matter are finite pieces whose sum overflows (flagged by the sum, cleared by aminmax) and
a single non-finite element among large or cancelling values."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from muon_dist import agreement

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _flags(pieces: list[torch.Tensor | None]) -> list[int]:
    return agreement._nonfinite_flags(pieces, torch.device("cpu")).tolist()


def _truth(pieces: list[torch.Tensor | None]) -> list[int]:
    return [int(p is not None and p.numel() > 0 and not bool(p.isfinite().all())) for p in pieces]


@st.composite
def pieces(draw) -> list[torch.Tensor | None]:
    """Up to 5 pieces (some None or empty) of one dtype: Gaussian, or at the dtype's largest finite magnitude
    (whose sum overflows), each with up to 2 NaN, +inf or -inf elements planted."""
    dtype = draw(st.sampled_from(DTYPES))
    out: list[torch.Tensor | None] = []
    for k in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["none", "empty", "gauss", "huge", "cancel"]))
        if kind == "none":
            out.append(None)
            continue
        n = 0 if kind == "empty" else draw(st.integers(1, 300))
        x = torch.randn(n, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
        big = torch.finfo(dtype).max
        if kind == "huge":
            x = torch.full((n,), big, dtype=torch.float64)
        elif kind == "cancel":
            x = torch.tensor([big, -big] * n, dtype=torch.float64)
        x = x.to(dtype)
        for _ in range(draw(st.integers(0, 2)) if x.numel() else 0):
            x[draw(st.integers(0, x.numel() - 1))] = draw(
                st.sampled_from([float("nan"), float("inf"), float("-inf")])
            )
        out.append(x.reshape(-1, 1) if draw(st.booleans()) else x)
    return out


@given(drawn=pieces())
@example(
    drawn=[torch.full((4,), torch.finfo(torch.float32).max)]
)  # the sum overflows; every element finite
@example(drawn=[torch.full((3,), 60000.0, dtype=torch.float16)])
@example(drawn=[torch.tensor([float("inf"), float("-inf")])])  # inf - inf: a NaN sum
@example(drawn=[torch.tensor([3e38, float("-inf"), 3e38])])
def test_each_piece_is_flagged_exactly_when_it_holds_a_nan_or_an_infinity(drawn) -> None:
    """The flags equal isfinite's verdict on every piece (0 for None and empty pieces), overflowing sums
    included."""
    assert _flags(drawn) == _truth(drawn)


def test_a_piece_whose_sum_overflows_is_read_again_and_cleared(monkeypatch) -> None:
    """Negative control: with the second reading made blind (aminmax answering infinities, so every piece the sum
    suspects stays flagged), finite pieces whose sum overflows are flagged; the property above catches that."""
    finite = [torch.full((4,), torch.finfo(torch.float32).max), torch.ones(3)]
    assert _flags(finite) == [0, 0]
    inf = torch.tensor(float("inf"))
    monkeypatch.setattr(agreement.torch, "aminmax", lambda x: (-inf, inf))
    assert _flags(finite) != _truth(finite)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_nan_among_values_that_cancel_is_flagged(dtype) -> None:
    """A sum can be finite and wrong (large values cancel), but never finite with a NaN or an infinity in it."""
    big = torch.finfo(dtype).max
    x = torch.tensor([big, -big, 1.0, 2.0], dtype=torch.float64).to(dtype)
    assert _flags([x]) == [0]
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[2] = bad
        assert _flags([y, x]) == [1, 0]
