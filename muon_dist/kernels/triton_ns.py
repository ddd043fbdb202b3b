"""Newton-Schulz with Triton GEMMs: muon_ref.newton_schulz with its per-step matmuls replaced.

For a stack of matrices X_0 of shape [batch, m, n] with m <= n (muon_ref's transpose decision), each step is
    A       = X X^T                  _symmetric_kernel(X, alpha=1, beta=0): lower triangle of tiles, mirrored
    B       = b A + c A A            _symmetric_kernel(A, alpha=c, beta=b, addend=A): A A = A A^T, A symmetric
    X_next  = a X + B X              _update_kernel
Only tiles (i, j) with j <= i of A and B are computed; each is written twice (at (i, j) and, transposed, at
(j, i)), the same rounded values, so A and B are exactly symmetric. Products accumulate in fp32 and are
rounded once to the compute dtype after the epilogue (b A and a X are added in fp32). fp32 operands use
input_precision="ieee" (no TF32), as torch's default fp32 matmul does.

Everything that is not a per-step matmul is muon_ref's own code: the schedule (get_schedule(...).steps_for),
the eps and safety defaults (muon_ref.resolve_ns_options), the transpose decision and the normalisation
(muon_ref.normalise, on the same views in the same dtype), so newton_schulz_triton(G, steps=0) equals
newton_schulz(G, steps=0) bitwise.

Contract against muon_ref.newton_schulz with the same arguments and its default step_form "addmm":
    max |newton_schulz_triton(G) - newton_schulz(G)| <= 1e-5 (float32), 4e-3 (float16)
a tolerance, not bits: the GEMMs sum in another order (tiles of BLOCK_K, fp32 accumulators), and five or more
steps of polynomials with a ~ 3.4 amplify the different roundings. "addmm" is the tightest reference: torch's
addmm agrees with the fused b A + c A A to one fp16 ulp (measured, CPU), while "keller" and "dion" round c A
(or A A) and the sum separately. Measured in Triton's interpreter, max over the cases of tests/test_triton_kernel.py
(shapes up to 64 x 96, batch 1-3, schedules keller, you5, polar_express, tiles 32 / 16):
    float32: 7.5e-7 vs "addmm", 8.1e-7 vs "keller", 7.8e-7 vs "dion"   (other seeds: up to 1.8e-6)
    float16: 9.8e-4 vs "addmm", 3.4e-3 vs "keller", 4.2e-3 vs "dion"   (9.8e-4: one ulp of fp16 in [0.5, 1))
bfloat16 is not checked on CPU (the interpreter's bf16 tl.dot is wrong and its fp32 -> bf16 cast truncates):
tests/gpu/test_triton_gpu.py checks it on CUDA against an a priori bound, not yet run on a GPU.
Not supported: the AOL preconditioner (schedules that set it raise ValueError) and float64.

References: KellerJordan/Muon muon.py (the step); microsoft/dion dion/newton_schulz_triton.py (ns_line_1 and
ns_line_2: X X^T and b A + c A A on one triangle of blocks, mirrored).
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from muon_ref import MuonConfig, normalise, resolve_ns_options
from muon_ref.newton_schulz import EPS_MODES, EpsMode
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
    x_ptr, add_ptr, out_ptr, R, K,
    sxb, sxr, sxk, sob, sor, soc,
    alpha, beta,
    HAS_ADDEND: tl.constexpr, PRECISION: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[z] = beta * add[z] + alpha * x[z] x[z]^T for x[z] of shape (R, K); add shares out's strides.

    Grid (T (T + 1) / 2, batch), T = cdiv(R, BLOCK): one program per tile (i, j), j <= i. add must be
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
        add = tl.load(add_ptr + z * sob + rows_i[:, None] * sor + rows_j[None, :] * soc, mask=inside, other=0.0)
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
    b_ptr, x_ptr, out_ptr, R, C,
    sbb, sbr, sbc, sxb, sxr, sxc, sob, sor, soc,
    a,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[z] = a * x[z] + b[z] x[z] for b[z] of shape (R, R) and x[z] of shape (R, C).

    Grid (cdiv(R, BLOCK_M), cdiv(C, BLOCK_N), batch).
    """
    z = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    b_tile = b_ptr + z * sbb + rows[:, None] * sbr + ks[None, :] * sbc
    x_tile = x_ptr + z * sxb + ks[:, None] * sxr + cols[None, :] * sxc
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
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


def symmetric_product(
    X: Tensor, *, alpha: float = 1.0, beta: float = 0.0, addend: Tensor | None = None,
    block: int = 64, block_k: int = 32, num_warps: int = 4,
) -> Tensor:
    """beta * addend + alpha * X X^T for X of shape [batch, R, K], exactly symmetric, in X's dtype.

    addend (shape [batch, R, R], contiguous, symmetric) is required iff beta != 0.
    """
    batch, R, K = X.shape
    out = torch.empty(batch, R, R, dtype=X.dtype, device=X.device)
    if addend is None and beta != 0.0:
        raise ValueError("symmetric_product: beta != 0 needs an addend")
    if addend is not None and (addend.shape != out.shape or not addend.is_contiguous()):
        raise ValueError(f"symmetric_product: addend must be contiguous of shape {tuple(out.shape)}")
    num_tiles = triton.cdiv(R, block)
    grid = (num_tiles * (num_tiles + 1) // 2, batch)
    _symmetric_kernel[grid](
        X, out if addend is None else addend, out, R, K, *X.stride(), *out.stride(), alpha, beta,
        HAS_ADDEND=addend is not None, PRECISION=_precision(X.dtype), BLOCK=block, BLOCK_K=block_k,
        num_warps=num_warps, enable_fp_fusion=FP_FUSION,
    )
    return out


def quintic_update(
    B: Tensor, X: Tensor, a: float, *, block: int = 64, block_k: int = 32, num_warps: int = 4
) -> Tensor:
    """a X + B X for B of shape [batch, R, R] and X of shape [batch, R, C], in X's dtype."""
    batch, R, C = X.shape
    out = torch.empty_like(X, memory_format=torch.contiguous_format)
    grid = (triton.cdiv(R, block), triton.cdiv(C, block), batch)
    _update_kernel[grid](
        B, X, out, R, C, *B.stride(), *X.stride(), *out.stride(), a,
        PRECISION=_precision(X.dtype), BLOCK_M=block, BLOCK_N=block, BLOCK_K=block_k, num_warps=num_warps,
        enable_fp_fusion=FP_FUSION,
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
    block: int = 64,
    block_k: int = 32,
    num_warps: int = 4,
) -> Tensor:
    """Orthogonalise G of shape [..., m, n] like muon_ref.newton_schulz, with Triton GEMMs (module docstring).

    Arguments as muon_ref.newton_schulz (no step_form: the step is fused; no precondition); block and
    block_k are the tile sizes (powers of two >= 16). Returns a new tensor [..., m, n] in the compute dtype.
    """
    sched = get_schedule(schedule)
    compute_dtype = G.dtype if dtype is None else dtype
    _check_arguments(G, compute_dtype, eps_mode, sched)
    options = resolve_ns_options(sched, steps, eps, safety)
    coefficients, eps, safety = options.coefficients, options.eps, options.safety
    m, n = G.shape[-2:]
    stack = G.reshape(math.prod(G.shape[:-2]), m, n)
    if stack.size(0) == 0:
        return torch.empty(G.shape, dtype=compute_dtype, device=G.device)
    transpose = m > n  # muon_ref's decision, on the matrix's own shape
    X = _initial_iterates(stack, transpose, compute_dtype, eps, eps_mode, safety, normalize_before_cast)
    tiles = dict(block=block, block_k=block_k, num_warps=num_warps)
    with torch.cuda.device(X.device) if X.is_cuda else contextlib.nullcontext():
        for a, b, c in coefficients if X.numel() else ():
            A = symmetric_product(X, **tiles)
            B = symmetric_product(A, alpha=c, beta=b, addend=A, **tiles)
            X = quintic_update(B, X, a, **tiles)
    return (X.mT if transpose else X).reshape(*G.shape[:-2], m, n)


def _check_arguments(G: Tensor, compute_dtype: torch.dtype, eps_mode: str, sched: Schedule) -> None:
    """ValueError for what this kernel cannot do, naming the argument (the caller's mistake)."""
    if G.ndim < 2:
        raise ValueError(f"newton_schulz_triton needs a matrix or a stack of matrices, got shape {tuple(G.shape)}")
    if not G.is_floating_point():
        raise ValueError(f"newton_schulz_triton needs a real floating tensor, got dtype {G.dtype}")
    if compute_dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"newton_schulz_triton computes in one of {SUPPORTED_DTYPES}, got dtype {compute_dtype}")
    if eps_mode not in EPS_MODES:
        raise ValueError(f"eps_mode must be one of {EPS_MODES}, got {eps_mode!r}")
    if sched.precondition is not None:
        raise ValueError(f"schedule {sched.name!r} uses the {sched.precondition!r} preconditioner, not supported here")
    if not (G.is_cuda or INTERPRETED):
        raise ValueError(f"G is on {G.device}: Triton needs CUDA, or TRITON_INTERPRET=1 before importing {__name__}")


def _initial_iterates(
    stack: Tensor, transpose: bool, compute_dtype: torch.dtype, eps: float, eps_mode: EpsMode, safety: float,
    normalize_before_cast: bool,
) -> Tensor:
    """X_0 of every matrix of stack [batch, m, n] as one contiguous [batch, min, max] tensor.

    muon_ref.newton_schulz_matrix's own lines on the same per-matrix views, so X_0 is muon_ref's bitwise: the
    norm of a transposed view sums in another order than that of a contiguous copy (on CPU, fp32, the two
    differed in the last bit for 221 of 300 random matrices up to 300 x 300).
    """
    views = [M.mT if transpose else M for M in stack]
    if normalize_before_cast:
        return torch.stack([normalise(V, eps, eps_mode, safety).to(compute_dtype) for V in views])
    return torch.stack([normalise(V.to(compute_dtype), eps, eps_mode, safety) for V in views])


def _stack_kernel(stack: Tensor, cfg: MuonConfig) -> Tensor:
    """A stack through newton_schulz_triton with the config's schedule, steps, eps, dtype, eps_mode, safety and
    normalisation (the fused step has no step_form; the AOL preconditioner is refused)."""
    return newton_schulz_triton(stack, **own_step_kwargs(cfg, "triton"))


BACKEND = Backend("triton", over_stacks(_stack_kernel), bitwise=False)  # contract: this module's docstring
