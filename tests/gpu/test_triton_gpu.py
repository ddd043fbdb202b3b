"""The Triton Newton-Schulz kernel against muon_ref.newton_schulz on CUDA, in bf16 and fp32 (run: pytest -m gpu):
autotuned, and at each autotuned config's tiles (the autotuner may pick any of them).

The fp32 bound is the one measured in Triton's interpreter, the bf16 bound is a priori
(muon_dist/kernels/triton_ns.py). The backend's contract, bands included: tests/gpu/test_kernels_gpu.py.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muon_ref import newton_schulz
from tests.conftest import examples
from tests.test_triton_kernel import assert_within_gemm_error_bound

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Gaussian inputs. fp32: the interpreter-measured contract (muon_dist/kernels/triton_ns.py). bf16: a priori, the
# fp16 bound 4e-3 times 2^3 for bf16's 3 fewer mantissa bits; to be replaced by a measured bound after a GPU run
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3.2e-2}
# NVIDIA Hopper Tuning Guide: up to 227 KB of shared memory per thread block on an H100
H100_SHARED_BYTES_PER_BLOCK = 227 * 1024


@pytest.fixture(scope="module")
def tns() -> ModuleType:
    # imported here, not at collection: on a CPU machine collecting this file must not import triton before
    # tests/test_triton_kernel.py sets TRITON_INTERPRET
    pytest.importorskip("triton", reason="triton is not installed (pip install -e .[triton])")
    import muon_dist.kernels.triton_ns as module

    assert not module.INTERPRETED, (
        "TRITON_INTERPRET is set: unset it to run the GPU tests on the GPU"
    )
    return module


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@settings(max_examples=examples(0.5))
@given(
    batch=st.integers(1, 3),
    fan_out=st.integers(1, 384),
    fan_in=st.integers(1, 384),
    schedule=st.sampled_from(["keller", "you5", "polar_express"]),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_reference_on_cuda(tns, dtype, batch, fan_out, fan_in, schedule, seed):
    G = torch.randn(batch, fan_out, fan_in, generator=torch.Generator().manual_seed(seed)).cuda()
    got = tns.newton_schulz_triton(G, schedule, dtype=dtype)
    want = newton_schulz(
        G, schedule, dtype=dtype
    )  # step_form "addmm": cuBLAS rounds b A + c A A once, as the kernel
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got.double() - want.double()).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@settings(max_examples=examples(0.25))
@given(rows=st.integers(1, 300), cols=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_gram_is_exactly_symmetric_on_cuda(tns, dtype, rows, cols, seed):
    X = torch.randn(2, rows, cols, generator=torch.Generator().manual_seed(seed)).to("cuda", dtype)
    A = tns.symmetric_product(X)
    assert torch.equal(A, A.mT)
    assert_within_gemm_error_bound(
        A, X.double() @ X.double().mT, X.abs().double() @ X.abs().double().mT, cols
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("index", range(4), ids=lambda i: f"config{i}")
@settings(max_examples=examples(0.25))
@given(
    batch=st.integers(1, 3),
    fan_out=st.integers(1, 300),
    fan_in=st.integers(1, 300),
    seed=st.integers(0, 2**16),
)
def test_every_autotuned_config_matches_reference_on_cuda(
    tns, index, dtype, batch, fan_out, fan_in, seed
):
    config = tns.CONFIGS[index]
    block, block_k = config.kwargs["BLOCK"], config.kwargs["BLOCK_K"]
    if config.num_stages * 2 * block * block_k * dtype.itemsize > H100_SHARED_BYTES_PER_BLOCK:
        pytest.skip(
            "its fp32 pipeline needs more shared memory than a block has: the autotuner skips it in fp32"
        )
    G = torch.randn(batch, fan_out, fan_in, generator=torch.Generator().manual_seed(seed)).cuda()
    got = tns.newton_schulz_triton(
        G,
        dtype=dtype,
        block=block,
        block_k=block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    assert (got.double() - newton_schulz(G, dtype=dtype).double()).abs().max().item() <= TOLERANCE[
        dtype
    ]
