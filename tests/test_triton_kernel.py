"""The Triton Newton-Schulz kernel (muon_dist/kernels/triton_ns.py) against muon_ref.newton_schulz: its contract.

Without CUDA the kernels run in Triton's interpreter (fp32 and fp16 only: its bf16 tl.dot is wrong), about
1 s per call at these sizes, with the interpreter's one config; each autotuned config runs there through an
autotuner of its own, and compiles to an sm_90 cubin (no GPU needed). bf16 and larger shapes are checked on CUDA
in tests/gpu/test_triton_gpu.py and tests/gpu/test_kernels_gpu.py.
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

from muon_dist.kernels.contracts import measure
from muon_ref import MuonConfig, newton_schulz

KERNEL_MODULE = "muon_dist.kernels.triton_ns"
# muon_dist/kernels/triton_ns.py contract on Gaussian inputs: measured at most 1.4e-6 (fp32) and 7.3e-4 (fp16)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3}
CASES = [  # (shape, schedule): wide, tall, square, batched tall, two leading dims; every schedule in both dtypes
    ((48, 80), "keller"),
    ((80, 48), "you5"),
    ((40, 40), "polar_express"),
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


def interpreter_blocked(module: ModuleType) -> str | None:
    """Why Triton's interpreter cannot run the kernels in this environment, or None (always None on CUDA). One
    cause is known, and only it is accepted: triton before triton-lang/triton#9172 converts 1-element arrays with
    int(), which numpy >= 2.4 refuses (triton-lang/triton#9171; torch 2.9 pins triton 3.5.1, measured here to
    fail under numpy 2.4.6 and pass under 2.3.5). Any other error fails the probe."""
    if not module.INTERPRETED:
        return None
    try:
        module.newton_schulz_triton(torch.ones(2, 3), "keller", dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - narrowed below, anything else is re-raised
        import numpy
        import triton

        numpy_version = tuple(int(x) for x in numpy.__version__.split(".")[:2])
        if "only 0-dimensional arrays can be converted to Python scalars" not in str(
            e
        ) or numpy_version < (2, 4):
            raise
        return (
            f"triton {triton.__version__}'s interpreter cannot run under numpy {numpy.__version__} "
            f"(triton-lang/triton#9171, fixed by #9172): pip install 'numpy<2.4' to run these CPU checks; "
            f"compiled CUDA kernels are unaffected"
        )
    return None


@pytest.fixture(scope="module")
def interpreted(tns) -> ModuleType:
    """The kernel module, for tests that launch the kernels: skipped only where interpreter_blocked names why."""
    reason = interpreter_blocked(tns)
    if reason:
        pytest.skip(reason)
    return tns


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
def test_kernel_matches_reference_to_the_stated_tolerance(
    interpreted, device, shape, schedule, dtype
):
    G = gaussian(shape, seed=len(shape) + sum(shape), device=device)
    got = interpreted.newton_schulz_triton(
        G, schedule, dtype=dtype
    )  # the interpreter's one config: 32/16 tiles
    # muon_ref's default step form (addmm) rounds b A + c A A once, as the kernel does: the tightest reference
    assert max_abs_difference(got, newton_schulz(G, schedule, dtype=dtype)) <= TOLERANCE[dtype]


@pytest.mark.parametrize(
    "dtype, relative_error", [(torch.float32, 1e-4), (torch.float16, 1e-2)], ids=str
)
def test_a_kernel_with_a_wrong_coefficient_fails_the_comparison(
    interpreted, device, monkeypatch, dtype, relative_error
):
    # negative control, measured: `a` off by 1e-4 moves the fp32 output by 5.4e-4 (54x its tolerance), off by
    # 1e-2 the fp16 output by 4.4e-2 (11x); a 1e-3 error in fp16 (5.4e-3) would be too close to 4e-3 to be a control
    correct_update = interpreted.quintic_update
    wrong_update = lambda B, X, a, **kw: correct_update(B, X, a * (1 + relative_error), **kw)  # noqa: E731
    monkeypatch.setattr(interpreted, "quintic_update", wrong_update)
    G = gaussian((64, 96), seed=0, device=device)
    got = interpreted.newton_schulz_triton(G, "keller", dtype=dtype)
    assert max_abs_difference(got, newton_schulz(G, "keller", dtype=dtype)) > TOLERANCE[dtype]


# the contract on the harder inputs (square, rank 4 + noise, singular values 1..1e-6, rank one): measured at most
# 1.1e-4 (fp32) and 3.9e-2 (fp16), both polar_express on rank one (its 8 steps amplify most: product of a_t 6.4e3)
HARD_TOLERANCE = {torch.float32: 3e-4, torch.float16: 8e-2}
# signed singular values, measured (triton_ns.py): Gaussians with keller [0.6814, 1.134]; every kind and schedule
# [-0.2836, 1.172]; margin 4 fp16 ulps of 1 (2^-10 each)
GAUSSIAN_KELLER_BAND, HARD_BAND, BAND_MARGIN = (0.6814, 1.134), (-0.2836, 1.172), 4 * 2.0**-10
CONTRACT_RUNS = {  # (kind, schedule, dtype, seed): the worst measured seeds of rank one, and a Gaussian stack
    ("gaussian", "keller", torch.float16, 0),
    ("rank_one", "polar_express", torch.float32, 6),  # measured: 1.1e-4
    ("rank_one", "polar_express", torch.float16, 7),  # measured: 3.9e-2
}


@pytest.fixture(scope="module")
def contract_runs(interpreted, device) -> dict[tuple, dict[str, float]]:
    """muon_dist.kernels.contracts.measure of the "triton" backend on CONTRACT_RUNS (one interpreter run each)."""
    return {
        (kind, schedule, dtype, seed): measure(
            "triton",
            MuonConfig(schedule=schedule, ns_dtype=dtype),
            kind,
            range(seed, seed + 1),
            64,
            torch.device(device),
        )
        for kind, schedule, dtype, seed in CONTRACT_RUNS
    }


@pytest.mark.parametrize("case", sorted(CONTRACT_RUNS, key=str), ids=str)
def test_the_backend_meets_its_tolerance_on_the_measured_inputs(contract_runs, case):
    kind, _, dtype, _ = case
    assert (
        contract_runs[case]["difference"]
        <= (TOLERANCE if kind == "gaussian" else HARD_TOLERANCE)[dtype]
    )


@pytest.mark.parametrize("case", sorted(CONTRACT_RUNS, key=str), ids=str)
def test_the_backends_signed_singular_values_stay_in_the_measured_bands(contract_runs, case):
    r = contract_runs[case]
    low, high = GAUSSIAN_KELLER_BAND if case[0] == "gaussian" else HARD_BAND
    assert low - BAND_MARGIN <= r["low"] and r["high"] <= high + BAND_MARGIN, r


def test_a_kernel_with_a_wrong_coefficient_leaves_the_band(interpreted, device, monkeypatch):
    # negative control of the band: `a` 5% low in every step drops the smallest signed singular value of this
    # Gaussian stack from 0.682 to 0.501 (measured), far below the keller band
    correct_update = interpreted.quintic_update
    monkeypatch.setattr(
        interpreted, "quintic_update", lambda B, X, a, **kw: correct_update(B, X, a * 0.95, **kw)
    )
    r = measure(
        "triton", MuonConfig(ns_dtype=torch.float16), "gaussian", range(1), 64, torch.device(device)
    )
    low, high = GAUSSIAN_KELLER_BAND
    assert not (low - BAND_MARGIN <= r["low"] and r["high"] <= high + BAND_MARGIN)


def assert_within_gemm_error_bound(
    got: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, terms: int
) -> None:
    """|got - exact| <= terms * u32 * magnitude + u * |exact| elementwise (Higham, Accuracy and Stability of
    Numerical Algorithms, 2002, eq. 3.5): fp32 accumulation of `terms` products of total size `magnitude`
    (|X| |X|^T for a Gram), then one rounding to got's dtype (unit roundoff u)."""
    u32, u = torch.finfo(torch.float32).eps / 2, torch.finfo(got.dtype).eps / 2
    bound = terms * u32 * magnitude + u * exact.abs()
    excess = (got.double() - exact).abs() - bound
    assert excess.max() <= 0, f"error exceeds the bound by {excess.max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gram_is_exactly_symmetric_and_equals_x_xt_to_rounding(interpreted, device, dtype):
    X = gaussian((2, 90, 20), seed=1, device=device).to(
        dtype
    )  # explicit block 16: 6 x 6 tiles, 21 computed
    A = interpreted.symmetric_product(X, block=16, block_k=16)
    assert torch.equal(A, A.mT)
    assert_within_gemm_error_bound(
        A, X.double() @ X.double().mT, X.abs().double() @ X.abs().double().mT, 20
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_fused_polynomial_is_exactly_symmetric_and_equals_b_a_plus_c_a_a_to_rounding(
    interpreted, device, dtype
):
    X = (
        gaussian((1, 40, 24), seed=2, device=device).to(dtype) / 8
    )  # |A| ~ 0.4: the range NS works in
    A = interpreted.symmetric_product(X)
    b, c = -4.775, 2.0315  # KellerJordan/Muon muon.py
    B = interpreted.symmetric_product(A, alpha=c, beta=b, addend=A)
    assert torch.equal(B, B.mT)
    A64 = A.double()
    want = b * A64 + c * A64 @ A64
    assert_within_gemm_error_bound(
        B, want, abs(b) * A64.abs() + abs(c) * A64.abs() @ A64.abs(), 40 + 2
    )


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


def test_zero_matrix_maps_to_zero(interpreted, device):
    got = interpreted.newton_schulz_triton(
        torch.zeros(2, 20, 36, device=device), dtype=torch.float32
    )
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


# NVIDIA Hopper Tuning Guide: up to 227 KB of shared memory per thread block on an H100
H100_SHARED_BYTES_PER_BLOCK = 227 * 1024
# what a launch on contiguous tensors specialises: unit strides become constants, pointers and the other ints (sizes
# and strides that are multiples of 16, as in every shape the benchmark times) are marked divisible by 16
UNIT_STRIDES = ("sxk", "soc", "sbc", "sxc")


def compile_for_hopper(fn, config, dtype: str, **constexprs):
    """fn compiled to an sm_90 cubin at config, as a launch on contiguous `dtype` tensors specialises it (no GPU)."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {
        **constexprs,
        **config.kwargs,
        **{name: 1 for name in UNIT_STRIDES if name in fn.arg_names},
        "PRECISION": "ieee" if dtype == "fp32" else "tf32",
    }
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("alpha", "beta", "a"):
            signature[name] = "fp32"
        else:
            signature[name] = f"*{dtype}" if name.endswith("_ptr") else "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {
        "enable_fp_fusion": False,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }
    return triton_compile(source, target=GPUTarget("cuda", 90, 32), options=options)


@pytest.fixture
def compiled_module(tns) -> Iterator[ModuleType]:
    """The kernel module as a GPU imports it (TRITON_INTERPRET=0: compiled kernels, the autotuned configs), for one
    test only: afterwards `muon_dist.kernels.triton_ns` is the interpreter's module again."""
    # Triton imports its code generator at the first compile that misses its cache, and that import asserts that
    # triton.language's functions were built for the mode TRITON_INTERPRET says now: import it in tns's mode
    importlib.import_module("triton.compiler.code_generator")
    with _imported_fresh(KERNEL_MODULE, {"TRITON_INTERPRET": "0"}) as module:
        yield module


@pytest.mark.parametrize("index", range(4), ids=lambda i: f"config{i}")
@pytest.mark.parametrize(
    "kernel, constexprs",
    [("_symmetric_kernel", {"HAS_ADDEND": True}), ("_update_kernel", {})],
    ids=["symmetric", "update"],
)
def test_every_autotuned_config_compiles_for_hopper_in_bf16_and_fits_its_shared_memory(
    compiled_module, kernel, constexprs, index
):
    # the interpreter checks semantics, not what the compiler accepts. HAS_ADDEND=True's code contains the False
    # variant's. Cold cache: 1-3 s per compile here; Triton caches the cubins (~/.triton/cache)
    assert len(compiled_module.CONFIGS) == 4 and not compiled_module.INTERPRETED
    config = compiled_module.CONFIGS[index]
    binary = compile_for_hopper(getattr(compiled_module, kernel), config, "bf16", **constexprs)
    assert binary.asm["cubin"]
    # a pipeline stage holds a BLOCK x BLOCK_K bf16 tile of each operand: pipelined as intended, and it fits
    # (triton 3.9 here: exactly num_stages stages; fp32 tiles are twice as large, so the 128/64, 4-stage config
    # needs 256 KiB and the autotuner skips it in fp32 as out of resources)
    stage_bytes = 2 * config.kwargs["BLOCK"] * config.kwargs["BLOCK_K"] * 2
    assert (
        (config.num_stages - 1) * stage_bytes
        <= binary.metadata.shared
        <= H100_SHARED_BYTES_PER_BLOCK
    )


@pytest.mark.parametrize("index", range(4), ids=lambda i: f"config{i}")
def test_every_autotuned_config_meets_the_fp16_tolerance_in_the_interpreter(
    interpreted, device, monkeypatch, index
):
    # each config as the autotuner launches it (its launch parameters, the grid from its BLOCK): the interpreter
    # cannot time several configs, so each gets an autotuner of its own. 40 x 72: no BLOCK divides either side.
    # fp16 has the smaller margin (measured 7.3e-4 against 4e-3; fp32 6.6e-7 to 7.2e-7 against 1e-5)
    config = interpreted.CONFIGS[index]
    monkeypatch.setattr(interpreted, "TUNED", interpreted.Tuned.over([config]))
    G = gaussian((40, 72), seed=5, device=device)
    got = interpreted.newton_schulz_triton(G, dtype=torch.float16)
    assert (
        interpreted.TUNED.symmetric.best_config == config
        and interpreted.TUNED.update.best_config == config
    )
    assert (
        max_abs_difference(got, newton_schulz(G, dtype=torch.float16)) <= TOLERANCE[torch.float16]
    )


def test_the_grids_cover_a_size_that_no_block_divides(tns):
    assert tns.triangle_grid(100, 3)({"BLOCK": 64}) == (
        3,
        3,
    )  # tiles (0,0), (1,0), (1,1) of a 2 x 2 grid
    assert tns.triangle_grid(100, 3)({"BLOCK": 128}) == (1, 3)
    assert tns.update_grid(40, 72, 2)({"BLOCK": 64}) == (1, 2, 2)


def test_a_grid_that_drops_the_ragged_tiles_fails_the_gram_check(interpreted, device, monkeypatch):
    # negative control of the grid: rounding the tile count down leaves the ragged rows of A unwritten
    monkeypatch.setattr(
        interpreted,
        "triangle_grid",
        lambda R, batch: lambda meta: ((R // meta["BLOCK"]) * (R // meta["BLOCK"] + 1) // 2, batch),
    )
    X = gaussian((1, 40, 24), seed=1, device=device)
    A = interpreted.symmetric_product(X)  # 32 x 32 tiles: only the tile (0, 0) is computed
    assert not torch.allclose(A[:, 32:, :], (X @ X.mT)[:, 32:, :], atol=1e-3)


@pytest.mark.parametrize(
    "tiles, message",
    [
        ({"block": 48, "block_k": 16}, "block must be a power of two"),
        ({"block": 64}, "block_k must be a power of two"),
        ({"num_warps": 8}, "block must be a power of two"),
        ({"block": 64, "block_k": 8}, "block_k must be a power of two"),
    ],
)
def test_explicit_tiles_that_triton_cannot_launch_are_the_callers_error(
    tns, device, tiles, message
):
    with pytest.raises(ValueError, match=message):
        tns.newton_schulz_triton(torch.ones(4, 4, device=device), **tiles)


def test_a_stack_larger_than_cudas_grid_is_the_callers_error(tns, device):
    with pytest.raises(ValueError, match="exceeds CUDA's grid"):
        tns.symmetric_product(torch.ones(tns.MAX_BATCH + 1, 1, 1, device=device))


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the benchmark's exit on a machine without CUDA"
)
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


def _triton_muon_one_rank(
    inits: list[torch.Tensor], grads: list[torch.Tensor]
) -> tuple[list, tuple]:
    """DistributedMuon(ns_backend="triton") on plain tensors, one in-process rank, in this thread (Triton's
    interpreter refused kernels launched from other threads here: "Did you forget to add @triton.jit ?")."""
    from muon_dist import DistributedMuon, ThreadComm, ThreadWorld

    params = [torch.nn.Parameter(t.clone()) for t in inits]
    opt = DistributedMuon(
        params,
        preset="torch",
        comm=ThreadComm(ThreadWorld(1), 0),
        ns_backend="triton",
        ns_dtype=torch.float32,
    )
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    return [p.detach() for p in params], opt.last_report.paths


def test_distributed_muon_runs_the_triton_kernel_within_its_tolerance(
    interpreted, device, monkeypatch
):
    # the update is lr * s * O: the kernel's 1e-5 fp32 bound on O becomes lr * s * 1e-5 on the params, plus one
    # fp32 ulp of the param (a smaller change of O can still move the param's final rounding by one ulp)
    from muon_ref import Muon

    calls, real = [], interpreted.newton_schulz_triton
    monkeypatch.setattr(
        interpreted,
        "newton_schulz_triton",
        lambda *a, **k: calls.append(a[0].shape) or real(*a, **k),
    )
    # on the kernel's device: CUDA when there is one (the compiled kernel), the CPU under the interpreter
    inits = [gaussian((24, 16), 10 + i, device) for i in range(2)]
    grads = [gaussian((24, 16), 20 + i, device) for i in range(2)]
    got = [_triton_muon_one_rank(inits, grads)]
    assert (
        calls == [(1, 24, 16)] * 2
    )  # the Triton kernel ran, once per param (the option is not ignored)
    refs = [torch.nn.Parameter(t.clone()) for t in inits]
    ref_opt = Muon(refs, preset="torch", ns_dtype=torch.float32)
    for p, g in zip(refs, grads):
        p.grad = g.clone()
    ref_opt.step()
    for params, paths in got:
        assert {p for _, p in paths} == {"replicated"}
        for p, r in zip(params, refs):
            bound = 1e-3 * (24 / 16) ** 0.5 * 1e-5 + torch.finfo(torch.float32).eps * float(
                r.detach().abs().max()
            )
            assert max_abs_difference(p, r.detach()) <= bound


def test_an_unknown_kernel_backend_is_refused():
    from muon_dist.kernels import backend

    with pytest.raises(ValueError, match="ns_backend must be one of"):
        backend("cuda")
