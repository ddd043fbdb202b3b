"""Gram Newton-Schulz: Newton-Schulz iterated on the small m x m Gram matrix instead of the m x n iterate.

For one matrix G (m x n), X_0 is newton_schulz's own normalised (and, when m > n, transposed) input, so m <= n.
Standard Newton-Schulz runs X_{t+1} = a_t X_t + (b_t A_t + c_t A_t^2) X_t with A_t = X_t X_t^T. Writing
    P_t = a_t I + Z_t,   Z_t = b_t A_t + c_t A_t^2          (an m x m polynomial in A_t)
one step is X_{t+1} = P_t X_t, hence A_{t+1} = P_t A_t P_t and X_t = Q_t X_0 with Q_t = P_0 ... P_{t-1}. A
segment of steps therefore never touches X:
    A <- X X^T, Q <- I                                       (the segment's Gram, once)
    for each step of the segment: Z = b A + c A^2,  Q <- Q P,  A <- P A P   (all m x m)
    X <- Q X                                                 (once, at the segment's end)
A restart ends a segment early: X <- Q X, then A <- X X^T, Q <- I. GNS(G) = X_k^T if m > n else X_k.

Exact arithmetic: GNS(G) = newton_schulz(G) for every restart schedule (proofs/newton_schulz.md#gram, lemma
NS11): A, Z, P and Q are polynomials in the segment's Gram, so they commute, and Q_t X_0 is the NS iterate.
IEEE arithmetic: a segment of one step runs newton_schulz's "addmm" step with the same ops (Z = addmm(A, A, A,
beta=b, alpha=c), X <- addmm(X, Z, X, beta=a)), so restarting after every step is newton_schulz(step_form="addmm")
bit for bit. Longer segments carry the rounding of A: the Gram's eigenvalues r = s^2 are known only to about
u ||X||_F^2 = u (u the unit roundoff), so a small singular value's r can turn negative, and on a negative r,
z = a + b r + c r^2 > a > 1 and r <- r z^2 grow until Q blows up. Restarts bound how far it grows.

Restart schedule of Dao-AILab/gram-newton-schulz 0.1.6 (PyPI; gram_newton_schulz.py, restart_autotune.py):
`GramNewtonSchulz(gram_newton_schulz_reset_iterations=[2])`, "a restart after the 2nd iteration", with its
POLAR_EXPRESS_COEFFICIENTS (the paper's first 5 Polar Express steps, safety 1.05: muon_ref's
"polar_express_dao"); its restart autotuner picks the same [2] for both coefficient sets it ships (its criterion
and run: docs/schedules.md, "Gram Newton-Schulz").
Its numerics: X / (||X||_F + 1e-7) in float32 (eps_mode "add", normalize before the cast), then float16; a
square matrix takes standard Newton-Schulz there (Gram NS would cost 1.2x its FLOPs). This module runs Gram NS
on every shape, in `dtype` (bfloat16 by default, like newton_schulz); dtype=torch.float16 and
normalize_before_cast=True give the package's dtype and normalisation order (for a float32 G).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from .newton_schulz import (
    EpsMode,
    _check_matrices,
    _map_matrices,
    initial_iterate,
    resolve_ns_options,
)
from .schedules import Coefficients, Schedule

# Dao-AILab/gram-newton-schulz 0.1.6 gram_newton_schulz.py: GramNewtonSchulz's default reset iterations
DAO_RESTARTS: tuple[int, ...] = (2,)


def restart_segments(num_steps: int, restarts: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """[start, end) step ranges between restarts: a restart r ends a segment after step r (1-based).

    ValueError when a restart is not an integer >= 1; a restart r >= num_steps changes nothing (the last segment
    ends with X <- Q X anyway), so it is dropped.
    """
    restarts = tuple(restarts)
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in restarts):
        raise ValueError(
            f"restarts must be integers >= 1 (restart after that many steps), got {restarts!r}"
        )
    cuts = sorted({0, num_steps} | {r for r in restarts if r < num_steps})
    return tuple(zip(cuts[:-1], cuts[1:]))


def gram_update(A: Tensor, Z: Tensor, a: float) -> Tensor:
    """A_{t+1} = P A P for P = a I + Z: A P = a A + A Z, then a (A P) + Z (A P) (A, Z symmetric, commuting)."""
    AP = torch.addmm(A, A, Z, beta=a)
    return torch.addmm(AP, Z, AP, beta=a)


def gram_segment(X: Tensor, coefficients: tuple[Coefficients, ...]) -> Tensor:
    """One segment of Gram Newton-Schulz on X (m x n, m <= n): returns Q X, Q = P_0 ... P_{L-1} (module docstring).

    Operation order of Dao-AILab/gram-newton-schulz 0.1.6 (_make_compiled_gram, torch backend): Z = b A + c A A;
    Q = Z + a I on the first step, then Q <- a Q + Q Z; A <- P A P (gram_update), skipped after the last step.
    A one-step segment applies P as a X + Z X instead (no Q): newton_schulz's "addmm" step, op for op.
    """
    A = X @ X.mT
    Q = None
    for t, (a, b, c) in enumerate(coefficients):
        Z = torch.addmm(A, A, A, beta=b, alpha=c)
        last = t == len(coefficients) - 1
        if Q is None and last:
            return torch.addmm(X, Z, X, beta=a)
        if Q is None:
            Q = Z + a * torch.eye(A.size(0), dtype=A.dtype, device=A.device)
        else:
            Q = torch.addmm(Q, Q, Z, beta=a)
        if not last:
            A = gram_update(A, Z, a)
    assert Q is not None, "empty segment: restart_segments never makes one"
    return Q @ X


def gram_newton_schulz_matrix(
    G: Tensor,
    coefficients: tuple[Coefficients, ...],
    *,
    segments: tuple[tuple[int, int], ...],
    eps: float,
    dtype: torch.dtype | None,
    eps_mode: EpsMode,
    safety: float,
    normalize_before_cast: bool,
) -> Tensor:
    """Gram NS on one 2-D matrix, all options explicit (segments: restart_segments). Returns the compute dtype."""
    transpose = G.size(0) > G.size(1)  # newton_schulz's decision, on this matrix's own shape
    X = G.mT if transpose else G
    X = initial_iterate(
        X, G.dtype if dtype is None else dtype, eps, eps_mode, safety, normalize_before_cast
    )
    for start, end in segments:
        X = gram_segment(X, coefficients[start:end])
    return X.mT if transpose else X


def gram_newton_schulz(
    G: Tensor,
    schedule: str | Schedule = "polar_express_dao",
    *,
    steps: int | None = None,
    restarts: Iterable[int] = DAO_RESTARTS,
    eps: float | None = None,
    dtype: torch.dtype | None = torch.bfloat16,
    eps_mode: EpsMode = "add",
    safety: float | None = None,
    normalize_before_cast: bool = False,
) -> Tensor:
    """Orthogonalise G of shape [..., m, n] by Gram Newton-Schulz: each trailing matrix independently (its own
    transpose decision and norm, as newton_schulz), in `dtype` (None: G's).

    Reference equation (module docstring): X_0 as newton_schulz; per segment A = X X^T, Q = I, then per step
    Z = b A + c A^2, P = a I + Z, Q <- Q P, A <- P A P; X <- Q X at each restart and at the end.
    Contract: in exact arithmetic equal to newton_schulz(G, schedule, steps=steps, eps=eps, dtype=dtype,
    eps_mode=eps_mode, safety=safety, normalize_before_cast=normalize_before_cast) (NS11); with a restart after
    every step, bitwise equal to it with step_form="addmm"; a zero matrix maps to zero; G is never written.
    Tolerance (otherwise the two differ by rounding only): tests/test_gram.py asserts 1e-9 in float64 (up to
    24 x 24, every Frobenius schedule, random restarts) and, for the bfloat16 defaults on Gaussians with n / m in
    [2, 8], signed singular values in [0.80, 1.22]. In float16 and bfloat16 the rounding of A grows within a
    segment, so other inputs can leave that band (docs/schedules.md, "Gram Newton-Schulz").

    Defaults are Dao-AILab/gram-newton-schulz's: schedule "polar_express_dao" (its POLAR_EXPRESS_COEFFICIENTS),
    a restart after step 2, eps 1e-7 added to the norm; dtype bfloat16 as newton_schulz (the package: float16).
    eps, safety and steps resolve as in newton_schulz (resolve_ns_options). Schedules with the AOL preconditioner
    are refused (ValueError): Gram NS here starts from the Frobenius-normalised X_0. It costs fewer GEMM FLOPs
    than newton_schulz only for n > 1.5 m (docs/schedules.md).
    """
    _check_matrices(G, eps_mode, "gram_newton_schulz")
    kernel = _matrix_kernel(
        schedule, steps, restarts, eps, dtype, eps_mode, safety, normalize_before_cast
    )
    return _map_matrices(kernel, G, G.dtype if dtype is None else dtype)


def _matrix_kernel(
    schedule: str | Schedule,
    steps: int | None,
    restarts: Iterable[int],
    eps: float | None,
    dtype: torch.dtype | None,
    eps_mode: EpsMode,
    safety: float | None,
    normalize_before_cast: bool,
) -> Callable[[Tensor], Tensor]:
    """gram_newton_schulz_matrix with the options resolved (ValueError for an AOL schedule or a bad restart)."""
    options = resolve_ns_options(schedule, steps, eps, safety)
    if options.precondition is not None:
        raise ValueError(
            f"schedule {schedule!r} uses the {options.precondition!r} preconditioner: not supported here"
        )
    return functools.partial(
        gram_newton_schulz_matrix,
        coefficients=options.coefficients,
        segments=restart_segments(len(options.coefficients), restarts),
        eps=options.eps,
        dtype=dtype,
        eps_mode=eps_mode,
        safety=options.safety,
        normalize_before_cast=normalize_before_cast,
    )
