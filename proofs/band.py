"""A rigorous enclosure of a schedule's singular-value band, in exact rational arithmetic.

The band of f = p_k o ... o p_1 over [l, u] is [m_k, M_k] with [m_t, M_t] = p_t([m_{t-1}, M_{t-1}]): the image
of an interval under a continuous polynomial is the interval between its smallest and largest value at the
endpoints and at the interior critical points (proofs/newton_schulz.md#exact-band). Here every number is a
Fraction: the coefficients are the exact binary values of their floats (Fraction(float)), the endpoints exact.
Critical points are irrational (square roots), so each is enclosed in a rational interval on the grid 2^-110
(measured widths <= 2^-109 for the catalogue),
and p at the critical point is bounded by p(x0) -/+ K w (x0 in the enclosure, w its width, K >= |p'| on it).
After each step the enclosure [m_lo, m_hi] x [M_lo, M_hi] is rounded outward to the grid 2^-200, which keeps
the denominators bounded and the enclosure rigorous.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

from muon_ref.schedules import Coefficients, Schedule, get_schedule

CRITICAL_BITS = (
    110  # square roots enclosed to width <= 2^-110 ~ 7.7e-34, critical points on that grid
)
GRID_BITS = 200  # band endpoints rounded outward to multiples of 2^-200 after each step

Exact = tuple[Fraction, Fraction, Fraction]
Interval = tuple[Fraction, Fraction]


def _floor_grid(x: Fraction, bits: int) -> Fraction:
    return Fraction(math.floor(x * 2**bits), 2**bits)


def _ceil_grid(x: Fraction, bits: int) -> Fraction:
    return Fraction(math.ceil(x * 2**bits), 2**bits)


def sqrt_enclosure(q: Fraction, bits: int = CRITICAL_BITS) -> Interval:
    """(lo, hi) with lo <= sqrt(q) <= hi and hi - lo <= 2^-bits, for q >= 0 (integer square roots only)."""
    n, d = q.numerator, q.denominator  # sqrt(n / d) = sqrt(n d 4^bits) / (d 2^bits)
    r = math.isqrt(n * d * 4**bits)
    return Fraction(r, d * 2**bits), Fraction(r + 1, d * 2**bits)


def polynomial(x: Fraction, coefficients: Exact) -> Fraction:
    a, b, c = coefficients
    x2 = x * x
    return x * (a + x2 * (b + c * x2))


def derivative_bound(lo: Fraction, hi: Fraction, coefficients: Exact) -> Fraction:
    """K >= |p'(x)| = |a + 3 b x^2 + 5 c x^4| for every x in [lo, hi]."""
    a, b, c = coefficients
    x2 = max(abs(lo), abs(hi)) ** 2
    return abs(a) + 3 * abs(b) * x2 + 5 * abs(c) * x2 * x2


@lru_cache(maxsize=None)
def critical_enclosures(coefficients: Coefficients) -> tuple[Interval, ...]:
    """Rational intervals that together contain every real root of p'(x) = a + 3 b x^2 + 5 c x^4, both signs.

    With y = x^2, p' = 0 is a + 3 b y + 5 c y^2 = 0: y = -a / (3 b) when c = 0, else
    y = (-3 b +- sqrt(9 b^2 - 20 a c)) / (10 c). Each root y >= 0 gives x = +-sqrt(y). An enclosure that
    straddles y = 0 is kept (it may hold no root: an extra candidate only widens the bound, never breaks it).
    """
    a, b, c = (Fraction(v) for v in coefficients)
    if c == 0:
        ys = [] if b == 0 else [(-a / (3 * b), -a / (3 * b))]
    else:
        disc = 9 * b * b - 20 * a * c
        ys = []
        if disc >= 0:
            s_lo, s_hi = sqrt_enclosure(disc)
            for sign in (-1, 1):
                ends = ((-3 * b + sign * s_lo) / (10 * c), (-3 * b + sign * s_hi) / (10 * c))
                ys.append((min(ends), max(ends)))
    xs: list[Interval] = []
    for y_lo, y_hi in ys:
        if y_hi < 0:
            continue
        x_lo = _floor_grid(sqrt_enclosure(max(y_lo, Fraction(0)))[0], CRITICAL_BITS)
        x_hi = _ceil_grid(sqrt_enclosure(y_hi)[1], CRITICAL_BITS)
        xs += [(x_lo, x_hi), (-x_hi, -x_lo)]
    return tuple(xs)


@dataclass(frozen=True)
class RangeBounds:
    """Bounds on min and max of p over an interval: min_lo <= min <= min_hi, max_lo <= max <= max_hi."""

    min_lo: Fraction
    min_hi: Fraction
    max_lo: Fraction
    max_hi: Fraction


def range_bounds(u: Fraction, v: Fraction, coefficients: Coefficients) -> RangeBounds:
    """Rigorous bounds on min and max of p over [u, v], u <= v.

    The extremes of p on [u, v] are at u, v or an interior critical point x*. For each critical enclosure
    [x_lo, x_hi] meeting [u, v], x0 is a point of both (the clipped midpoint) and |p(x*) - p(x0)| <= K w.
    Lower bound of the min: the smallest of p(u), p(v), p(x0) - K w. Upper bound of the min: the smallest
    value at points of [u, v] (p(u), p(v), p(x0)); the max alike, mirrored.
    """
    exact = tuple(Fraction(v_) for v_ in coefficients)
    sure = [polynomial(u, exact), polynomial(v, exact)]  # values at points of [u, v]
    low, high = list(sure), list(sure)
    for x_lo, x_hi in critical_enclosures(coefficients):
        if x_hi < u or x_lo > v:
            continue
        x0 = min(max((x_lo + x_hi) / 2, u), v)
        y0 = polynomial(x0, exact)
        slack = derivative_bound(x_lo, x_hi, exact) * (x_hi - x_lo)
        sure.append(y0)
        low.append(y0 - slack)
        high.append(y0 + slack)
    return RangeBounds(min_lo=min(low), min_hi=min(sure), max_lo=max(sure), max_hi=max(high))


@dataclass(frozen=True)
class BandEnclosure:
    """The true band [m, M] of a schedule over [lower, upper] satisfies m_lo <= m <= m_hi, M_lo <= M <= M_hi."""

    lower: Fraction
    upper: Fraction
    m_lo: Fraction
    m_hi: Fraction
    M_lo: Fraction
    M_hi: Fraction

    @property
    def width(self) -> float:
        """The wider end's width, relative to its magnitude where that exceeds 1 (a diverging band is huge)."""
        return float(
            max(
                (hi - lo) / max(1, abs(hi))
                for lo, hi in ((self.m_lo, self.m_hi), (self.M_lo, self.M_hi))
            )
        )


def _step(enc: BandEnclosure, coefficients: Coefficients) -> BandEnclosure:
    """Push the enclosure through one step: [m_hi, M_lo] <= [m, M] <= [m_lo, M_hi] as sets, so
    min over the outer interval <= m' <= min over the inner one, and the max alike."""
    if enc.m_hi > enc.M_lo:
        raise ArithmeticError("band enclosure too wide to separate its ends (inner interval empty)")
    outer = range_bounds(enc.m_lo, enc.M_hi, coefficients)
    inner = range_bounds(enc.m_hi, enc.M_lo, coefficients)
    return BandEnclosure(
        lower=enc.lower,
        upper=enc.upper,
        m_lo=_floor_grid(outer.min_lo, GRID_BITS),
        m_hi=_ceil_grid(inner.min_hi, GRID_BITS),
        M_lo=_floor_grid(inner.max_lo, GRID_BITS),
        M_hi=_ceil_grid(outer.max_hi, GRID_BITS),
    )


def certified_band(
    schedule: str | Schedule, lower: float, upper: float = 1.0, *, steps: int | None = None
) -> BandEnclosure:
    """Rigorous enclosure of the band of the schedule's scalar map over [lower, upper] (floats taken exactly)."""
    lo, hi = Fraction(lower), Fraction(upper)
    enc = BandEnclosure(lower=lo, upper=hi, m_lo=lo, m_hi=lo, M_lo=hi, M_hi=hi)
    for coefficients in get_schedule(schedule).steps_for(steps):
        enc = _step(enc, coefficients)
    return enc
