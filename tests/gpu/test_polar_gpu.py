"""muon_ref's exact polar factor and its error metrics on CUDA tensors (run: pytest -m gpu): float64 on the tensors'
device, the same values as on CPU up to float64 rounding (the SVD and the products run on other kernels)."""

from __future__ import annotations

import pytest
import torch

from muon_ref import newton_schulz
from muon_ref.polar import max_singular_value_error, orthogonality_error, polar_error, polar_factor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (3, 16, 16)])
def test_polar_metrics_of_cuda_tensors_equal_those_of_their_cpu_copies(shape) -> None:
    """Each metric of a Newton-Schulz output on CUDA equals the metric of the CPU copies within 1e-10 (an identity
    built on CPU beside a CUDA tensor raised a device mismatch in orthogonality_error)."""
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    X = newton_schulz(G.float(), "keller").double()
    for metric in (polar_error, max_singular_value_error):
        assert metric(X.cuda(), G.cuda()) == pytest.approx(metric(X, G), abs=1e-10)
    assert orthogonality_error(X.cuda()) == pytest.approx(orthogonality_error(X), abs=1e-10)
    assert polar_factor(G.cuda()).device.type == "cuda"
