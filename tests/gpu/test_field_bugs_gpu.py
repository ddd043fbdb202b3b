"""Field-bug classes that only a GPU shows (docs/field-bugs.md, classes 20 and 21; planted.UNREACHABLE says why
the conformance check on gloo ranks cannot reach them), checked on this repository's Triton Newton-Schulz kernel
(muon_dist/kernels/triton_ns.py). Run: pytest -m gpu.

20 (microsoft/dion #102, NVIDIA-NeMo/Emerging-Optimizers #245): a batch offset computed in int32 overflows on a
   stack of more than 2^31 elements, so the last matrices read the wrong memory; a TMA descriptor refuses a
   row stride that is not a multiple of 16 bytes (a narrow bf16 matrix).
21 (microsoft/dion #58, #100; Dao-AILab/gram-newton-schulz PR 22): autotuned kernels returning NaN, and memory
   that grows from call to call.
The bound is test_triton_gpu.py's bf16 one; the GPU runs: docs/gpu.md.
"""

from __future__ import annotations

import pytest
import torch

from muon_ref import newton_schulz
from tests.gpu.test_triton_gpu import tns  # noqa: F401 - the compiled kernel module, the fixture of its tests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# tests/gpu/test_triton_gpu.py: the a priori bf16 bound of the kernel against muon_ref
BF16_TOLERANCE = 3.2e-2


def _gaussian(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to("cuda")


def _reference(G: torch.Tensor) -> torch.Tensor:
    """muon_ref's Newton-Schulz of G in bf16 (step_form "addmm", as the kernel rounds; test_triton_gpu.py)."""
    return newton_schulz(G, "keller", dtype=torch.bfloat16)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def test_the_last_matrices_of_a_stack_past_int32_offsets_are_orthogonalised(tns) -> None:  # noqa: F811
    # 8200 matrices of 512 x 512: 2,149,580,800 elements, past 2^31 - 1 = 2,147,483,647, with batch <= MAX_BATCH;
    # the first and the last matrix are compared with muon_ref (an int32 offset would wrap for the last ones)
    batch, m = 8200, 512
    assert batch * m * m > 2**31 - 1 and batch <= tns.MAX_BATCH
    stack = torch.empty(batch, m, m, dtype=torch.bfloat16, device="cuda")
    first, last = _gaussian((m, m), 1), _gaussian((m, m), 2)
    stack.normal_(generator=torch.Generator("cuda").manual_seed(0))
    stack[0], stack[-1] = first.to(torch.bfloat16), last.to(torch.bfloat16)
    out = tns.newton_schulz_triton(stack, "keller", dtype=torch.bfloat16)
    del stack
    for got, G in ((out[0], first), (out[-1], last)):
        assert torch.isfinite(got).all()
        assert _max_abs(got, _reference(G.to(torch.bfloat16))) <= BF16_TOLERANCE


@pytest.mark.parametrize("shape", [(64, 7), (7, 64), (3, 40, 9)])
def test_narrow_matrices_whose_rows_are_not_16_byte_aligned_are_orthogonalised(
    tns,  # noqa: F811
    shape: tuple[int, ...],
) -> None:
    # bf16 rows of 7 or 9 elements: 14 or 18 bytes, not a multiple of 16 (the TMA stride rule)
    G = _gaussian(shape, 3).to(torch.bfloat16)
    got = tns.newton_schulz_triton(G, "keller", dtype=torch.bfloat16)
    assert got.shape == G.shape and torch.isfinite(got).all()
    assert _max_abs(got, _reference(G)) <= BF16_TOLERANCE


def test_the_autotuned_kernel_returns_no_nan_and_holds_no_more_memory_call_after_call(tns) -> None:  # noqa: F811
    # the autotuner runs on the first call of each shape; after it, repeated calls must give the same bits and
    # leave the allocated memory where it was
    G = _gaussian((8, 384, 256), 4).to(torch.bfloat16)
    first = tns.newton_schulz_triton(G, "keller", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    for _ in range(20):
        again = tns.newton_schulz_triton(G, "keller", dtype=torch.bfloat16)
        assert torch.equal(again, first)
        del again
    torch.cuda.synchronize()
    assert torch.isfinite(first).all()
    assert torch.cuda.memory_allocated() == held
