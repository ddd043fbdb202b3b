"""Newton-Schulz with Triton GEMMs: muon_ref.newton_schulz with its per-step matmuls replaced.

Reference equation, for G [..., m, n] and the same arguments (muon_ref's default step_form "addmm"):
    newton_schulz_triton(G, ...) == newton_schulz(G, ...)     up to the tolerance below
For a stack X_0 of shape [batch, m, n] with m <= n (muon_ref's transpose decision), each step is
    A       = X X^T                  _symmetric_kernel(X, alpha=1, beta=0): lower triangle of tiles, mirrored
    B       = b A + c A A            _symmetric_kernel(A, alpha=c, beta=b, addend=A): A A = A A^T, A symmetric
    X_next  = a X + B X              _update_kernel
one program per output tile and one grid axis per matrix of the stack (expert stacks run in one launch). Only
tiles (i, j) with j <= i of A and B are computed; each is written twice (at (i, j) and, transposed, at (j, i)),
the same rounded values, so A and B are exactly symmetric. Products accumulate in fp32 and are rounded once to
the compute dtype after the epilogue (b A and a X are added in fp32; FMA contraction off). fp32 operands use
input_precision="ieee" (no TF32), as torch's default fp32 matmul does.

Tiles: on CUDA both kernels are autotuned (triton.autotune over CONFIGS, keyed on the matrix sizes and dtype: the
first call at a new size compiles and times the 4 configs); in Triton's interpreter, which cannot time configs,
the autotuner has the one INTERPRETER_CONFIG (32 / 16); explicit tiles (block, block_k, num_warps, num_stages)
bypass the autotuner (benchmarks/gpu.py --triton-tiles). The bits therefore depend on the config the autotuner
picks (by timing, per process, so two processes may differ): the contract is stated for every config, and each is
checked (tests/test_triton_kernel.py in the interpreter, tests/gpu/test_triton_gpu.py on CUDA).

Everything that is not a per-step matmul is muon_ref's own code: the schedule (get_schedule(...).steps_for),
the eps and safety defaults (muon_ref.resolve_ns_options), the transpose decision and the normalisation
(muon_ref.normalise, on the same views in the same dtype), so newton_schulz_triton(G, steps=0) equals
newton_schulz(G, steps=0) bitwise.

Contract: a tolerance, not bits: the GEMMs sum in another order (tiles of BLOCK_K, fp32 accumulators), and the
steps amplify the different roundings, most along small singular values, where f' reaches the product of the
a_t (keller 4.8e2, polar_express 6.4e3). Against muon_ref.newton_schulz with the same arguments, max |difference|:
    Gaussian inputs:    <= 1e-5 (float32), 4e-3 (float16); measured at most 1.4e-6 and 7.3e-4
    every input kind measured (also square, rank 4 + noise, singular values 1..1e-6, rank one):
                        <= 3e-4 (float32), 8e-2 (float16); measured at most 1.1e-4 and 3.9e-2 (rank one)
step_form "addmm" is the tightest reference: torch's addmm computes b A + c A A in one call, as the fused
epilogue does, while "keller" and "dion" round c A (or A A) and the sum separately.
Signed singular values against the exact polar factor (muon_ref.signed_singular_values): muon_ref's band to within
the difference; measured on Gaussians with keller [0.6814, 1.134], on every kind and schedule [-0.2836, 1.172]
(both ends muon_ref's too); asserted with 4 fp16 ulps of 1 of margin.
Measured in Triton's interpreter (float32, float16) by `python -m muon_dist.kernels.contracts --backends triton`;
asserted by tests/test_triton_kernel.py (Gaussian cases, the worst measured rank-one inputs, the bands, each
config's tiles). The measurements: docs/kernels.md, "The Triton kernel's tolerance".
On CUDA, tests/gpu/test_triton_gpu.py and tests/gpu/test_kernels_gpu.py assert float32 the bounds above and
bfloat16 3.2e-2, a priori (the float16 bound times 2^3 for bf16's 3 fewer mantissa bits), with muon_ref's bf16
bands widened by 4 bf16 ulps of 1: the interpreter cannot check bf16 (its bf16 tl.dot is wrong and its
fp32 -> bf16 cast truncates: docs/testing.md).
Not supported: the AOL preconditioner (schedules that set it raise ValueError) and float64.

References: KellerJordan/Muon muon.py (the step); microsoft/dion dion/newton_schulz_triton.py (ns_line_1 and
ns_line_2: X X^T and b A + c A A on one triangle of blocks, mirrored; its autotune space).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

from muon_ref import MuonConfig, resolve_ns_options
from muon_ref.newton_schulz import EPS_MODES, EpsMode, initial_iterate
from muon_ref.schedules import Schedule, get_schedule

from . import Backend, over_stacks, own_step_kwargs

# triton.jit builds interpreter kernels iff TRITON_INTERPRET=1 when it decorates: for the kernels below, when
# this module is imported; for triton.language's own jit functions (tl.zeros, tl.cdiv, ...), when triton is.
# The kernels call builtins only (tl.full, not tl.zeros), so they run whenever this module saw the variable.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
# no FMA contraction in the epilogues: the GPU rounds alpha * acc + beta * add as the interpreter (numpy) does,
# whatever the Triton version's default (it changes in 3.10, triton/knobs.py FP_FUSION_DEFAULT_WARNING)
FP_FUSION: bool = False
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _triangle_tile(t):
    """The t-th tile (i, j), j <= i, of a lower triangle in row-major order: t = i (i + 1) / 2 + j."""
    i = ((tl.sqrt((8 * t + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    # the float estimate can be one off (approximate sqrt, rounding): correct it with integer arithmetic
    i = tl.where((i + 1) * (i + 2) // 2 <= t, i + 1, i)
    i = tl.where(i * (i + 1) // 2 > t, i - 1, i)
    return i, t - i * (i + 1) // 2


@triton.jit
def _symmetric_kernel(
    x_ptr,
    add_ptr,
    out_ptr,
    R,
    K,
    sxb,
    sxr,
    sxk,
    sob,
    sor,
    soc,
    alpha,
    beta,
    HAS_ADDEND: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[z] = beta * add[z] + alpha * x[z] x[z]^T for x[z] of shape (R, K); add shares out's strides.

    Grid (T (T + 1) / 2, batch), T = cdiv(R, BLOCK): one program per tile (i, j), j <= i (triangle_grid). add must be
    symmetric (it is A, written by this kernel), so its lower tile is all the epilogue needs.
    """
    i, j = _triangle_tile(tl.program_id(0))
    z = tl.program_id(1).to(tl.int64)
    rows_i = i * BLOCK + tl.arange(0, BLOCK)
    rows_j = j * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_K)
    x_i = x_ptr + z * sxb + rows_i[:, None] * sxr + ks[None, :] * sxk  # (BLOCK, BLOCK_K), rows i
    x_j = x_ptr + z * sxb + rows_j[:, None] * sxr + ks[None, :] * sxk  # (BLOCK, BLOCK_K), rows j
    acc = tl.full((BLOCK, BLOCK), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        in_k = ks[None, :] + k0 < K
        lhs = tl.load(x_i, mask=(rows_i[:, None] < R) & in_k, other=0.0)
        rhs = tl.load(x_j, mask=(rows_j[:, None] < R) & in_k, other=0.0)
        acc = tl.dot(lhs, tl.trans(rhs), acc, input_precision=PRECISION)
        x_i += BLOCK_K * sxk
        x_j += BLOCK_K * sxk
    inside = (rows_i[:, None] < R) & (rows_j[None, :] < R)
    acc = alpha * acc
    if HAS_ADDEND:
        add = tl.load(
            add_ptr + z * sob + rows_i[:, None] * sor + rows_j[None, :] * soc,
            mask=inside,
            other=0.0,
        )
        acc += beta * add.to(tl.float32)
    val = acc.to(out_ptr.dtype.element_ty)
    # entry (r, c) of this tile goes to (r, c) if r >= c and to (c, r) if r > c: on a diagonal tile the upper
    # half is the transposed lower half, so every entry of the output has exactly one writer
    out = out_ptr + z * sob
    lower = rows_i[:, None] >= rows_j[None, :]
    strictly_lower = rows_i[:, None] > rows_j[None, :]
    tl.store(out + rows_i[:, None] * sor + rows_j[None, :] * soc, val, mask=inside & lower)
    tl.store(out + rows_j[None, :] * sor + rows_i[:, None] * soc, val, mask=inside & strictly_lower)


@triton.jit
def _update_kernel(
    b_ptr,
    x_ptr,
    out_ptr,
    R,
    C,
    sbb,
    sbr,
    sbc,
    sxb,
    sxr,
    sxc,
    sob,
    sor,
    soc,
    a,
    PRECISION: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[z] = a * x[z] + b[z] x[z] for b[z] of shape (R, R) and x[z] of shape (R, C).

    Grid (cdiv(R, BLOCK), cdiv(C, BLOCK), batch): update_grid.
    """
    z = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_K)
    b_tile = b_ptr + z * sbb + rows[:, None] * sbr + ks[None, :] * sbc
    x_tile = x_ptr + z * sxb + ks[:, None] * sxr + cols[None, :] * sxc
    acc = tl.full((BLOCK, BLOCK), 0.0, tl.float32)
    for k0 in range(0, R, BLOCK_K):
        lhs = tl.load(b_tile, mask=(rows[:, None] < R) & (ks[None, :] + k0 < R), other=0.0)
        rhs = tl.load(x_tile, mask=(ks[:, None] + k0 < R) & (cols[None, :] < C), other=0.0)
        acc = tl.dot(lhs, rhs, acc, input_precision=PRECISION)
        b_tile += BLOCK_K * sbc
        x_tile += BLOCK_K * sxr
    inside = (rows[:, None] < R) & (cols[None, :] < C)
    x = tl.load(x_ptr + z * sxb + rows[:, None] * sxr + cols[None, :] * sxc, mask=inside, other=0.0)
    acc += a * x.to(tl.float32)
    out = out_ptr + z * sob + rows[:, None] * sor + cols[None, :] * soc
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=inside)


# Autotuned launch parameters, (BLOCK, BLOCK_K) with num_warps and num_stages, one list for both kernels (each is
# tuned alone, per matrix size and dtype): 64/32/4 and 128/64/8 were each the faster on some shapes when timed with
# fixed tiles on an H100; the other two come from the space microsoft/dion dion/newton_schulz_triton.py autotunes,
# not timed with this kernel (docs/gpu.md, "The Triton kernel's tiles"). Four configs keep a new shape's first call
# short (each config is compiled and timed once). Shared memory per block, num_stages x 2 tiles of BLOCK x BLOCK_K
# (compiled for sm_90 in tests/test_triton_kernel.py): in bf16 24-128 KiB; in fp32 twice that, so the last needs
# 256 KiB, more than an H100 block has (227 KB), and the autotuner skips it in fp32 (its launch raises
# OutOfResources, which triton.autotune times as infinite).
CONFIGS: tuple[triton.Config, ...] = (
    triton.Config({"BLOCK": 64, "BLOCK_K": 32}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK": 128, "BLOCK_K": 64}, num_warps=4, num_stages=4),
)
# the interpreter cannot time configs (the autotuner needs a GPU driver), so it gets one: several tiles per test
# matrix, ragged edges, and few enough programs to stay near 1 s per call
INTERPRETER_CONFIG = triton.Config({"BLOCK": 32, "BLOCK_K": 16}, num_warps=4, num_stages=3)
# CUDA's largest y- and z-dimension of a grid (CUDA C++ Programming Guide, compute capabilities table): the batch axis
MAX_BATCH = 65535


@dataclass(frozen=True)
class Tuned:
    """The two kernels behind triton.autotune over `configs`, keyed on the matrix sizes (the autotuner adds the
    tensors' dtypes to the key). Tuning times a config by launching it repeatedly on the call's own tensors: safe
    here because no kernel reads what it writes (out is always a fresh tensor, distinct from x, add, b)."""

    symmetric: Autotuner
    update: Autotuner

    @staticmethod
    def over(configs: Sequence[triton.Config]) -> "Tuned":
        return Tuned(
            triton.autotune(configs=list(configs), key=["R", "K", "HAS_ADDEND"])(_symmetric_kernel),
            triton.autotune(configs=list(configs), key=["R", "C"])(_update_kernel),
        )


TUNED = Tuned.over((INTERPRETER_CONFIG,) if INTERPRETED else CONFIGS)


def explicit_tiles(
    block: int | None, block_k: int | None, num_warps: int | None, num_stages: int | None
) -> dict[str, int] | None:
    """The launch parameters for explicit tiles, or None (all four None) for the autotuned ones.

    ValueError when only some are given without block and block_k, or when block or block_k is not a power of
    two >= 16 (tl.dot's smallest operand side). num_warps and num_stages default to triton.Config's 4 and 3.
    """
    if block is None and block_k is None and num_warps is None and num_stages is None:
        return None
    for name, value in (("block", block), ("block_k", block_k)):
        if not (isinstance(value, int) and value >= 16 and value & (value - 1) == 0):
            raise ValueError(
                f"{name} must be a power of two >= 16 (explicit tiles need block and block_k), "
                f"got {value!r}"
            )
    return dict(
        BLOCK=block,
        BLOCK_K=block_k,
        num_warps=4 if num_warps is None else num_warps,
        num_stages=3 if num_stages is None else num_stages,
    )


def triangle_grid(R: int, batch: int) -> Callable[[dict], tuple[int, int]]:
    """_symmetric_kernel's grid for the launch parameters `meta`: T (T + 1) / 2 lower tiles, T = cdiv(R, BLOCK)."""

    def grid(meta: dict) -> tuple[int, int]:
        num_tiles = triton.cdiv(R, meta["BLOCK"])
        return num_tiles * (num_tiles + 1) // 2, batch

    return grid


def update_grid(R: int, C: int, batch: int) -> Callable[[dict], tuple[int, int, int]]:
    """_update_kernel's grid for the launch parameters `meta`: every BLOCK x BLOCK tile of the R x C output."""
    return lambda meta: (triton.cdiv(R, meta["BLOCK"]), triton.cdiv(C, meta["BLOCK"]), batch)


def _launch(
    kernel: JITFunction,
    tuned: Autotuner,
    grid: Callable[[dict], tuple[int, ...]],
    batch: int,
    args: tuple,
    tiles: dict[str, int] | None,
    **constexprs: object,
) -> None:
    """kernel at explicit tiles, or its autotuned version; the grid reads BLOCK from the chosen parameters."""
    if batch > MAX_BATCH:
        raise ValueError(
            f"a stack of {batch} matrices exceeds CUDA's grid (at most {MAX_BATCH} on the batch axis)"
        )
    if tiles is None:
        tuned[grid](*args, **constexprs, enable_fp_fusion=FP_FUSION)
    else:
        kernel[grid](*args, **constexprs, **tiles, enable_fp_fusion=FP_FUSION)


def symmetric_product(
    X: Tensor,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    addend: Tensor | None = None,
    block: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> Tensor:
    """beta * addend + alpha * X X^T for X of shape [batch, R, K], exactly symmetric, in X's dtype.

    addend (shape [batch, R, R], contiguous, symmetric) is required iff beta != 0. Tiles: explicit_tiles.
    """
    batch, R, K = X.shape
    out = torch.empty(batch, R, R, dtype=X.dtype, device=X.device)
    if addend is None and beta != 0.0:
        raise ValueError("symmetric_product: beta != 0 needs an addend")
    if addend is not None and (addend.shape != out.shape or not addend.is_contiguous()):
        raise ValueError(
            f"symmetric_product: addend must be contiguous of shape {tuple(out.shape)}"
        )
    args = (
        X,
        out if addend is None else addend,
        out,
        R,
        K,
        *X.stride(),
        *out.stride(),
        alpha,
        beta,
    )
    _launch(
        _symmetric_kernel,
        TUNED.symmetric,
        triangle_grid(R, batch),
        batch,
        args,
        explicit_tiles(block, block_k, num_warps, num_stages),
        HAS_ADDEND=addend is not None,
        PRECISION=_precision(X.dtype),
    )
    return out


def quintic_update(
    B: Tensor,
    X: Tensor,
    a: float,
    *,
    block: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> Tensor:
    """a X + B X for B of shape [batch, R, R] and X of shape [batch, R, C], in X's dtype. Tiles: explicit_tiles."""
    batch, R, C = X.shape
    out = torch.empty_like(X, memory_format=torch.contiguous_format)
    args = (B, X, out, R, C, *B.stride(), *X.stride(), *out.stride(), a)
    _launch(
        _update_kernel,
        TUNED.update,
        update_grid(R, C, batch),
        batch,
        args,
        explicit_tiles(block, block_k, num_warps, num_stages),
        PRECISION=_precision(X.dtype),
    )
    return out


def _precision(dtype: torch.dtype) -> str:
    # fp32: exact products as torch's default fp32 matmul; fp16/bf16 operands ignore the setting
    return "ieee" if dtype == torch.float32 else "tf32"


def newton_schulz_triton(
    G: Tensor,
    schedule: str | Schedule = "keller",
    *,
    steps: int | None = None,
    eps: float | None = None,
    dtype: torch.dtype | None = torch.bfloat16,
    eps_mode: EpsMode = "clamp",
    safety: float | None = None,
    normalize_before_cast: bool = False,
    block: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> Tensor:
    """Orthogonalise G of shape [..., m, n] like muon_ref.newton_schulz, with Triton GEMMs (module docstring).

    Arguments as muon_ref.newton_schulz (no step_form: the step is fused; no precondition). Tiles: none given,
    the autotuned ones (on CUDA; INTERPRETER_CONFIG in the interpreter); else explicit_tiles (block and block_k
    powers of two >= 16). Returns a new tensor [..., m, n] in the compute dtype.
    """
    sched = get_schedule(schedule)
    compute_dtype = G.dtype if dtype is None else dtype
    _check_arguments(G, compute_dtype, eps_mode, sched)
    options = resolve_ns_options(sched, steps, eps, safety)
    coefficients, eps, safety = options.coefficients, options.eps, options.safety
    explicit_tiles(block, block_k, num_warps, num_stages)  # the caller's mistakes, before any work
    m, n = G.shape[-2:]
    stack = G.reshape(math.prod(G.shape[:-2]), m, n)
    if stack.size(0) == 0:
        return torch.empty(G.shape, dtype=compute_dtype, device=G.device)
    transpose = m > n  # muon_ref's decision, on the matrix's own shape
    X = _initial_iterates(
        stack, transpose, compute_dtype, eps, eps_mode, safety, normalize_before_cast
    )
    tiles = dict(block=block, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    with torch.cuda.device(X.device) if X.is_cuda else contextlib.nullcontext():
        for a, b, c in coefficients if X.numel() else ():
            A = symmetric_product(X, **tiles)
            B = symmetric_product(A, alpha=c, beta=b, addend=A, **tiles)
            X = quintic_update(B, X, a, **tiles)
    return (X.mT if transpose else X).reshape(*G.shape[:-2], m, n)


def _check_arguments(G: Tensor, compute_dtype: torch.dtype, eps_mode: str, sched: Schedule) -> None:
    """ValueError for what this kernel cannot do, naming the argument (the caller's mistake)."""
    if G.ndim < 2:
        raise ValueError(
            f"newton_schulz_triton needs a matrix or a stack of matrices, got shape {tuple(G.shape)}"
        )
    if not G.is_floating_point():
        raise ValueError(f"newton_schulz_triton needs a real floating tensor, got dtype {G.dtype}")
    if compute_dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"newton_schulz_triton computes in one of {SUPPORTED_DTYPES}, got dtype {compute_dtype}"
        )
    if eps_mode not in EPS_MODES:
        raise ValueError(f"eps_mode must be one of {EPS_MODES}, got {eps_mode!r}")
    if sched.precondition is not None:
        raise ValueError(
            f"schedule {sched.name!r} uses the {sched.precondition!r} preconditioner, not supported here"
        )
    if not (G.is_cuda or INTERPRETED):
        raise ValueError(
            f"G is on {G.device}: Triton needs CUDA, or TRITON_INTERPRET=1 before importing {__name__}"
        )


def _initial_iterates(
    stack: Tensor,
    transpose: bool,
    compute_dtype: torch.dtype,
    eps: float,
    eps_mode: EpsMode,
    safety: float,
    normalize_before_cast: bool,
) -> Tensor:
    """X_0 of every matrix of stack [batch, m, n] as one contiguous [batch, min, max] tensor.

    muon_ref.newton_schulz_matrix's own lines on the same per-matrix views, so X_0 is muon_ref's bitwise: the
    norm of a transposed view sums in another order than that of a contiguous copy (on CPU, fp32, the two
    differed in the last bit for 221 of 300 random matrices up to 300 x 300).
    """
    views = [M.mT if transpose else M for M in stack]
    return torch.stack(
        [
            initial_iterate(V, compute_dtype, eps, eps_mode, safety, normalize_before_cast)
            for V in views
        ]
    )


def _stack_kernel(stack: Tensor, cfg: MuonConfig) -> Tensor:
    """A stack through newton_schulz_triton with the config's schedule, steps, eps, dtype, eps_mode, safety and
    normalisation (the fused step has no step_form; the AOL preconditioner is refused)."""
    return newton_schulz_triton(stack, **own_step_kwargs(cfg, "triton"))


BACKEND = Backend(
    "triton", over_stacks(_stack_kernel), bitwise=False, stack=_stack_kernel
)  # contract: this module's docstring
