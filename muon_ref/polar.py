"""The exact target of Newton-Schulz, and the metrics that measure how far a result is from it.

polar_factor(G) = U_r V_r^T for G = U S V^T (float64 SVD), r the numerical rank: the orthogonal polar
factor when G has full rank, and the partial isometry that Newton-Schulz converges to otherwise (zero
singular values stay zero under every odd polynomial).

Scalar theory (docs/schedules.md): one step maps each singular value s through
p_t(s) = a s + b s^3 + c s^5, so a schedule is the scalar map f = p_k o ... o p_1 and
    ||NS(G) - U V^T||_2 = max_i |f(s_i) - 1|,   ||NS(G)^T NS(G) - I||_2 = max_i |f(s_i)^2 - 1|.
schedule_band computes the exact range of f over [l, u] by pushing the interval through each step with
its endpoints and real critical points (negative ones included, or sign flips are missed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .schedules import Coefficients, Schedule, get_schedule


def _svd64(G: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return torch.linalg.svd(G.detach().to(torch.float64), full_matrices=False)


def _rank_mask(S: Tensor, shape: tuple[int, int], rtol: float | None) -> Tensor:
    """Singular values above rtol * s_max (default max(m, n) * float64 eps, numpy's matrix_rank rule)."""
    tol = max(shape) * torch.finfo(torch.float64).eps if rtol is None else rtol
    s_max = S.amax(dim=-1, keepdim=True) if S.numel() else S
    return S > tol * s_max


def polar_factor(G: Tensor, *, rtol: float | None = None) -> Tensor:
    """U_r V_r^T of each trailing matrix of G, in float64 (batched over leading dims)."""
    if G.ndim < 2:
        raise ValueError(f"polar_factor needs shape [..., m, n], got {tuple(G.shape)}")
    U, S, Vh = _svd64(G)
    keep = _rank_mask(S, tuple(G.shape[-2:]), rtol).to(torch.float64)
    return (U * keep.unsqueeze(-2)) @ Vh


def signed_singular_values(X: Tensor, G: Tensor) -> Tensor:
    """diag(U^T X V) for G = U S V^T: X's action on G's singular directions, sign flips included.

    An SVD of X itself would report |f(s_i)| and hide a flipped sign; this reports f(s_i) when
    X = U f(S) V^T exactly, and its best diagonal estimate otherwise. Shape [..., min(m, n)], float64.
    """
    U, _, Vh = _svd64(G)
    X64 = X.detach().to(torch.float64)
    return torch.diagonal(U.mT @ X64 @ Vh.mT, dim1=-2, dim2=-1)


def max_singular_value_error(X: Tensor, G: Tensor, *, rtol: float | None = None) -> float:
    """max_i |d_i - 1| over G's nonzero singular directions, d = signed_singular_values(X, G)."""
    _, S, _ = _svd64(G)
    d = signed_singular_values(X, G)
    mask = _rank_mask(S, tuple(G.shape[-2:]), rtol)
    return float((d - 1).abs()[mask].max()) if bool(mask.any()) else 0.0


def polar_error(X: Tensor, G: Tensor) -> float:
    """max over matrices of ||X - polar_factor(G)||_2 (spectral norm), in float64."""
    D = X.detach().to(torch.float64) - polar_factor(G)
    return float(torch.linalg.matrix_norm(D, ord=2).max())


def orthogonality_error(X: Tensor) -> float:
    """max over matrices of ||Y^T Y - I||_2, Y = X or X^T whichever has fewer columns (the Gram is small)."""
    X64 = X.detach().to(torch.float64)
    if X64.size(-2) < X64.size(-1):
        X64 = X64.mT
    n = X64.size(-1)
    D = X64.mT @ X64 - torch.eye(n, dtype=torch.float64, device=X64.device)
    return float(torch.linalg.matrix_norm(D, ord=2).max())


# ---------------------------------------------------------------------------------------------------
# The scalar map and its exact band


def step_polynomial(x: float, coefficients: Coefficients) -> float:
    a, b, c = coefficients
    x2 = x * x
    return x * (a + x2 * (b + c * x2))


def critical_points(coefficients: Coefficients) -> list[float]:
    """Real roots of p'(x) = a + 3 b x^2 + 5 c x^4, both signs, sorted."""
    a, b, c = coefficients
    ys: list[float] = []
    if c == 0.0:
        if b != 0.0:
            ys.append(-a / (3 * b))
    else:
        disc = 9 * b * b - 20 * a * c
        if disc >= 0:
            r = math.sqrt(disc)
            ys.extend([(-3 * b - r) / (10 * c), (-3 * b + r) / (10 * c)])
    xs = {sign * math.sqrt(y) for y in ys if y >= 0 for sign in (-1.0, 1.0)}
    return sorted(xs)


def step_image(lo: float, hi: float, coefficients: Coefficients) -> tuple[float, float]:
    """The exact range of p over [lo, hi]: p at the endpoints and the critical points inside."""
    candidates = [lo, hi] + [x for x in critical_points(coefficients) if lo < x < hi]
    values = [step_polynomial(x, coefficients) for x in candidates]
    return min(values), max(values)


@dataclass(frozen=True)
class Band:
    """Range of the composed map over [lower, upper], and the range after each step."""

    lower: float
    upper: float
    per_step: tuple[tuple[float, float], ...]

    @property
    def min(self) -> float:
        return self.per_step[-1][0] if self.per_step else self.lower

    @property
    def max(self) -> float:
        return self.per_step[-1][1] if self.per_step else self.upper

    @property
    def sign_flip(self) -> bool:
        return self.min < 0.0


def schedule_band(
    schedule: str | Schedule,
    lower: float,
    upper: float = 1.0,
    *,
    steps: int | None = None,
    safety: float = 1.0,
    headroom: float = 0.0,
) -> Band:
    """Exact range of f = p_k o ... o p_1 over [lower / safety, upper / safety] (float64 arithmetic;
    proofs/check.py certifies it with exact rational enclosures).

    The image of an interval under a continuous p_t is the interval between p_t's extremes at the endpoints
    and interior critical points, so pushing the interval through the steps gives the exact range.
    `safety`: the kernel's prescale (pass the schedule's `safety` to get the band of the shipped pipeline:
    singular values s / (||G||_F * safety)). `headroom`: widen every step's input interval by this relative
    amount first (2**-8 models one bf16 rounding of the iterate; a schedule with no headroom above 1 can
    blow up there, see notebooks/ns_numerics.ipynb).
    """
    if not 0.0 <= lower <= upper:
        raise ValueError(f"need 0 <= lower <= upper, got [{lower}, {upper}]")
    if safety <= 0 or headroom < 0:
        raise ValueError(
            f"need safety > 0 and headroom >= 0, got safety={safety}, headroom={headroom}"
        )
    lo, hi = lower / safety, upper / safety
    per_step = []
    for coefficients in get_schedule(schedule).steps_for(steps):
        lo, hi = step_image(lo * (1 - headroom), hi * (1 + headroom), coefficients)
        per_step.append((lo, hi))
    return Band(lower=lower, upper=upper, per_step=tuple(per_step))


def fixed_points(coefficients: Coefficients) -> list[float]:
    """Positive x with p(x) = x, i.e. (a - 1) + b y + c y^2 = 0 for y = x^2, sorted."""
    a, b, c = coefficients
    if c == 0.0:
        ys = [(1 - a) / b] if b != 0.0 else []
    else:
        disc = b * b - 4 * c * (a - 1)
        ys = (
            [] if disc < 0 else [(-b - math.sqrt(disc)) / (2 * c), (-b + math.sqrt(disc)) / (2 * c)]
        )
    return sorted({math.sqrt(y) for y in ys if y > 0})


def normalised_singular_values(
    G: Tensor,
    schedule: str | Schedule = "keller",
    *,
    eps: float | None = None,
    safety: float | None = None,
    eps_mode: str = "clamp",
) -> Tensor:
    """The singular values the kernel's polynomials act on: s_i / d per matrix, in float64, with
    d = ||G||_F * safety + eps ("add") or max(||G||_F * safety, eps) ("clamp"); eps and safety default to
    the schedule's (as in newton_schulz). Shape [..., min(m, n)], descending. Zero matrices give zeros."""
    from .newton_schulz import DEFAULT_EPS

    sched = get_schedule(schedule)
    eps = (sched.eps if sched.eps is not None else DEFAULT_EPS) if eps is None else eps
    safety = sched.safety if safety is None else safety
    G64 = G.detach().to(torch.float64)
    norm = torch.linalg.matrix_norm(G64) * safety
    d = norm + eps if eps_mode == "add" else norm.clamp_min(eps)
    d = torch.where(d == 0, torch.ones_like(d), d)
    return torch.linalg.svdvals(G64) / d.unsqueeze(-1)


def scalar_map(schedule: str | Schedule, x: Tensor, *, steps: int | None = None) -> Tensor:
    """f(x) = p_k o ... o p_1 (x) elementwise, in x's dtype (the prediction for each singular value)."""
    for a, b, c in get_schedule(schedule).steps_for(steps):
        x2 = x * x
        x = x * (a + x2 * (b + c * x2))
    return x
