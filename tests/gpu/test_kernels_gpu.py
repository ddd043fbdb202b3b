"""Every backend of muon_dist.kernels on CUDA against its contract, and the "torch" backend's batched rule there
(run: pytest -m gpu).

Every bound below is the CPU-measured contract of the backend's module docstring, a priori on
CUDA (muon_dist/kernels/README.md says what is measured where). `python -m muon_dist.kernels.contracts --device
cuda` and `python -m muon_dist.kernels.reference --device cuda` print the measurements these tests check.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muon_check.fixtures import same_bits
from muon_dist.kernels import BACKENDS
from muon_dist.kernels.contracts import measure
from muon_ref import MuonConfig, matrix_layout, newton_schulz, orthogonalize, signed_singular_values
from tests.conftest import examples

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.bfloat16, torch.float32]
# max |backend - muon_ref| on Gaussian inputs under the default config (keller, addmm form): triton_ns.py (fp32
# measured in the interpreter; bf16 a priori, the fp16 bound times 2^3) and gram_ns.py contract 2 (all kinds, CPU)
DIFFERENCE = {
    "triton": {torch.float32: 1e-5, torch.bfloat16: 3.2e-2},
    "gram": {torch.float32: 2e-4, torch.bfloat16: 0.5},
    # batched.py's CPU contract is 1e-5 / 2^-6; on CUDA a priori the triton bounds (a batched GEMM may take
    # another algorithm than the single one, as a Triton tile does), until a GPU run measures it
    "batched": {torch.float32: 1e-5, torch.bfloat16: 3.2e-2},
}
# signed singular values of Gaussians with n / m in [2, 8], keller, measured on CPU over 40 inputs by
# `python -m muon_dist.kernels.contracts --schedules keller --cases 40`: muon_ref's (the "torch" backend's, and
# within their differences triton's and batched's) and gram's (gram_ns.py contract 2); margin: 4 ulps of 1 in
# bf16, 1e-3 in fp32 (the printed 4 digits); a bitwise backend has muon_ref's band
GAUSSIAN_BAND = {
    torch.bfloat16: {
        "muon_ref": (0.6771, 1.139),
        "triton": (0.6771, 1.139),
        "batched": (0.6771, 1.139),
        "gram": (0.6685, 1.134),
    },
    torch.float32: {
        "muon_ref": (0.6818, 1.134),
        "triton": (0.6818, 1.134),
        "batched": (0.6818, 1.134),
        "gram": (0.6818, 1.134),
    },
}
# the same on the harder inputs (square, rank 4 + noise, singular values 1..1e-6, rank one): gram overshoots on squares
HARD_BAND = {
    torch.bfloat16: {
        "muon_ref": (-0.2243, 1.201),
        "triton": (-0.2243, 1.201),
        "batched": (-0.2243, 1.201),
        "gram": (-0.2402, 1.599),
    },
    torch.float32: {
        "muon_ref": (-3.1e-6, 1.202),
        "triton": (-3.1e-6, 1.202),
        "batched": (-3.1e-6, 1.202),
        "gram": (-3.1e-6, 1.202),
    },
}
MARGIN = {torch.bfloat16: 4 * 2.0**-7, torch.float32: 1e-3}


def runnable_backend(name: str):
    """The backend, or a skip naming why it cannot run here (its optional package missing). A backend with a
    tolerance must have its bounds stated above: one without them fails, never skips."""
    from muon_dist.kernels import backend

    try:
        found = backend(name)  # imports the module: triton only now, never at collection
    except ImportError as e:
        pytest.skip(f"backend {name!r} cannot be imported here: {e}")
    if not found.bitwise and name not in DIFFERENCE:
        pytest.fail(
            f"backend {name!r} has a tolerance but no contract stated in this test: add its DIFFERENCE and "
            f"bands (muon_dist/kernels/contracts.py measures them)"
        )
    return found


def band_of(name: str, bands: dict[str, tuple[float, float]]) -> tuple[float, float]:
    return bands["muon_ref"] if runnable_backend(name).bitwise else bands[name]


def gaussian_on_cuda(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).cuda()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(BACKENDS))
@settings(max_examples=examples(0.5))
@given(
    num_matrices=st.integers(1, 4),
    fan_out=st.integers(1, 384),
    fan_in=st.integers(1, 384),
    seed=st.integers(0, 2**16),
)
def test_every_backend_matches_muon_ref_on_cuda_within_its_contract(
    name, dtype, num_matrices, fan_out, fan_in, seed
):
    kernel = runnable_backend(name)
    shape = (
        (num_matrices, fan_out, fan_in) if num_matrices > 1 else (fan_out, fan_in)
    )  # stacks: 3-D expert params
    D, layout, cfg = gaussian_on_cuda(shape, seed), matrix_layout(shape), MuonConfig(ns_dtype=dtype)
    got, want = kernel.orthogonalize(D, layout, cfg), orthogonalize(D, layout, cfg)
    if kernel.bitwise:
        assert same_bits(got, want)
    else:
        assert float((got.double() - want.double()).abs().max()) <= DIFFERENCE[name][dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(BACKENDS))
@settings(max_examples=examples(0.25))
@given(
    num_matrices=st.integers(1, 3),
    short=st.integers(4, 128),
    aspect=st.floats(2.0, 8.0),
    tall=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_every_backends_singular_values_of_gaussians_stay_in_the_band_on_cuda(
    name, dtype, num_matrices, short, aspect, tall, seed
):
    kernel = runnable_backend(name)
    long = max(short + 1, round(short * aspect))
    shape = (num_matrices, long, short) if tall else (num_matrices, short, long)
    G = gaussian_on_cuda(shape, seed)
    d = signed_singular_values(
        kernel.orthogonalize(G, matrix_layout(shape), MuonConfig(ns_dtype=dtype)).cpu(), G.cpu()
    )
    low, high = band_of(name, GAUSSIAN_BAND[dtype])
    assert low - MARGIN[dtype] <= float(d.min()) and float(d.max()) <= high + MARGIN[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("kind", ["square", "low_rank", "ill_conditioned", "rank_one"])
def test_every_backend_keeps_its_band_on_the_harder_inputs_on_cuda(name, dtype, kind):
    low, high = band_of(name, HARD_BAND[dtype])
    r = measure(name, MuonConfig(ns_dtype=dtype), kind, range(8), 64, torch.device("cuda"))
    assert low - MARGIN[dtype] <= r["low"] and r["high"] <= high + MARGIN[dtype], r


@settings(max_examples=examples(1.0))
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    num_matrices=st.integers(2, 6),
    fan_out=st.integers(1, 256),
    fan_in=st.integers(1, 256),
    schedule=st.sampled_from(["keller", "you5", "polar_express"]),
    seed=st.integers(0, 2**16),
)
def test_the_torch_backends_batched_rule_enables_no_stack_that_is_not_bitwise_on_cuda(
    dtype, num_matrices, fan_out, fan_in, schedule, seed
):
    # measures the batched kernel against the loop on CUDA on other inputs than the probe's: fails if the probe's
    # verdict for a key does not hold for another input of that key
    from muon_dist.kernels.reference import batched_is_bitwise, newton_schulz_batched

    G = gaussian_on_cuda((num_matrices, fan_out, fan_in), seed)
    bitwise = same_bits(
        newton_schulz_batched(G, schedule, dtype=dtype), newton_schulz(G, schedule, dtype=dtype)
    )
    enabled = batched_is_bitwise(G.shape, G.dtype, G.device, schedule=schedule, dtype=dtype)
    assert bitwise or not enabled, (
        f"muon_dist.kernels.reference.batched_is_bitwise enables a {dtype} stack {tuple(G.shape)} ({schedule}) on "
        f"{torch.cuda.get_device_name()} whose batched result is not the loop's bits: the probe's key misses what decides the kernel (measure with "
        f"python -m muon_dist.kernels.reference --device cuda)"
    )
