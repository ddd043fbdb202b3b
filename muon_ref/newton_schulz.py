"""The Newton-Schulz kernel: the orthogonalisation every Muon in this repo is checked against.

For one matrix G of shape (m, n), with X_0 the normalised (and, when m > n, transposed) input:
    X_0     = G' / d,            G' = G^T if m > n else G,   d = ||G'||_F * safety + eps  (eps_mode "add")
                                                         or  d = max(||G'||_F, eps)       (eps_mode "clamp")
    A_t     = X_t X_t^T
    B_t     = b_t A_t + c_t A_t A_t
    X_{t+1} = a_t X_t + B_t X_t           = p_t(X_t) with p_t(x) = a_t x + b_t x^3 + c_t x^5 on singular values
    NS(G)   = X_k^T if m > n else X_k
In exact arithmetic NS(G) = U f(S) V^T for G = U S V^T with f = p_k o ... o p_1 applied to S / d
(proofs/newton_schulz.md). Leading dims are independent matrices: the kernel is defined on one matrix and
mapped over the others, each with its own transpose decision and its own norm.

Stacks (`stack`): "per_matrix" (the default) runs the kernel on each trailing matrix alone, so a matrix's bits never
depend on the stack around it (muon_dist's bitwise contract rests on it). "batched" runs it once on the whole stack
[B, m, n], each product one batched product over the stack, as an origin that writes `X @ X.mT` on a 3-D tensor runs
it (KellerJordan's zeropower_via_newtonschulz5 on expert stacks): the same equations, each matrix its own norm and
the stack's one transpose decision; a batched product may round some inputs otherwise than single ones (oneDNN's
bf16 kernels, ATen's small products: docs/conventions.md, "Stacks"), so the two differ in bits, not in values.

What changes bits, as options (each origin is reproduced by its preset, see muon_ref/presets.py):
    step_form "addmm": B = addmm(A, A, A, beta=b, alpha=c); X = addmm(X, B, X, beta=a)   (torch, Emerging)
              "keller": B = b*A + (c*A) @ A;                 X = a*X + B @ X              (Keller, Moonlight, PE)
              "dion":   B = b*A + c*(A @ A);                 X = a*X + B @ X              (Dion, xtuner)
    normalize_before_cast: normalise in the input dtype, then cast (Emerging's F.normalize in fp32)
    eps_mode "add" | "clamp", safety (prescale of the norm), precondition "aol" (Turbo-Muon: replaces
    the Frobenius normalisation by X <- diag(s) X, s_i = (sum_j |(X X^T)_ij|)^(-1/2), reusing the Gram).
A zero matrix maps to zeros (never NaN), whatever eps: the only deviation from the origins, and it only
changes outputs that the origins would make NaN (0/0 when eps = 0).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from .schedules import Coefficients, Schedule, get_schedule

StepForm = Literal["addmm", "keller", "dion"]
EpsMode = Literal["add", "clamp"]
Stack = Literal["per_matrix", "batched"]
STEP_FORMS: tuple[str, ...] = ("addmm", "keller", "dion")
EPS_MODES: tuple[str, ...] = ("add", "clamp")
STACKS: tuple[str, ...] = ("per_matrix", "batched")

# torch.optim.Muon's EPS (torch/optim/_muon.py), also KellerJordan's 1e-7
DEFAULT_EPS = 1e-7


def normalise(X: Tensor, eps: float, eps_mode: EpsMode, safety: float) -> Tensor:
    """X / d for each trailing matrix X of [..., m, n], d = ||X||_F * safety + eps ("add") or
    max(||X||_F * safety, eps) ("clamp"), each matrix with its own norm.

    Reference equation: the kernel's X_0 (module docstring). Contract: on one matrix these are the kernel's exact
    ops, so a fast kernel that calls this on the same view in the same dtype gets muon_ref's X_0 bitwise. On a
    stack, the norm is one batched reduction over the last two dims; measured equal bit for bit to the per-matrix
    norms on an x86 CPU (torch 2.13.0; fp64/fp32/bf16/fp16, 7 shapes up to 300 x 77, 5 seeds, contiguous stacks and
    their .mT views: 280/280; asserted by tests/test_gram.py), not a guarantee elsewhere. d = 0 only for a zero
    matrix with eps = 0 and is replaced by 1 there, so zero maps to zero (proofs/newton_schulz.md#zero-input).
    """
    # one matrix: Tensor.norm, the op of every origin whose bits the presets pin
    norm = X.norm() if X.ndim == 2 else torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    if safety != 1.0:
        norm = norm * safety
    denom = norm + eps if eps_mode == "add" else norm.clamp(min=eps)
    # d = 0 only for a zero matrix whose eps rounds to 0 in X's dtype (eps = 0; 1e-15 in fp16): d is replaced by 1
    # there, so the zero matrix maps to zero. Above the dtype's smallest normal eps keeps d > 0: no guard needed.
    if eps < torch.finfo(X.dtype).tiny:
        denom = torch.where(denom == 0, torch.ones_like(denom), denom)
    return X / denom


def _addmm(input: Tensor, m1: Tensor, m2: Tensor, *, beta: float, alpha: float = 1.0) -> Tensor:
    """beta * input + alpha * m1 @ m2 in one op: addmm on a matrix, baddbmm on a [B, m, n] stack (the batched
    kernel's form of torch.optim.Muon's addmm steps)."""
    if input.ndim == 2:
        return torch.addmm(input, m1, m2, beta=beta, alpha=alpha)
    return torch.baddbmm(input, m1, m2, beta=beta, alpha=alpha)


def _step(X: Tensor, a: float, b: float, c: float, step_form: StepForm) -> Tensor:
    """One quintic step X <- a X + (b A + c A^2) X with A = X X^T, in the origin's operation order (on a matrix,
    or on a [B, m, n] stack as batched products)."""
    A = X @ X.mT
    if step_form == "addmm":
        B = _addmm(A, A, A, beta=b, alpha=c)
        return _addmm(X, B, X, beta=a)
    if step_form == "keller":
        B = b * A + c * A @ A  # parsed as (c * A) @ A, as in KellerJordan/Muon muon.py
    else:
        B = b * A + c * (A @ A)  # as in microsoft/dion muon.py and xtuner muon.py
    return a * X + B @ X


def _aol_first_step(
    X: Tensor, a: float, b: float, c: float, step_form: StepForm, eps: float
) -> Tensor:
    """AOL preconditioning fused with step 1, reusing the Gram (thib-s/flash-newton-schulz NS_ours)."""
    A = X @ X.mT
    row_sums = A.abs().sum(dim=-1).clamp_min(eps)
    row_sums = torch.where(
        row_sums == 0, torch.ones_like(row_sums), row_sums
    )  # zero rows stay zero
    s = torch.rsqrt(row_sums)
    X = X * s.unsqueeze(-1)
    A = A * s.unsqueeze(-1) * s.unsqueeze(-2)
    if step_form == "addmm":
        B = _addmm(A, A, A, beta=b, alpha=c)
        return _addmm(X, B, X, beta=a)
    B = b * A + c * A @ A if step_form == "keller" else b * A + c * (A @ A)
    return a * X + B @ X


def newton_schulz_matrix(
    G: Tensor,
    coefficients: tuple[tuple[float, float, float], ...],
    *,
    eps: float,
    dtype: torch.dtype | None,
    step_form: StepForm,
    eps_mode: EpsMode,
    safety: float,
    normalize_before_cast: bool,
    precondition: str | None,
) -> Tensor:
    """The kernel on one 2-D matrix (or on a [B, m, n] stack as one batch: stack="batched"), all options explicit.
    Returns the compute dtype (dtype, or G's)."""
    transpose = G.size(-2) > G.size(-1)  # decided on this matrix's own shape, never a padded one
    X = G.mT if transpose else G
    compute_dtype = G.dtype if dtype is None else dtype
    if precondition == "aol":
        X = X.to(compute_dtype)
        if coefficients:
            X = _aol_first_step(X, *coefficients[0], step_form=step_form, eps=eps)
            coefficients = coefficients[1:]
    else:
        X = initial_iterate(X, compute_dtype, eps, eps_mode, safety, normalize_before_cast)
    for a, b, c in coefficients:
        X = _step(X, a, b, c, step_form)
    return X.mT if transpose else X


def initial_iterate(
    X: Tensor,
    compute_dtype: torch.dtype,
    eps: float,
    eps_mode: EpsMode,
    safety: float,
    normalize_before_cast: bool,
) -> Tensor:
    """X_0: normalised then cast (normalize_before_cast), or cast then normalised (the default), each trailing matrix
    by its own norm (normalise). Contract: the kernel's own ops, so a fast kernel that calls this on the same view
    gets muon_ref's X_0 bitwise (on a stack, as normalise's docstring says of stacks)."""
    if normalize_before_cast:
        return normalise(X, eps, eps_mode, safety).to(compute_dtype)
    return normalise(X.to(compute_dtype), eps, eps_mode, safety)


def input_cast(
    input_dtype: torch.dtype, dtype: torch.dtype | None, normalize_before_cast: bool
) -> torch.dtype | None:
    """The narrower dtype newton_schulz can be given its input in, with the same result: `dtype` when the kernel
    reads its input only through G.to(dtype) (a compute dtype, and the cast before the normalisation: X_0 =
    normalise(G'.to(dtype)), G' a transposition view; the AOL preconditioner casts first too) and it is
    narrower than the input's. Equation: newton_schulz(G, dtype=dtype, ...) == newton_schulz(G.to(dtype), ...)
    bitwise, because G.to(dtype).to(dtype) is G.to(dtype). None when no narrower dtype gives that."""
    if dtype is None or normalize_before_cast:
        return None
    narrower = (
        torch.empty((), dtype=dtype).element_size()
        < torch.empty((), dtype=input_dtype).element_size()
    )
    return dtype if narrower else None


def _check_matrices(G: Tensor, eps_mode: str, caller: str) -> None:
    """ValueError for the caller's mistakes common to the kernels on [..., m, n] stacks."""
    if G.ndim < 2:
        raise ValueError(
            f"{caller} needs a matrix or a stack of matrices, got shape {tuple(G.shape)}"
        )
    if G.is_complex() or not G.is_floating_point():
        raise ValueError(f"{caller} needs a real floating tensor, got dtype {G.dtype}")
    if eps_mode not in EPS_MODES:
        raise ValueError(f"eps_mode must be one of {EPS_MODES}, got {eps_mode!r}")


def _map_matrices(
    kernel: Callable[[Tensor], Tensor], G: Tensor, compute_dtype: torch.dtype
) -> Tensor:
    """kernel(M) for each trailing matrix M of G [..., m, n], stacked back to G's leading dims: each matrix takes
    its own transpose decision and norm inside the kernel. An empty stack gives an empty tensor of G's shape."""
    if G.ndim == 2:
        return kernel(G)
    stack = G.reshape(math.prod(G.shape[:-2]), *G.shape[-2:])  # -1 is ambiguous when a dim is 0
    out = [kernel(stack[i]) for i in range(stack.size(0))]
    if not out:
        return torch.empty(G.shape, dtype=compute_dtype, device=G.device)
    return torch.stack(out).reshape(*G.shape[:-2], *out[0].shape[-2:])


@dataclass(frozen=True)
class NSOptions:
    """What a Newton-Schulz run computes once the schedule and the caller's overrides are resolved.

    coefficients: (a_t, b_t, c_t) of each step actually run (the schedule's step policy applied);
    eps, safety: the normalisation's d = ||X||_F * safety + eps or max(||X||_F * safety, eps);
    precondition: "aol" (Turbo-Muon's row scaling replaces the Frobenius normalisation) or None.
    """

    coefficients: tuple[Coefficients, ...]
    eps: float
    safety: float
    precondition: Literal["aol"] | None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.eps) and self.eps >= 0):
            raise ValueError(f"eps must be finite and >= 0, got {self.eps!r}")
        if not (math.isfinite(self.safety) and self.safety > 0):
            raise ValueError(f"safety must be finite and > 0, got {self.safety!r}")
        if self.precondition not in (None, "aol"):
            raise ValueError(f"precondition must be None or 'aol', got {self.precondition!r}")


def resolve_ns_options(
    schedule: str | Schedule,
    steps: int | None = None,
    eps: float | None = None,
    safety: float | None = None,
    precondition: str | None = None,
) -> NSOptions:
    """The options newton_schulz runs with: each None takes the schedule's own (its origin's) value.

    eps: the schedule's, else DEFAULT_EPS; safety: the schedule's; steps: the schedule's default_steps, under its
    step policy (ValueError for a "fixed" schedule given another count); precondition: None for the schedule's,
    "none" for no preconditioner, "aol" for the AOL preconditioner (ValueError otherwise); ValueError too for a
    negative or non-finite eps and a safety that is not positive and finite (NSOptions checks itself).
    Contract: newton_schulz itself calls this, so a fast kernel that does gets the reference's options exactly.
    """
    if precondition not in (None, "none", "aol"):
        raise ValueError(f"precondition must be None, 'none' or 'aol', got {precondition!r}")
    return _resolved(get_schedule(schedule), steps, eps, safety, precondition)


@functools.lru_cache(maxsize=256)
def _resolved(
    sched: Schedule,
    steps: int | None,
    eps: float | None,
    safety: float | None,
    precondition: str | None,
) -> NSOptions:
    """resolve_ns_options on the schedule object (not its name: register_schedule may rebind a name), cached: a
    pure function that every kernel call asks for."""
    return NSOptions(
        coefficients=sched.steps_for(steps),
        eps=(sched.eps if sched.eps is not None else DEFAULT_EPS) if eps is None else eps,
        safety=sched.safety if safety is None else safety,
        precondition=sched.precondition
        if precondition is None
        else (None if precondition == "none" else "aol"),
    )


def newton_schulz(
    G: Tensor,
    schedule: str | Schedule = "keller",
    *,
    steps: int | None = None,
    eps: float | None = None,
    dtype: torch.dtype | None = torch.bfloat16,
    step_form: StepForm = "addmm",
    eps_mode: EpsMode = "clamp",
    safety: float | None = None,
    normalize_before_cast: bool = False,
    precondition: str | None = None,
    stack: Stack = "per_matrix",
) -> Tensor:
    """Orthogonalise G of shape [..., m, n]: each trailing matrix independently, in `dtype` (None: G's).

    Defaults reproduce torch.optim.Muon's kernel (addmm form, eps clamped at 1e-7, bf16, norm after the
    cast). `eps`, `safety` and `precondition` default to the schedule's own (its origin's) values. `stack`:
    each matrix of a stack alone ("per_matrix") or the stack as one batch ("batched"; module docstring).
    Returns a new tensor of shape [..., m, n] in the compute dtype; G is never written.
    """
    _check_matrices(G, eps_mode, "newton_schulz")
    if step_form not in STEP_FORMS:
        raise ValueError(f"step_form must be one of {STEP_FORMS}, got {step_form!r}")
    if stack not in STACKS:
        raise ValueError(f"stack must be one of {STACKS}, got {stack!r}")
    options = resolve_ns_options(schedule, steps, eps, safety, precondition)
    kernel = functools.partial(
        newton_schulz_matrix,
        coefficients=options.coefficients,
        eps=options.eps,
        dtype=dtype,
        step_form=step_form,
        eps_mode=eps_mode,
        safety=options.safety,
        normalize_before_cast=normalize_before_cast,
        precondition=options.precondition,
    )
    if stack == "batched" and G.ndim > 2 and G.numel() > 0:
        batch = G.reshape(math.prod(G.shape[:-2]), *G.shape[-2:])  # -1 is ambiguous when a dim is 0
        return kernel(batch).reshape(G.shape)
    return _map_matrices(kernel, G, G.dtype if dtype is None else dtype)
