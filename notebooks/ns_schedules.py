# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Newton-Schulz schedules: the scalar picture
#
# Every schedule in `muon_ref.SCHEDULES` is a list of odd quintics
# $p_t(x) = a_t x + b_t x^3 + c_t x^5$. With $X = U S V^\top$ one step gives $U\,p_t(S)\,V^\top$,
# so a schedule acts on each normalised singular value through the scalar map
# $f = p_k \circ \dots \circ p_1$ and
# $\|NS(G) - UV^\top\|_2 = \max_i |f(s_i) - 1|$
# (`docs/schedules.md`, "Theory").
#
# This notebook draws, for every registered schedule:
# 1. each step polynomial on $[0, 1.2]$ with its fixed points ($p(x) = x$) and critical points ($p'(x) = 0$);
# 2. the composed map $f$ on a log axis over $[10^{-4}, 1]$;
# 3. the exact band $[\min f, \max f]$ over $[l, 1]$ as a function of the lower bound $l$ (`schedule_band`);
# 4. the band after each step, at $l = 10^{-3}$;
# 5. a summary table: step policy, matrix products, band, sign flips.
#
# Everything here is fp64 scalar arithmetic; `ns_numerics.ipynb` runs the matrices.

# %%
import math

import matplotlib.pyplot as plt
import numpy as np
import torch

from muon_ref import SCHEDULES, critical_points, fixed_points, scalar_map, schedule_band, step_polynomial

plt.rcParams.update({"figure.dpi": 90, "axes.grid": True, "grid.alpha": 0.3, "font.size": 9})
torch.set_num_threads(1)  # small matrices: one thread is as fast, and immune to oversubscription on a shared CPU
NAMES = list(SCHEDULES)
print(f"{len(NAMES)} schedules: {', '.join(NAMES)}")

# %% [markdown]
# Schedules are drawn in three families so that each panel stays legible. A schedule registered later
# (see `design_a_schedule.ipynb`) lands in "other".

# %%
FAMILIES = {
    "one polynomial, repeated": ["cubic", "quintic", "keller", "deepseekv4"],
    "tuned lists": ["you5", "you6", "cubic5", "aol_old", "aol"],
    "Polar Express family": [
        "polar_express_paper", "polar_express", "polar_express_nemo",
        "polar_express_modded", "polar_express_dao", "cans",
    ],
}
known = {name for members in FAMILIES.values() for name in members}
FAMILIES = {f: [n for n in members if n in SCHEDULES] for f, members in FAMILIES.items()}
if set(NAMES) - known:
    FAMILIES["other"] = [n for n in NAMES if n not in known]


def label(name: str) -> str:
    """Legend label; aol's scalar map leaves out its AOL preconditioner (a diagonal rescaling of rows)."""
    return name + (" (no preconditioner)" if SCHEDULES[name].precondition else "")


# %% [markdown]
# ## 1. Step polynomials
# One panel per schedule, one curve per *distinct* step (a cycled constant schedule has one).
# Circles: fixed points $p(x) = x$ in $(0, 1.2]$; crosses: critical points $p'(x) = 0$ in $(0, 1.2]$.
# The classical cubic and quintic (and the last Polar Express steps) have $p(1) = 1$ and $p'(1) = 0$: 1 is
# a superattracting fixed point. The aggressive first steps of the tuned lists give that up: they are
# steep near 0 and only map the interval into a band around 1.

# %%
def distinct_steps(name: str) -> list[tuple[int, tuple[float, float, float]]]:
    """(first step index, coefficients) of each distinct polynomial, in order of first use."""
    seen: dict[tuple[float, float, float], int] = {}
    for t, coefficients in enumerate(SCHEDULES[name].steps_for()):
        seen.setdefault(coefficients, t)
    return [(t, coefficients) for coefficients, t in seen.items()]


x = np.linspace(0.0, 1.2, 600)
ncols = 4
nrows = math.ceil(len(NAMES) / ncols)
fig, axes = plt.subplots(nrows, ncols, figsize=(16, 3.4 * nrows), sharex=True)
for ax, name in zip(axes.flat, NAMES):
    for t, coefficients in distinct_steps(name):
        (line,) = ax.plot(x, [step_polynomial(v, coefficients) for v in x], lw=1.2, label=f"step {t + 1}")
        fps = [v for v in fixed_points(coefficients) if v <= 1.2]
        cps = [v for v in critical_points(coefficients) if 0 < v <= 1.2]
        ax.plot(fps, fps, "o", ms=5, mfc="none", color=line.get_color())
        ax.plot(cps, [step_polynomial(v, coefficients) for v in cps], "x", ms=6, color=line.get_color())
    ax.plot(x, x, "k--", lw=0.8, label="y = x")
    ax.axhline(1.0, color="k", lw=0.6, ls=":")
    ax.set_ylim(-1.5, 2.5)
    ax.set_title(label(name), fontsize=10)
    ax.legend(fontsize=6, loc="lower right", ncol=2)
for ax in axes.flat[len(NAMES):]:
    ax.set_visible(False)
for ax in axes[-1]:
    ax.set_xlabel("x (singular value entering the step)")
for ax in axes[:, 0]:
    ax.set_ylabel("p_t(x)")
fig.suptitle("Step polynomials on [0, 1.2]: o = fixed point p(x) = x, x = critical point p'(x) = 0", y=1.0)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 2. The composed map over $[10^{-4}, 1]$
# Frobenius normalisation puts every singular value in $(0, 1]$, so this is the whole story in exact
# arithmetic. Top row: $f(s)$; a curve that crosses below 0 is a sign flip (the output's singular
# direction is reversed). Bottom row: the error $|f(s) - 1|$ on a log scale, which separates schedules
# that converge (Polar Express reaches ~1e-15) from those that stop at a band (keller, the 5-step lists).

# %%
xs = torch.logspace(-4, 0, 2000, dtype=torch.float64)
ncols = len(FAMILIES)
fig, axes = plt.subplots(2, ncols, figsize=(5.2 * ncols, 8), sharex=True, sharey="row", squeeze=False)
for col, (family, members) in enumerate(FAMILIES.items()):
    top, bottom = axes[0, col], axes[1, col]
    for name in members:
        f = scalar_map(name, xs)
        (line,) = top.plot(xs, f, lw=1.2, label=label(name))
        bottom.plot(xs, (f - 1).abs().clamp_min(1e-17), lw=1.0, color=line.get_color())
    top.axhline(1.0, color="k", lw=0.7, ls=":")
    top.axhline(0.0, color="k", lw=0.5)
    top.set_ylim(-1.2, 1.4)
    top.set_title(family)
    top.legend(fontsize=7, loc="upper left")
    bottom.set_xscale("log")
    bottom.set_yscale("log")
    bottom.set_ylim(1e-16, 10)
    bottom.set_xlabel("normalised singular value s / ||G||_F (log)")
axes[0, 0].set_ylabel("f(s), default number of steps")
axes[1, 0].set_ylabel("|f(s) - 1| (log)")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. The exact band versus the lower bound $l$
# `schedule_band(name, l)` pushes $[l, 1]$ through each step using the endpoints and the real critical
# points (negative ones included), so it is the exact range of $f$ on $[l, 1]$, not a sampled one.
# Solid: $\min f$; dashed: $\max f$. A marker shows the lower bound a schedule was designed for, where
# its source states one.

# %%
lowers = np.logspace(-5, -0.3, 80)
fig, axes = plt.subplots(1, len(FAMILIES), figsize=(5.2 * len(FAMILIES), 4.2), sharey=True)
for ax, (family, members) in zip(np.atleast_1d(axes), FAMILIES.items()):
    for name in members:
        bands = [schedule_band(name, float(l)) for l in lowers]
        (line,) = ax.plot(lowers, [b.min for b in bands], lw=1.3, label=label(name))
        ax.plot(lowers, [b.max for b in bands], lw=1.0, ls="--", color=line.get_color())
        l_design = SCHEDULES[name].design_lower_bound
        if l_design is not None:
            ax.plot([l_design], [schedule_band(name, l_design).min], "o", color=line.get_color())
    ax.axhline(1.0, color="k", lw=0.7, ls=":")
    ax.set_xscale("log")
    ax.set_ylim(-1.2, 1.6)
    ax.set_title(family)
    ax.set_xlabel("lower bound l of the input interval [l, 1] (log)")
    ax.legend(fontsize=7, loc="lower right")
np.atleast_1d(axes)[0].set_ylabel("band of f on [l, 1]: min (solid), max (dashed)")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 4. The band after each step, at $l = 10^{-3}$
# The shaded region is the exact image of $[10^{-3}, 1]$ after step $t$ (step 0 is the input), on a log
# axis so that the tiny lower ends are visible. A band that reaches below zero (a sign flip) is drawn on
# a symmetric-log axis instead.

# %%
L0 = 1e-3
ncols = 5
nrows = math.ceil(len(NAMES) / ncols)
fig, axes = plt.subplots(nrows, ncols, figsize=(16, 2.9 * nrows), sharex=False)
for ax, name in zip(axes.flat, NAMES):
    band = schedule_band(name, L0)
    lo = [L0] + [b[0] for b in band.per_step]
    hi = [1.0] + [b[1] for b in band.per_step]
    steps = np.arange(len(lo))
    ax.fill_between(steps, lo, hi, alpha=0.3)
    ax.plot(steps, lo, ".-", lw=1, label="min")
    ax.plot(steps, hi, ".-", lw=1, label="max")
    ax.axhline(1.0, color="k", lw=0.6, ls=":")
    if band.sign_flip:
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_ylim(-3, 3)
    else:
        ax.set_yscale("log")
        ax.set_ylim(5e-4, 3)
    ax.set_title(f"{label(name)}\nfinal [{band.min:.4f}, {band.max:.4f}]", fontsize=9,
                 color="red" if band.sign_flip else "black")
    ax.set_xticks(steps)
for ax in axes.flat[len(NAMES):]:
    ax.set_visible(False)
for ax in axes[-1]:
    ax.set_xlabel("step t")
for ax in axes[:, 0]:
    ax.set_ylabel("image of [1e-3, 1] (log)")
axes.flat[0].legend(fontsize=7, loc="lower right")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 5. Cost: matrix products per step
# One step $X \leftarrow aX + (bA + cA^2)X$ with $A = XX^\top$ costs three products: $XX^\top$, $A A$
# and $BX$ (`Schedule.matmuls_per_step`). For an $m \times n$ input with $m \le n$ (the kernel transposes
# to make it so) that is $m^2 n + m^3 + m^2 n$ multiply-adds, i.e. $2(2m^2 n + m^3)$ flops per step.
# **When $c = 0$ (a cubic step) $A A$ is not needed: 2 products.** The kernel does not make that
# optimisation today (it always runs the addmm with $c = 0$); the column "if c == 0 skipped" shows what
# it would save. The AOL preconditioner of `aol` reuses the first Gram, so it adds no product.

# %%
def matmul_counts(name: str) -> tuple[int, int]:
    """(products as run, products if every c == 0 step skipped A @ A) for the default step count."""
    steps = SCHEDULES[name].steps_for()
    run = SCHEDULES[name].matmuls_per_step * len(steps)
    return run, run - sum(1 for _, _, c in steps if c == 0.0)


def flops(name: str, m: int, n: int) -> float:
    """Flops of the default run on an m x n input (m <= n): 2 m^2 n per Gram and per B X, 2 m^3 per A A."""
    m, n = min(m, n), max(m, n)
    steps = SCHEDULES[name].steps_for()
    return sum(4 * m * m * n + (2 * m**3 if c != 0.0 else 0) for _, _, c in steps)


# %% [markdown]
# ## 6. Summary
# Band columns are exact (fp64) over $[10^{-3}, 1]$ and over the schedule's design interval where one is
# stated. "flip" marks a band that reaches below zero. GFLOP for a 1024 x 4096 input, as run.

# %%
header = ["schedule", "policy", "steps", "safety", "l design", "band [1e-3, 1]", "band [l design, 1]",
          "flip", "matmuls", "if c==0 skipped", "GFLOP 1024x4096"]
rows = []
for name in NAMES:
    s = SCHEDULES[name]
    band = schedule_band(name, 1e-3)
    design = schedule_band(name, s.design_lower_bound) if s.design_lower_bound else None
    run, skipped = matmul_counts(name)
    rows.append([
        label(name), s.policy, str(s.default_steps), f"{s.safety:g}",
        f"{s.design_lower_bound:g}" if s.design_lower_bound else "-",
        f"[{band.min:.4f}, {band.max:.4f}]",
        f"[{design.min:.4f}, {design.max:.4f}]" if design else "-",
        "YES" if band.sign_flip else "", str(run), str(skipped) if skipped != run else "-",
        f"{flops(name, 1024, 4096) / 1e9:.1f}",
    ])
widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
print("  ".join("-" * w for w in widths))
for r in rows:
    print("  ".join(v.ljust(w) for v, w in zip(r, widths)))

# %% [markdown]
# Reading the table:
# - `keller` never converges to 1: its repeated map has the invariant band [0.6818, 1.1344]; Muon does
#   not need exact orthogonality and trades it for fewer steps.
# - The Polar Express lists reach [1, 1] to ~1e-15 in 8 steps; the 5-step variants stop at
#   [0.86, 1.14] (`modded`) and [0.73, 1.12] (`dao`).
# - `aol_old` flips signs: its first step maps 1 to $p_1(1) = -0.585$. It was designed for
#   AOL-preconditioned inputs, whose singular values stay below the first critical point.
# - `cubic` and `cubic5` are the only schedules where skipping $A A$ would pay (one product in three).

# %% [markdown]
# Facts pinned by this notebook (they fail the notebook if a schedule's coefficients change):

# %%
assert schedule_band("aol_old", 1e-3).sign_flip
assert abs(step_polynomial(1.0, SCHEDULES["aol_old"].coefficients[0]) + 0.585) < 1e-3
keller = schedule_band("keller", 1e-3, steps=50)
assert abs(keller.min - 0.6818) < 1e-4 and abs(keller.max - 1.1344) < 1e-4
assert abs(schedule_band("polar_express", 1e-3).min - 1) < 1e-12
assert not any(schedule_band(n, 1e-3).sign_flip for n in NAMES if n != "aol_old")
print("pinned facts hold")
