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
# # Newton-Schulz numerics: matrices in fp64, fp32, bf16 and fp16
#
# `ns_schedules.ipynb` works with the scalar map $f = p_k \circ \dots \circ p_1$ in exact (fp64)
# arithmetic. Here the kernel `muon_ref.newton_schulz` runs on matrices, and we check:
# 1. the signed singular values of the output, $\mathrm{diag}(U^\top X V)$, against the scalar prediction
#    $f(s_i / d)$, with $d = \max(\|G\|_F \cdot \text{safety}, \varepsilon)$ the kernel's denominator;
# 2. the error metrics against the exact polar factor (`polar_error`, `orthogonality_error`,
#    `max_singular_value_error`);
# 3. the safety-factor ablation (`safety=` 1.00, 1.01, 1.02, 1.05);
# 4. the hazards of `docs/schedules.md`, each reproduced with a fixed seed.
#
# All matrices are at most 256 x 128 so the notebook runs in seconds on a CPU.

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch

from muon_ref import (
    SCHEDULES,
    max_singular_value_error,
    normalised_singular_values,
    newton_schulz,
    orthogonality_error,
    polar_error,
    scalar_map,
    schedule_band,
    signed_singular_values,
)

plt.rcParams.update({"figure.dpi": 90, "axes.grid": True, "grid.alpha": 0.3, "font.size": 9})
torch.set_num_threads(1)  # small matrices: one thread is as fast, and immune to oversubscription on a shared CPU
DEFAULT_EPS = 1e-7  # newton_schulz's eps when the schedule states none (torch/optim/_muon.py EPS)
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """A plain-text table (pandas is not a dependency)."""
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))


# %% [markdown]
# ## Inputs
# Ten inputs, all fp64 and seeded. "tiny-norm" has $\|G\|_F = 10^{-10}$, far below the default
# $\varepsilon = 10^{-7}$; "ill-conditioned" has singular values spaced logarithmically from 1 to
# $10^{-6}$, so its normalised values sweep the whole domain of $f$.

# %%
def orthonormal(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    Q, _ = torch.linalg.qr(torch.randn(rows, cols, generator=g, dtype=torch.float64))
    return Q


def make_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    gaussian = randn(256, 128)
    return {
        "gaussian": gaussian,
        "low-rank+noise": randn(256, 4) @ randn(4, 128) + 1e-3 * randn(256, 128),
        "heavy-tailed": torch.empty(256, 128, dtype=torch.float64).cauchy_(generator=g),
        "rank-1": randn(256, 1) @ randn(1, 128),
        "zero": torch.zeros(256, 128, dtype=torch.float64),
        "tiny-norm": gaussian / gaussian.norm() * 1e-10,
        "ill-conditioned": orthonormal(256, 128, g) @ torch.diag(torch.logspace(0, -6, 128, dtype=torch.float64))
        @ orthonormal(128, 128, g).mT,
        "tall": randn(256, 32),
        "wide": randn(32, 256),
        "batched": randn(4, 64, 32),
    }


INPUTS = make_inputs()


rows = []
for key, G in INPUTS.items():
    x = normalised_singular_values(G, "keller")
    nonzero = x[x > 1e-12 * x.max()] if x.max() > 0 else x
    rows.append([key, "x".join(map(str, G.shape)), f"{float(torch.linalg.matrix_norm(G).max()):.3g}",
                 f"{float(x.max()):.3g}", f"{float(nonzero.min()):.3g}" if nonzero.numel() else "-"])
print_table(["input", "shape", "||G||_F", "max s/d", "min nonzero s/d"], rows)

# %% [markdown]
# Frobenius normalisation guarantees $s/d \le 1$ but shrinks the largest value by up to $\sqrt{\text{rank}}$:
# the 256 x 128 Gaussian lands in about [0.026, 0.15], the rank-1 input exactly at 1.

# %% [markdown]
# ## 1. Signed singular values against the scalar prediction
# On the ill-conditioned input the normalised singular values cover $[4 \cdot 10^{-7}, 0.44]$, so one run
# traces most of $f$. Lines: $f$ in fp64; markers: $\mathrm{diag}(U^\top X V)$ measured per dtype.

# %%
PLOT_SCHEDULES = ["keller", "you5", "polar_express", "cans"]
G = INPUTS["ill-conditioned"]
fig, axes = plt.subplots(1, len(PLOT_SCHEDULES), figsize=(16, 3.8), sharey=True)
for ax, name in zip(axes, PLOT_SCHEDULES):
    x = normalised_singular_values(G, name)
    grid = torch.logspace(-8, 0, 800, dtype=torch.float64)
    ax.plot(grid, scalar_map(name, grid), "k-", lw=1, label="f (fp64 scalar)")
    for (dname, dtype), marker in zip(DTYPES.items(), "os^v"):
        d = signed_singular_values(newton_schulz(G, name, dtype=dtype), G)
        ax.plot(x, d, marker, ms=3.5, mfc="none", label=dname)
    ax.set_xscale("log")
    ax.set_xlim(1e-8, 1)
    ax.set_title(name)
    ax.set_xlabel("normalised singular value s / d (log)")
axes[0].set_ylabel("signed singular value of NS(G)")
axes[0].legend(fontsize=8, loc="upper left")
fig.suptitle("ill-conditioned 256 x 128 input: measured diag(U^T X V) vs the scalar prediction", y=1.02)
fig.tight_layout()
plt.show()

# %% [markdown]
# Deviation from the prediction, $\max_i |\mathrm{diag}(U^\top X V)_i - f(s_i/d)|$ over the nonzero
# singular directions, for every input and dtype (schedule `you5`). fp64 and fp32 follow the scalar
# theory to rounding; bf16 and fp16 deviate by their rounding error, amplified by the steps.

# %%
def prediction_deviation(X: torch.Tensor, G: torch.Tensor, name: str) -> float:
    """max |measured - predicted| signed singular value over directions with s > 1e-12 s_max."""
    measured = signed_singular_values(X, G)
    x = normalised_singular_values(G, name)
    keep = x > 1e-12 * x.amax(dim=-1, keepdim=True)
    if not bool(keep.any()):
        return float(X.abs().max())
    return float((measured - scalar_map(name, x)).abs()[keep].max())


NAME = "you5"
rows = []
for key, G in INPUTS.items():
    rows.append([key] + [f"{prediction_deviation(newton_schulz(G, NAME, dtype=dt), G, NAME):.2e}"
                         for dt in DTYPES.values()])
print_table(["input (you5)"] + list(DTYPES), rows)

# %% [markdown]
# Two fp16 cells stand out, both from the default order "cast, then normalise"
# (`normalize_before_cast=False`): the heavy-tailed input has an entry above fp16's largest finite value
# (65504), which becomes inf, so its norm is inf and the whole output NaN; the tiny-norm input's entries
# (~5e-13) are below fp16's smallest subnormal (6e-8) and become zero. Normalising first avoids the NaN and
# the underflow (the tiny-norm output is then the small, eps-limited one of hazard 4):

# %%
for key in ("heavy-tailed", "tiny-norm"):
    G = INPUTS[key]
    for before in (False, True):
        X = newton_schulz(G, "you5", dtype=torch.float16, normalize_before_cast=before)
        print(f"{key:13s} fp16 normalize_before_cast={before!s:5s}: NaN entries {int(X.isnan().sum()):5d}, "
              f"||X||_2 = {float(torch.linalg.matrix_norm(torch.nan_to_num(X).double(), ord=2)):.3g}")
assert newton_schulz(INPUTS["heavy-tailed"], "you5", dtype=torch.float16).isnan().all()

# %% [markdown]
# ## 2. Error metrics against the polar factor
# `polar_error(X, G)` $= \|X - U_r V_r^\top\|_2$ with $r$ the numerical rank; `max_singular_value_error`
# is the same quantity restricted to $G$'s singular directions (so it ignores the numerical noise in the
# null space); `orthogonality_error` $= \|X^\top X - I\|_2$ is 1 for any rank-deficient input by
# construction (zero singular values stay zero), so it is only meaningful for full-rank inputs.
#
# Each cell: polar error. In exact arithmetic it equals $\max_i |f(s_i/d) - 1|$, so it is large whenever
# some singular value lies below the schedule's working range (low-rank noise, heavy tails,
# ill-conditioning, tiny norm): Newton-Schulz only orthogonalises the part of the spectrum it reaches.

# %%
METRIC_SCHEDULES = ["keller", "you5", "polar_express", "cans", "aol"]
for dname in ("fp32", "bf16"):
    rows = []
    for key, G in INPUTS.items():
        row = [key]
        for name in METRIC_SCHEDULES:
            X = newton_schulz(G, name, dtype=DTYPES[dname])
            row.append(f"{polar_error(X, G):.3g}")
        rows.append(row)
    print(f"\npolar_error, {dname}")
    print_table(["input"] + METRIC_SCHEDULES, rows)

# %%
G = INPUTS["gaussian"]
rows = []
for name in SCHEDULES:
    X = newton_schulz(G, name, dtype=torch.bfloat16)
    band = schedule_band(name, float(normalised_singular_values(G, name).min()),
                         float(normalised_singular_values(G, name).max()))
    rows.append([name, f"{polar_error(X, G):.4f}", f"{orthogonality_error(X):.4f}",
                 f"{max_singular_value_error(X, G):.4f}",
                 f"{max(abs(band.min - 1), abs(band.max - 1)):.4f}" if not SCHEDULES[name].precondition else "n/a"])
print("all schedules, 256 x 128 Gaussian, bf16")
print_table(["schedule", "polar_error", "orthogonality_error", "max_sv_error", "scalar bound (fp64)"], rows)

# %% [markdown]
# The last column is the exact scalar bound $\max |f - 1|$ over this input's normalised range. In bf16,
# `max_sv_error` follows it to within bf16 rounding for every schedule but `cans` (no safety factor,
# hazard 1 below); `polar_express_paper`, the other schedule without one, stays close on this input but
# not on rank-1 inputs. `aol` rescales rows before step 1, so the scalar map does not predict it.

# %% [markdown]
# ### Rank-deficient inputs in low precision: the rounding floor gets orthogonalised
# In exact arithmetic zero singular values stay zero. But casting a rank-1 matrix to bf16 creates a
# rounding "noise floor": after normalisation its second singular value is about 5e-4 (fp16: 6e-5).
# A schedule built to lift everything above $l = 10^{-3}$ lifts that noise too: the bf16 output of
# `polar_express` on a rank-1 input is a full-rank, nearly orthogonal matrix whose extra 127 directions
# are rounding noise, hence its polar error of 1 in the bf16 table above.

# %%
R = INPUTS["rank-1"]
fig, axes = plt.subplots(1, 3, figsize=(15, 3.6), sharey=True)
for ax, dname in zip(axes, ("fp32", "bf16", "fp16")):
    cast = R.to(DTYPES[dname]).double()
    floor = float(torch.linalg.svdvals(cast / cast.norm())[1])
    for name in ("keller", "you5", "polar_express", "cans"):
        sv = torch.linalg.svdvals(torch.nan_to_num(newton_schulz(R, name, dtype=DTYPES[dname]).double()))
        off_scale = f" (max {float(sv.max()):.1e}, off scale)" if sv.max() > 3 else ""
        ax.plot(np.arange(1, sv.numel() + 1), sv.clamp_min(1e-12), lw=1.2, label=name + off_scale,
                ls="--" if name == "keller" else "-")
    ax.set_yscale("log")
    ax.set_ylim(1e-9, 3)
    ax.set_title(f"{dname}: rank-1 input after the cast has 2nd s/d = {floor:.1e}")
    ax.set_xlabel("index i of the output's singular value")
    ax.legend(fontsize=7, loc="lower left")
axes[0].set_ylabel("singular value of NS(G) (log)")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. Safety-factor ablation
# `safety` scales the denominator: $X_0 = G / (\|G\|_F \cdot \text{safety})$, so every normalised value
# lands in $[0, 1/\text{safety}]$ and bf16 rounding cannot push one above 1. The price: the whole
# interval shifts down by the same factor, and the lower end of the band drops.
#
# Inputs: 16 seeded rank-1 matrices (their one normalised singular value is exactly 1, the worst case)
# and the Gaussian. Columns: the largest signed singular value over the 16 rank-1 runs in bf16, the
# number of rank-1 runs whose output is non-finite, and the Gaussian's band in bf16.

# %%
def rank_one_batch(count: int = 16, fan_out: int = 128, fan_in: int = 64, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(count, fan_out, 1, generator=g, dtype=torch.float64)
    v = torch.randn(count, 1, fan_in, generator=g, dtype=torch.float64)
    return u @ v


def top_signed_values(X: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """The signed singular value along G's top direction, per matrix (nan where X is not finite)."""
    finite = torch.isfinite(X).flatten(-2).all(-1)
    d = signed_singular_values(torch.nan_to_num(X), G)[..., 0]
    return torch.where(finite, d, torch.full_like(d, float("nan")))


RANK1 = rank_one_batch()
SAFETIES = [1.00, 1.01, 1.02, 1.05]
ABLATION = ["polar_express_paper", "cans", "polar_express", "you5", "keller"]
ablation = {}
rows = []
for name in ABLATION:
    for safety in SAFETIES:
        top = top_signed_values(newton_schulz(RANK1, name, dtype=torch.bfloat16, safety=safety), RANK1)
        dg = signed_singular_values(newton_schulz(INPUTS["gaussian"], name, dtype=torch.bfloat16, safety=safety),
                                    INPUTS["gaussian"])
        ablation[name, safety] = (top, dg)
        finite = top[torch.isfinite(top)]
        rows.append([name, f"{safety:.2f}", f"{float(finite.max()):.4g}" if finite.numel() else "-",
                     str(int((~torch.isfinite(top)).sum())), f"[{float(dg.min()):.4f}, {float(dg.max()):.4f}]"])
print_table(["schedule", "safety", "rank-1 max (bf16)", "rank-1 non-finite /16", "gaussian band (bf16)"], rows)

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
for name in ABLATION:
    tops = [ablation[name, s][0] for s in SAFETIES]
    worst = [float((top - 1).abs().max()) if torch.isfinite(top).all() else 1e40 for top in tops]
    axes[0].plot(SAFETIES, worst, "o-", label=name)
    axes[1].plot(SAFETIES, [float((ablation[name, s][1] - 1).abs().max()) for s in SAFETIES], "o-", label=name)
axes[0].set_yscale("log")
axes[0].set_title("rank-1 inputs, bf16: max |top signed sv - 1| over 16 seeds\n(1e40 stands for a non-finite output)")
axes[1].set_title("256 x 128 Gaussian, bf16: max |signed sv - 1|\n"
                  "(a safety factor on the input does not protect later steps)")
for ax in axes:
    ax.set_xlabel("safety factor passed to newton_schulz")
    ax.set_xticks(SAFETIES)
axes[0].set_ylabel("max |d_1 - 1| (log)")
axes[1].set_yscale("log")
axes[1].set_ylabel("max_i |d_i - 1| (log)")
axes[0].legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# Reading the ablation: a safety factor on the *input* protects only the first step. It cures the
# rank-1 blow-ups of `polar_express_paper` and `cans`, but it cannot protect the later steps of a schedule
# that has no headroom inside: `polar_express_paper`'s step 2 peaks at 1.966, exactly the upper end of the
# interval step 3 was fitted on, so bf16 rounding of a Gaussian's values near that peak can still
# explode (see the Gaussian column). The shipped `polar_express` also evaluates each step polynomial at
# $x/1.01$, which gives every step its own headroom; its outputs do not move with `safety`.

# %% [markdown]
# ## 4. Hazards, reproduced
# Each cell below pins one hazard with an `assert`, so the notebook fails if it stops reproducing.
#
# ### Hazard 1: bf16 overshoot of schedules built without a safety factor
# A normalised singular value at 1 (rank-1 input) rounds to $1 \pm 2^{-8}$ in bf16. The first Polar
# Express / CANS step is steep there ($p_1'(1) \approx 24$ and 26) and the later steps, tuned for the exact image
# of $[l, 1]$, grow like $x^5$ just past it, so a tiny excess compounds. In fp64 the scalar map shows the
# cliff just above 1, and a scalar model of rounding shows which schedules have no headroom: the
# *rounding-inflated band* widens the interval by a relative $\delta$ before every step
# ($[lo(1-\delta), hi(1+\delta)]$, then the exact step image), $\delta = 2^{-8}$ being bf16's unit
# roundoff. It is a worst case, and it singles out exactly `polar_express_paper` and `cans` (and shows that
# `cubic5`'s first step, whose root is at $x = 1.0035$, can send an overshooting value to zero or below).

# %%
rows = []
for name in SCHEDULES:
    f_above = float(scalar_map(name, torch.tensor(1.0 + 2.0**-8, dtype=torch.float64)))
    rows.append([name, f"{f_above:.4g}"] + ["[{0.min:.4g}, {0.max:.4g}]".format(schedule_band(name, 1e-3, headroom=delta))
                                           for delta in (0.0, 2.0**-9, 2.0**-8)])
print_table(["schedule", "f(1 + 2^-8)", "band [1e-3, 1]", "inflated 2^-9", "inflated 2^-8 (bf16)"], rows)

# %%
rows = []
for name in ["polar_express_paper", "cans", "polar_express", "you5", "cubic5"]:
    for dname in ("fp32", "bf16"):
        top = top_signed_values(newton_schulz(RANK1, name, dtype=DTYPES[dname]), RANK1)
        finite = top[torch.isfinite(top)]
        rows.append([name, dname, f"{float(finite.max()):.4g}" if finite.numel() else "-",
                     f"{float(finite.min()):.4g}" if finite.numel() else "-", str(int((~torch.isfinite(top)).sum()))])
print_table(["schedule", "dtype", "max top sv", "min top sv", "non-finite /16"], rows)


def overshoots(name: str) -> bool:
    top = top_signed_values(newton_schulz(RANK1, name, dtype=torch.bfloat16), RANK1)
    return bool((~torch.isfinite(top)).any() or (top > 1.5).any())


assert overshoots("polar_express_paper") and overshoots("cans")
assert not overshoots("polar_express")  # the shipped list: safety 1.01 in the coefficients and the norm

# %% [markdown]
# ### Hazard 2: the step count is not a free knob for tuned schedules
# A cycled 5-step list run for 6 steps starts over with its first, aggressive polynomial on values
# already near 1; a "repeat last" list can drift past 1. Schedules whose policy is "fixed" refuse any
# other count.

# %%
fig, ax = plt.subplots(figsize=(8, 4))
for name in ["you5", "cans", "keller", "polar_express"]:
    counts = range(1, 13)
    bands = [schedule_band(name, 7e-3, steps=k) for k in counts]
    label = f"{name} (default {SCHEDULES[name].default_steps})"
    (line,) = ax.plot(counts, [b.min for b in bands], "o-", ms=3, label=label)
    ax.plot(counts, [b.max for b in bands], "s--", ms=3, color=line.get_color())
ax.axhline(1.0, color="k", lw=0.6, ls=":")
ax.set_xlabel("number of steps run")
ax.set_ylabel("band of f on [7e-3, 1]: min (solid), max (dashed)")
ax.set_title("Step count vs band: you5 collapses at 6 steps, cans drifts above 1 from 8 steps")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

you5_6 = schedule_band("you5", 7e-3, steps=6)
cans_8 = schedule_band("cans", 7e-3, steps=8)
print(f"you5, 6 steps on [7e-3, 1]: [{you5_6.min:.4f}, {you5_6.max:.4f}]")
print(f"cans, 8 steps on [7e-3, 1]: [{cans_8.min:.4f}, {cans_8.max:.4f}]")
X6 = newton_schulz(INPUTS["gaussian"], "you5", steps=6, dtype=torch.float32)
d6 = signed_singular_values(X6, INPUTS["gaussian"])
print(f"you5, 6 steps on the Gaussian (fp32): signed singular values in [{float(d6.min()):.4f}, {float(d6.max()):.4f}]")
try:
    newton_schulz(INPUTS["gaussian"], "polar_express_modded", steps=6)
except ValueError as err:
    print("fixed schedule:", err)
assert you5_6.max < 0.2 and cans_8.min > 1.0

# %% [markdown]
# ### Hazard 3: `aol_old` flips the sign of large singular values
# Its first polynomial has $p_1(1) = -0.585$: it was tuned for AOL-preconditioned inputs, whose values
# stay below the first critical point. With Frobenius normalisation a rank-1 input (an MoE expert that
# saw one token) comes out pointing the wrong way. The current `aol` applies its preconditioner.

# %%
rows = []
for name in ["aol_old", "aol", "you5"]:
    for dname in ("fp32", "bf16"):
        top = top_signed_values(newton_schulz(RANK1, name, dtype=DTYPES[dname]), RANK1)
        rows.append([name, dname, f"{float(top.min()):.4f}", f"{float(top.max()):.4f}",
                     f"{polar_error(newton_schulz(RANK1, name, dtype=DTYPES[dname]), RANK1):.3f}"])
print_table(["schedule", "dtype", "min top sv", "max top sv", "polar_error"], rows)
assert float(top_signed_values(newton_schulz(RANK1, "aol_old", dtype=torch.float32), RANK1).max()) < -0.9

# %% [markdown]
# ### Hazard 4: tiny-norm input versus eps
# With $d = \max(\|G\|_F, \varepsilon)$, an input whose norm is far below $\varepsilon$ is divided by
# $\varepsilon$ instead of its norm: its normalised values land far below the schedule's working range
# and the output is far from orthogonal (polar error 0.84 for `polar_express`, 0.99 for `keller` in the
# table of section 2; Emerging-Optimizers issue 229 moved eps from 1e-7 to 1e-15). The scalar prediction
# with the clamped denominator still matches the matrix (section 1's table, row "tiny-norm"). In fp16 a
# further trap: the input is cast before it is normalised (the default), and values below fp16's smallest
# subnormal ($6 \times 10^{-8}$) become zero.

# %%
norms = np.logspace(-2, -14, 13)
fig, ax = plt.subplots(figsize=(8, 4))
G0 = INPUTS["gaussian"] / INPUTS["gaussian"].norm()
for eps, dname, style in [(1e-7, "fp32", "o-"), (1e-15, "fp32", "o-"), (1e-7, "bf16", "x--"), (1e-15, "bf16", "x--"),
                          (1e-15, "fp16", "s:")]:
    errs = [polar_error(newton_schulz(G0 * n, "polar_express", eps=eps, dtype=DTYPES[dname]), G0) for n in norms]
    ax.plot(norms, errs, style, ms=4, label=f"eps={eps:g}, {dname}")
ax.set_xscale("log")
ax.invert_xaxis()
ax.set_xlabel("||G||_F (log, decreasing)")
ax.set_ylabel("polar_error (polar_express, 8 steps)")
ax.set_title("Tiny-norm inputs: the eps floor (and fp16 underflow) break orthogonalisation")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

tiny = INPUTS["tiny-norm"]
for eps in (1e-7, 1e-15):
    X = newton_schulz(tiny, "polar_express", eps=eps, dtype=torch.float32)
    x = normalised_singular_values(tiny, "polar_express", eps=eps)
    print(f"||G||_F = 1e-10, eps = {eps:g}: s/d in [{float(x.min()):.2e}, {float(x.max()):.2e}], "
          f"polar_error {polar_error(X, tiny):.3g}, ||X||_2 = {float(torch.linalg.matrix_norm(X.double(), ord=2)):.3g}")
assert polar_error(newton_schulz(tiny, "polar_express", eps=1e-7, dtype=torch.float32), tiny) > 0.5
assert polar_error(newton_schulz(tiny, "polar_express", eps=1e-15, dtype=torch.float32), tiny) < 0.01

# %% [markdown]
# ### Hazard 5: a zero input gives a zero update, never NaN
# Every schedule, every dtype, eps 1e-7 and 0, both eps modes (on a small zero matrix, to keep it quick).

# %%
Z = torch.zeros(2, 48, 32, dtype=torch.float64)
checked = 0
for name in SCHEDULES:
    for dtype in DTYPES.values():
        for eps in (1e-7, 0.0):
            for eps_mode in ("clamp", "add"):
                X = newton_schulz(Z, name, dtype=dtype, eps=eps, eps_mode=eps_mode)
                assert torch.equal(X, torch.zeros_like(X)), (name, dtype, eps, eps_mode)
                checked += 1
print(f"{checked} runs on the zero matrix: all exactly zero, no NaN")
