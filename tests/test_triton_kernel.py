"""The Triton Newton-Schulz kernel (muon_dist/kernels/triton_ns.py) against muon_ref.newton_schulz.

Without CUDA the kernels run in Triton's interpreter (fp32 and fp16 only: its bf16 tl.dot is wrong), about
1 s per call at these sizes; bf16 and larger shapes are checked on CUDA in tests/gpu/test_triton_gpu.py.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from muon_ref import newton_schulz

KERNEL_MODULE = "muon_dist.kernels.triton_ns"
# several tiles per matrix, ragged edges, and few enough interpreter programs to stay near 1 s per call
TILES = dict(block=32, block_k=16)
# muon_dist/kernels/triton_ns.py docstring: max measured 1.8e-6 (fp32) and 9.8e-4 (fp16) on these cases
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3}
CASES = [  # (shape, schedule): wide, tall, square, batched tall, two leading dims; every schedule in both dtypes
    ((64, 96), "keller"),
    ((96, 64), "you5"),
    ((48, 48), "polar_express"),
    ((3, 33, 17), "keller"),
    ((2, 1, 20, 40), "polar_express"),
]


@contextlib.contextmanager
def _imported_fresh(name: str, env: dict[str, str]) -> Iterator[ModuleType]:
    """Import `name` anew with `env` set; afterwards restore os.environ, sys.modules and the package attribute.

    triton itself is imported (if it is not yet) with `env` set too: triton.jit reads TRITON_INTERPRET when it
    decorates, so triton.language's own jit functions (tl.zeros, ...) fail in the interpreter when triton was
    imported first. The kernel calls builtins only, so it also runs when another test imported triton earlier.
    """
    package_name, _, attr = name.rpartition(".")
    package = importlib.import_module(package_name)
    saved_env = {key: os.environ.get(key) for key in env}
    saved_module, saved_attr = sys.modules.pop(name, None), package.__dict__.pop(attr, None)
    os.environ.update(env)
    try:
        pytest.importorskip("triton", reason="triton is not installed (pip install -e .[triton])")
        yield importlib.import_module(name)
    finally:
        for key, value in saved_env.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
        sys.modules.pop(name, None)
        package.__dict__.pop(attr, None)
        if saved_module is not None:
            sys.modules[name], package.__dict__[attr] = saved_module, saved_attr


@pytest.fixture(scope="module")
def tns() -> Iterator[ModuleType]:
    """The kernel module, built for the interpreter when no CUDA device is present (nothing leaks out)."""
    env = {} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}
    with _imported_fresh(KERNEL_MODULE, env) as module:
        assert module.INTERPRETED == (not torch.cuda.is_available())
        yield module


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def gaussian(shape: tuple[int, ...], seed: int, device: str) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def max_abs_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype
    return (got.double() - want.double()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape, schedule", CASES)
def test_kernel_matches_reference_to_the_stated_tolerance(tns, device, shape, schedule, dtype):
    G = gaussian(shape, seed=len(shape) + sum(shape), device=device)
    got = tns.newton_schulz_triton(G, schedule, dtype=dtype, **TILES)
    # muon_ref's default step form (addmm) rounds b A + c A A once, as the kernel does: the tightest reference
    assert max_abs_difference(got, newton_schulz(G, schedule, dtype=dtype)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype, relative_error", [(torch.float32, 1e-4), (torch.float16, 1e-2)], ids=str)
def test_a_kernel_with_a_wrong_coefficient_fails_the_comparison(tns, device, monkeypatch, dtype, relative_error):
    # negative control, measured: `a` off by 1e-4 moves the fp32 output by 5.4e-4 (54x its tolerance), off by
    # 1e-2 the fp16 output by 4.4e-2 (11x); a 1e-3 error in fp16 (5.4e-3) would be too close to 4e-3 to be a control
    correct_update = tns.quintic_update
    wrong_update = lambda B, X, a, **kw: correct_update(B, X, a * (1 + relative_error), **kw)  # noqa: E731
    monkeypatch.setattr(tns, "quintic_update", wrong_update)
    G = gaussian((64, 96), seed=0, device=device)
    got = tns.newton_schulz_triton(G, "keller", dtype=dtype, **TILES)
    assert max_abs_difference(got, newton_schulz(G, "keller", dtype=dtype)) > TOLERANCE[dtype]


def assert_within_gemm_error_bound(got: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, terms: int) -> None:
    """|got - exact| <= terms * u32 * magnitude + u * |exact| elementwise (Higham, Accuracy and Stability of
    Numerical Algorithms, 2002, eq. 3.5): fp32 accumulation of `terms` products of total size `magnitude`
    (|X| |X|^T for a Gram), then one rounding to got's dtype (unit roundoff u)."""
    u32, u = torch.finfo(torch.float32).eps / 2, torch.finfo(got.dtype).eps / 2
    bound = terms * u32 * magnitude + u * exact.abs()
    excess = (got.double() - exact).abs() - bound
    assert excess.max() <= 0, f"error exceeds the bound by {excess.max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gram_is_exactly_symmetric_and_equals_x_xt_to_rounding(tns, device, dtype):
    X = gaussian((2, 90, 20), seed=1, device=device).to(dtype)  # block 16: 6 x 6 tiles, 21 of them computed
    A = tns.symmetric_product(X, block=16, block_k=16)
    assert torch.equal(A, A.mT)
    assert_within_gemm_error_bound(A, X.double() @ X.double().mT, X.abs().double() @ X.abs().double().mT, 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_fused_polynomial_is_exactly_symmetric_and_equals_b_a_plus_c_a_a_to_rounding(tns, device, dtype):
    X = gaussian((1, 40, 24), seed=2, device=device).to(dtype) / 8  # |A| ~ 0.4: the range NS works in
    A = tns.symmetric_product(X, **TILES)
    b, c = -4.775, 2.0315  # KellerJordan/Muon muon.py
    B = tns.symmetric_product(A, alpha=c, beta=b, addend=A, **TILES)
    assert torch.equal(B, B.mT)
    A64 = A.double()
    want = b * A64 + c * A64 @ A64
    assert_within_gemm_error_bound(B, want, abs(b) * A64.abs() + abs(c) * A64.abs() @ A64.abs(), 40 + 2)


@pytest.mark.parametrize(
    "shape, options",
    [
        ((7, 5), {}),
        ((5, 7), {"eps_mode": "add", "normalize_before_cast": True}),
        ((2, 6, 6), {"dtype": torch.float16, "safety": 1.01}),
        ((4, 0), {}),  # not (2, 0, 3): muon_ref's G.reshape(-1, 0, 3) raises there
        ((0, 4, 3), {}),
        ((4, 3), {"dtype": None, "eps": 0.0}),
    ],
)
def test_normalisation_and_transpose_are_muon_refs_bitwise(tns, device, shape, options):
    # steps=0 runs only the shared prologue (no Triton launch): X_0, transposed back, must be muon_ref's bits
    G = gaussian(shape, seed=3, device=device)
    got = tns.newton_schulz_triton(G, steps=0, **options)
    want = newton_schulz(G, steps=0, **options)
    assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)


def test_zero_matrix_maps_to_zero(tns, device):
    got = tns.newton_schulz_triton(torch.zeros(2, 20, 36, device=device), dtype=torch.float32, **TILES)
    assert torch.count_nonzero(got) == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": torch.float64}, "computes in one of"),
        ({"schedule": "aol"}, "preconditioner"),
        ({"eps_mode": "max"}, "eps_mode"),
    ],
)
def test_unsupported_options_are_the_callers_error(tns, device, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tns.newton_schulz_triton(torch.ones(4, 4, device=device), **kwargs)


@pytest.mark.parametrize("kernel, constexprs", [
    ("_symmetric_kernel", dict(HAS_ADDEND=False, PRECISION="tf32", BLOCK=64, BLOCK_K=32)),
    ("_symmetric_kernel", dict(HAS_ADDEND=True, PRECISION="tf32", BLOCK=64, BLOCK_K=32)),
    ("_update_kernel", dict(PRECISION="tf32", BLOCK_M=64, BLOCK_N=64, BLOCK_K=32)),
])
def test_bf16_kernels_compile_for_hopper_without_a_gpu(tns, kernel, constexprs):
    # the interpreter checks semantics, not what the compiler accepts: compile to an sm_90 cubin (no GPU needed)
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    with _imported_fresh(KERNEL_MODULE, {"TRITON_INTERPRET": "0"}) as compiled_module:
        fn = getattr(compiled_module, kernel)
        signature = {
            name: "constexpr" if name in constexprs else "*bf16" if name.endswith("_ptr")
            else "fp32" if name in ("alpha", "beta", "a") else "i32"
            for name in fn.arg_names
        }
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        options = {"enable_fp_fusion": compiled_module.FP_FUSION}
        binary = triton_compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert binary.asm["cubin"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the benchmark's exit on a machine without CUDA")
def test_benchmark_command_parses_its_shapes_and_exits_cleanly_without_cuda(capsys):
    # benchmarks/triton_ns.py is the kernel table of benchmarks/gpu.py (--parts kernels) under its old command
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_ns.py"
    spec = importlib.util.spec_from_file_location("benchmark_triton_ns", path)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    args = benchmark.gpu.parse_args(["--parts", "kernels", "--shapes", "8x1024x1024,64x96"])
    assert args.parts == ["kernels"] and args.shapes == [(8, 1024, 1024), (64, 96)]
    assert benchmark.main(["--shapes", "8x1024x1024,64x96", "--peak-tflops", "1979"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def _triton_muon_one_rank(inits: list[torch.Tensor], grads: list[torch.Tensor]) -> tuple[list, tuple]:
    """DistributedMuon(ns_backend="triton") on plain tensors, one in-process rank, in this thread (Triton's
    interpreter refused kernels launched from other threads here: "Did you forget to add @triton.jit ?")."""
    from muon_dist import DistributedMuon, ThreadComm, ThreadWorld

    params = [torch.nn.Parameter(t.clone()) for t in inits]
    opt = DistributedMuon(params, preset="torch", comm=ThreadComm(ThreadWorld(1), 0), ns_backend="triton",
                          ns_dtype=torch.float32)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    return [p.detach() for p in params], opt.last_report.paths


def test_distributed_muon_runs_the_triton_kernel_within_its_tolerance(tns, device, monkeypatch):
    # the update is lr * s * O: the kernel's 1e-5 fp32 bound on O becomes lr * s * 1e-5 on the params, plus one
    # fp32 ulp of the param (a smaller change of O can still move the param's final rounding by one ulp)
    from muon_ref import Muon

    calls, real = [], tns.newton_schulz_triton
    monkeypatch.setattr(tns, "newton_schulz_triton", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    # on the kernel's device: CUDA when there is one (the compiled kernel), the CPU under the interpreter
    inits = [gaussian((24, 16), 10 + i, device) for i in range(2)]
    grads = [gaussian((24, 16), 20 + i, device) for i in range(2)]
    got = [_triton_muon_one_rank(inits, grads)]
    assert calls == [(1, 24, 16)] * 2  # the Triton kernel ran, once per param (the option is not ignored)
    refs = [torch.nn.Parameter(t.clone()) for t in inits]
    ref_opt = Muon(refs, preset="torch", ns_dtype=torch.float32)
    for p, g in zip(refs, grads):
        p.grad = g.clone()
    ref_opt.step()
    for params, paths in got:
        assert {p for _, p in paths} == {"replicated"}
        for p, r in zip(params, refs):
            bound = 1e-3 * (24 / 16) ** 0.5 * 1e-5 + torch.finfo(torch.float32).eps * float(r.detach().abs().max())
            assert max_abs_difference(p, r.detach()) <= bound


def test_an_unknown_kernel_backend_is_refused():
    from muon_dist.kernels import backend

    with pytest.raises(ValueError, match="ns_backend must be one of"):
        backend("cuda")
