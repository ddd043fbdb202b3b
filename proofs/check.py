"""Mechanical certificates for what muon_ref relies on: `python -m proofs.check` (exit 0 when all hold).

A check is a (name, function) pair; the function prints its report lines and returns a list of failure
strings (empty: it holds). main() runs CHECKS in order; a later checker (e.g. proofs/plan_check.py for
muon_dist) adds its own (name, function) pairs to the list it passes to main().
Proofs: proofs/newton_schulz.md, proofs/momentum.md, proofs/lr_scale.md; index: proofs/README.md.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path

from muon_ref import LR_SCALE_ALIASES, SCHEDULES, Band, Schedule, lr_scale, schedule_band
from muon_ref.polar import critical_points, step_polynomial

from .band import BandEnclosure, certified_band
from .plan_check import BROKEN_CASE, check_case, check_plans, dropping_remainder_planner

NamedCheck = tuple[str, Callable[[], list[str]]]

LOWER = 1e-3  # the catalogue's interval [1e-3, 1] (docs/schedules.md, the bands table)
# a float band must lie this close to the exact enclosure (relative beyond 1); measured: <= 7.1e-14 (cans)
CLAIM_TOL = 1e-12
WIDTH_LIMIT = (
    1e-12  # the enclosure itself must be narrower than this (relative where the band exceeds 1)
)
OVERSHOOT_TOL = (
    2.0**-8
)  # bf16's unit roundoff at 1: a smaller overshoot is invisible after the cast

# ---------------------------------------------------------------------------------------------------
# Schedule certificates


def check_schedule_claim(
    schedule: str | Schedule,
    claimed_band: Band | tuple[float, float],
    l: float,
    *,
    steps: int | None = None,
) -> list[str]:
    """Failures of the claim "the band of the schedule over [l, 1] is claimed_band" against the exact enclosure."""
    name = schedule if isinstance(schedule, str) else schedule.name
    claimed = (
        (claimed_band.min, claimed_band.max)
        if isinstance(claimed_band, Band)
        else tuple(claimed_band)
    )
    enc = certified_band(schedule, l, steps=steps)
    where = f"{name} over [{l:g}, 1], {steps or 'default'} steps"
    failures = []
    if enc.width >= WIDTH_LIMIT:
        failures.append(f"{where}: enclosure width {enc.width:.3g} >= {WIDTH_LIMIT:g}")
    for label, value, lo, hi in (
        ("min", claimed[0], enc.m_lo, enc.m_hi),
        ("max", claimed[1], enc.M_lo, enc.M_hi),
    ):
        tol = Fraction(CLAIM_TOL) * max(
            1, abs(Fraction(value))
        )  # relative for a band beyond 1 (diverging)
        if not lo - tol <= Fraction(value) <= hi + tol:
            exact = f"[{float(lo)!r}, {float(hi)!r}]"
            failures.append(
                f"{where}: claimed {label} {value!r} outside the exact {exact} +- {CLAIM_TOL:g}"
            )
    return failures


def hazards(enc: BandEnclosure) -> list[str]:
    """Sign flips (certified or possible) and overshoot above 1 + 2^-8, read off the enclosure."""
    flags = []
    if enc.m_hi < 0:
        flags.append("SIGN FLIP")
    elif enc.m_lo < 0:
        flags.append("possible sign flip")
    if enc.M_lo > 1 + Fraction(OVERSHOOT_TOL):
        flags.append(f"overshoot {float(enc.M_hi):.4f}")
    return flags


def _step_counts(sched: Schedule) -> list[int]:
    """The design step count, and one fewer and one more where the step policy allows them."""
    k = sched.default_steps
    return [k] if sched.policy == "fixed" else [k] + [s for s in (k - 1, k + 1) if s >= 1]


def check_schedule_certificates() -> list[str]:
    """Every registered schedule (iterated at run time): exact band enclosure, float band inside it, hazards."""
    failures = []
    print(
        f"  {'schedule':22s} {'l':>6s} {'k':>3s}  exact band [min, max] (6 d.p., enclosure width)   hazards"
    )
    for name, sched in list(SCHEDULES.items()):
        lowers = [LOWER] + (
            [sched.design_lower_bound] if sched.design_lower_bound not in (None, LOWER) else []
        )
        for l in lowers:
            for k in _step_counts(sched):
                steps = None if k == sched.default_steps else k
                failures += check_schedule_claim(
                    sched, schedule_band(sched, l, steps=steps), l, steps=steps
                )
                enc = certified_band(sched, l, steps=steps)
                design = "" if steps is None else " (off design)"
                print(
                    f"  {name:22s} {l:6g} {k:3d}  [{float(enc.m_lo):9.6f}, {float(enc.M_hi):9.6f}] "
                    f"(w {enc.width:.0e}){design:13s} {', '.join(hazards(enc))}"
                )
    return failures


# The measured figures of docs/schedules.md (the bands table and "Hazards" 2), with
# the precision they are printed at: (label, schedule, l, steps, policy override, (min, max), half-unit).
CATALOGUE_FIGURES = [
    ("keller x5", "keller", 1e-3, None, None, (0.4705, 1.2024), 5e-5),
    ("you5", "you5", 1e-3, None, None, (0.4750, 1.1450), 5e-5),
    ("you6", "you6", 1e-3, None, None, (0.8663, 0.9993), 5e-5),
    ("polar_express (shipped) x8", "polar_express", 1e-3, None, None, (1.0, 1.0), 2e-15),
    ("polar_express_modded x5", "polar_express_modded", 1e-3, None, None, (0.8589, 1.1411), 5e-5),
    ("cans x5", "cans", 1e-3, None, None, (0.8844, 1.1198), 5e-5),
    ("aol_old x4 (scalar)", "aol_old", 1e-3, None, None, (-1.084, 1.084), 5e-4),
    ("deepseekv4 x10", "deepseekv4", 1e-3, None, None, (1.0000, 1.00054), 5e-6),
    ("hazard 2: 5-step schedule cycled to 6", "you5", 7e-3, 6, "cycle", (0.064, 0.165), 5e-4),
]


def check_catalogue_figures() -> list[str]:
    """The catalogue's printed bands agree with the exact enclosures to the precision they are printed at."""
    failures = []
    for label, name, l, steps, policy, (lo, hi), half_unit in CATALOGUE_FIGURES:
        sched = (
            SCHEDULES[name]
            if policy is None
            else dataclasses.replace(SCHEDULES[name], policy=policy)
        )
        enc = certified_band(sched, l, steps=steps)
        ok = abs(float(enc.m_lo) - lo) <= half_unit and abs(float(enc.M_hi) - hi) <= half_unit
        print(
            f"  {label:38s} catalogue [{lo}, {hi}]  exact [{float(enc.m_lo):.6f}, {float(enc.M_hi):.6f}]"
            f"  {'agrees' if ok else 'DIFFERS'}"
        )
        if not ok:
            failures.append(
                f"{label}: catalogue [{lo}, {hi}] vs exact [{float(enc.m_lo)!r}, {float(enc.M_hi)!r}]"
            )
    return failures


def _positive_critical_points_only_band(sched: Schedule, l: float) -> tuple[float, float]:
    """A wrong band: critical points of negative sign ignored (the mistake proofs/newton_schulz.md warns of)."""
    lo, hi = l, 1.0
    for coefficients in sched.steps_for(None):
        xs = [lo, hi] + [x for x in critical_points(coefficients) if 0 < x and lo < x < hi]
        values = [step_polynomial(x, coefficients) for x in xs]
        lo, hi = min(values), max(values)
    return lo, hi


def broken_claims() -> list[tuple[str, Schedule, tuple[float, float]]]:
    """Deliberately false claims the certificate must reject: (what is wrong, schedule, claimed band)."""
    keller = SCHEDULES["keller"]
    keller_band = schedule_band(keller, LOWER)
    claims = []
    for label, a in (
        ("keller with a x 1.05", 3.4445 * 1.05),
        ("keller with a + 1e-9", 3.4445 + 1e-9),
    ):
        broken = dataclasses.replace(keller, name=label, coefficients=((a, -4.7750, 2.0315),))
        claims.append(
            (f"{label}, claimed keller's band", broken, (keller_band.min, keller_band.max))
        )
    aol_old = SCHEDULES["aol_old"]
    claims.append(
        (
            "aol_old, band without negative critical points",
            aol_old,
            _positive_critical_points_only_band(aol_old, LOWER),
        )
    )
    return claims


def check_negative_controls() -> list[str]:
    """Each broken claim is rejected by check_schedule_claim."""
    failures = []
    for label, sched, claimed in broken_claims():
        rejected = check_schedule_claim(sched, claimed, LOWER)
        print(
            f"  {label:58s} {'rejected' if rejected else 'ACCEPTED'}: {rejected[0] if rejected else ''}"
        )
        if not rejected:
            failures.append(f"negative control accepted: {label}")
    return failures


# ---------------------------------------------------------------------------------------------------
# Momentum (proofs/momentum.md)


def _proportional(u: list[Fraction], v: list[Fraction]) -> bool:
    return all(u[i] * v[j] == u[j] * v[i] for i in range(len(u)) for j in range(len(u)))


def momentum_runs(
    mus: Sequence[Fraction], grads: Sequence[list[Fraction]]
) -> list[dict[str, list[Fraction]]]:
    """Exact EMA, sum and optax buffers and Nesterov inputs after each step (muon_ref/functional.py forms)."""
    ema = total = [Fraction(0)] * len(grads[0])
    out = []
    for t, (mu, g) in enumerate(zip(mus, grads), start=1):
        ema = [m + (1 - mu) * (x - m) for m, x in zip(ema, g)]  # M.lerp(G, 1 - mu)
        total = [m * mu + x for m, x in zip(total, g)]  # M * mu + G
        optax = [mu * m / (1 - mu ** (t + 1)) + (1 - mu) * x / (1 - mu**t) for m, x in zip(ema, g)]
        out.append(
            dict(
                ema=ema,
                sum=total,
                ema_nesterov=[x + mu * (m - x) for m, x in zip(ema, g)],
                sum_nesterov=[x + mu * m for m, x in zip(total, g)],
                optax_nesterov=optax,
            )
        )
    return out


def check_momentum_identity() -> list[str]:
    """Constant mu: EMA = (1 - mu) * sum for buffers and Nesterov inputs, exactly; varying mu and optax's bias
    correction break the proportionality (controls: the check can fail)."""
    rng = random.Random(0)
    grads = [
        [Fraction(rng.randint(-99, 99), rng.randint(1, 99)) for _ in range(4)] for _ in range(8)
    ]
    mu = Fraction(0.95)  # every preset's momentum (muon_ref/presets.py), as its exact binary value
    failures = []
    for t, run in enumerate(momentum_runs([mu] * len(grads), grads), start=1):
        for ema, total in (("ema", "sum"), ("ema_nesterov", "sum_nesterov")):
            if run[ema] != [(1 - mu) * x for x in run[total]]:
                failures.append(f"step {t}: {ema} != (1 - mu) * {total}")
    varying = momentum_runs([Fraction(0.9), Fraction(0.95), Fraction(0.99)] * 3, grads)[-1]
    constant = momentum_runs([mu] * len(grads), grads)[-1]
    controls = {
        "varying mu: ema vs sum": _proportional(varying["ema"], varying["sum"]),
        "optax bias-corrected Nesterov vs EMA Nesterov": _proportional(
            constant["optax_nesterov"], constant["ema_nesterov"]
        ),
    }
    print(
        f"  constant mu = 0.95, {len(grads)} steps, 4 entries: EMA = (1 - mu) sum exactly: {not failures}"
    )
    for label, proportional in controls.items():
        print(f"  control, {label}: proportional = {proportional} (expected False)")
        if proportional:
            failures.append(f"control unexpectedly proportional: {label}")
    return failures


# ---------------------------------------------------------------------------------------------------
# Learning-rate shape scale (proofs/lr_scale.md)

LR_TABLE = Path(__file__).with_name("lr_scale.md")


def lr_table_rows() -> list[tuple[str, list[str]]]:
    """(formula, muon_ref names) per row of the table in proofs/lr_scale.md: first and last backticked cells."""
    rows = []
    for line in LR_TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`") and not set(cells[0]) <= set("-`"):
            rows.append((cells[0].strip("`"), re.findall(r"`([^`]+)`", cells[-1])))
    return rows


def _correctly_rounded_sqrt(x: float, r: float) -> bool:
    """|r - sqrt(x)| <= ulp(r) / 2, decided exactly: (r - h)^2 <= x <= (r + h)^2 with h = ulp(r) / 2."""
    h = Fraction(math.ulp(r)) / 2
    return (Fraction(r) - h) ** 2 <= Fraction(x) <= (Fraction(r) + h) ** 2


def _formula_mismatch(name: str, formula: str, sqrt: str) -> tuple[int, int] | None:
    """The first (fan_out, fan_in) in 1..40 where lr_scale(name) differs from the formula's bits, if any."""
    root = math.sqrt if sqrt == "sqrt" else (lambda x: x**0.5)
    code = compile(formula, str(LR_TABLE), "eval")
    for fo in range(1, 41):
        for fi in range(1, 41):
            if lr_scale(name, fo, fi, sqrt) != eval(
                code, {"sqrt": root, "max": max}, {"fo": fo, "fi": fi}
            ):
                return fo, fi
    return None


def check_lr_scale_table() -> list[str]:
    """proofs/lr_scale.md's table is muon_ref's: each formula equals lr_scale of each muon_ref name in its row,
    bitwise, with either square root, on fan_out, fan_in in 1..40; every alias is in exactly one row."""
    failures, seen = [], []
    rows = lr_table_rows()
    for formula, names in rows:
        seen += names
        for name in names:
            for sqrt in ("sqrt", "pow"):
                bad = _formula_mismatch(name, formula, sqrt)
                if bad:
                    failures.append(
                        f"lr_scale({name!r}, sqrt={sqrt!r}) != {formula} at (fan_out, fan_in) = {bad}"
                    )
    if sorted(seen) != sorted(LR_SCALE_ALIASES):
        failures.append(
            f"muon_ref names in proofs/lr_scale.md {sorted(seen)} != {sorted(LR_SCALE_ALIASES)}"
        )
    print(
        f"  {len(rows)} formulas, {len(seen)} muon_ref names, bitwise on 1600 shapes with either square root"
    )
    return failures


def check_sqrt_vs_pow() -> list[str]:
    """math.sqrt(145 / 9) is the correctly rounded root and (145 / 9) ** 0.5 the float next to it."""
    x = 145 / 9  # the ratio pinned in tests/test_presets.py
    by_sqrt, by_pow = math.sqrt(x), x**0.5
    one_ulp = by_pow in (math.nextafter(by_sqrt, math.inf), math.nextafter(by_sqrt, -math.inf))
    print(
        f"  145/9: math.sqrt {by_sqrt!r} correctly rounded: {_correctly_rounded_sqrt(x, by_sqrt)}; "
        f"** 0.5 {by_pow!r} correctly rounded: {_correctly_rounded_sqrt(x, by_pow)}, one ulp away: {one_ulp}"
    )
    if _correctly_rounded_sqrt(x, by_sqrt) and not _correctly_rounded_sqrt(x, by_pow) and one_ulp:
        return []
    return [
        f"145/9: math.sqrt {by_sqrt!r}, ** 0.5 {by_pow!r}: not (correctly rounded, one ulp off)"
    ]


def check_broken_planner() -> list[str]:
    """A planner that drops the remainder batch must fail the plan checker (or the checker proves nothing)."""
    failures = check_case(BROKEN_CASE, dropping_remainder_planner)
    print(f"  a planner that drops the remainder: {len(failures)} invariant failures reported")
    return (
        [] if failures else ["the plan checker accepted a planner that drops the remainder batch"]
    )


CHECKS: list[NamedCheck] = [
    (
        "schedule certificates: exact band enclosures contain schedule_band",
        check_schedule_certificates,
    ),
    ("catalogue figures agree with the exact bands", check_catalogue_figures),
    ("negative controls: broken band claims are rejected", check_negative_controls),
    ("momentum: EMA = (1 - mu) * sum for constant mu, exactly", check_momentum_identity),
    ("lr scale: proofs/lr_scale.md's table is muon_ref's", check_lr_scale_table),
    ("lr scale: math.sqrt vs ** 0.5, exactly", check_sqrt_vs_pow),
    (
        "plan checker: muon_dist's planner and paths route every element (proofs/plan_check.py)",
        check_plans,
    ),
    ("negative control: a broken planner is rejected by the plan checker", check_broken_planner),
]


def main(checks: Sequence[NamedCheck] = CHECKS) -> int:
    """Run every check, print a short report; 0 when all hold, 1 otherwise (a check that raises has failed)."""
    failed = 0
    start = time.perf_counter()
    for name, check in checks:
        t0 = time.perf_counter()
        print(f"{name}")
        try:
            failures = check()
        except Exception as error:  # noqa: BLE001 - reported as this check's failure; the others still run
            failures = [f"raised {type(error).__name__}: {error}"]
        failed += bool(failures)
        for failure in failures:
            print(f"  FAIL: {failure}")
        print(
            f"  -> {'ok' if not failures else f'{len(failures)} failure(s)'} ({time.perf_counter() - t0:.2f} s)"
        )
    print(
        f"proofs.check: {len(checks) - failed}/{len(checks)} checks hold ({time.perf_counter() - start:.1f} s)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
