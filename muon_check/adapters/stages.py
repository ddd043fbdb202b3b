"""The stage at which a departing candidate first leaves its claim, found by replaying muon_ref stage by stage from the
candidate's own state.

At the first step s that departs (params or recorded momentum), from the candidate's own params P and momentum M
after step s - 1 (the reference's momentum where the candidate exposes none: up to s - 1 both agree) and the step's
gradient G, the claim's stages give (muon_ref.functional)

    M', D  = momentum_direction(G, M)     momentum, then the Nesterov input D
    O      = orthogonalize(D)             Newton-Schulz input and normalisation, then the orthogonalised direction
    P'     = apply_update(P, O)           = c * P - a * O: weight decay c = 1 - lr * wd, shape scale a = lr * s,
                                            and the application (the ops' order, dtype and memory layout)

and they are compared with what the candidate shows after step s, in this order:
    momentum      its momentum after step s differs from M' bit for bit (the field's momentum forms are named where
                  one gives its bits: sum or EMA, mu rounded to the param's dtype, float32, weight decay coupled into
                  the gradient, a buffer normalised in place);
    application   its params are P as they were: it does not step the param at all;
    shape scale, weight decay, application: its params are apply_update(P, O) under one of the known variants of
                  that stage, bit for bit (another lr_scale or square root, lr rounded to the dtype; the decay factor
                  rounded to the param's dtype, bf16 or fp16, the other decay form, no decay; another scale_apply or
                  update dtype);
    Nesterov input, Newton-Schulz input and normalisation, orthogonalised direction: its params are P' with the
                  direction of one alternative of that stage, bit for bit (the field's Nesterov forms;
                  NORMALISATION_OPTIONS; DIRECTION_OPTIONS);
    application   otherwise, its params are within one unit in the last place of P' (a rounding of the update's
                  ops, their dtype or memory order, or a difference before them too small to show in that dtype);
    weight decay  or shape scale: otherwise, P_cand - P' = alpha * P + beta * O up to FIT_ULPS units in the last
                  place (least squares in float64): the decay factor is about c + alpha, the step size about
                  a - beta; the larger of the two terms names the stage;
    Nesterov input, Newton-Schulz input and normalisation, orthogonalised direction: otherwise, the stage of the
                  alternative that brings the params CLOSER times nearer the candidate's than the claim does (the
                  first stage that departs, where later stages depart too: its distance is said);
    orthogonalised direction: otherwise, with the relative distance of the candidate's implied update
                  (c * P - P_cand) / a from O.
The first stage over the case's departing params is the case's (Located).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import Tensor

from muon_ref import MuonConfig, apply_update, momentum_direction, orthogonalize
from muon_ref.config import lr_scale
from muon_ref.functional import decay
from muon_ref.optim import group_config

from ..fixtures import same_bits
from .cases import Case, initial_params, oracle_gradients
from .oracle import Outcome, is_stack, reference_optimizer, reference_steps
from .routing import full_params

STAGES = (
    "momentum",
    "Nesterov input",
    "Newton-Schulz input and normalisation",
    "orthogonalised direction",
    "shape scale",
    "weight decay",
    "application",
)
FIT_ULPS = 2.0  # a fit explains a departure when what it leaves is within this many units in the last place
CLOSER = 4.0  # an alternative names the stage when it brings the params this many times closer than the claim

NORMALISATION_OPTIONS: tuple[dict[str, Any], ...] = (
    *({"eps": e} for e in (1e-6, 1e-7, 1e-8, 0.0)),
    {"eps_mode": "add"},
    {"eps_mode": "clamp"},
    {"normalize_before_cast": True},
    {"normalize_before_cast": False},
    *({"ns_dtype": d} for d in (None, torch.float32, torch.bfloat16, torch.float16)),
)
DIRECTION_OPTIONS: tuple[dict[str, Any], ...] = (
    *({"schedule": s} for s in ("keller", "you5", "polar_express", "polar_express_modded")),
    *({"step_form": f} for f in ("addmm", "keller", "dion")),
    *({"ns_stack": s} for s in ("per_matrix", "batched")),  # tried on stacks only (_alternatives)
)


@dataclass(frozen=True)
class Located:
    """stage: one of STAGES; step: the first departing step (1-based); param: its index; detail: what differs;
    exact: whether a named variant of the stage gives the candidate's bits."""

    stage: str
    step: int
    param: int
    detail: str
    exact: bool = (
        False  # a named variant gives the candidate's bits (not a rounding, a fit or a distance)
    )

    def describe(self) -> str:
        return f"step {self.step}, param {self.param}: {self.detail}"


def _full_momentum(case: Case, segments: list, view: Any, step: int) -> list[Tensor | None]:
    """The candidate's whole momentum per param after `step` (0-based), where its view exposes it on every rank."""
    for _, results in segments:
        if step not in results[0].get("recorded", {}):
            continue
        out: list[Tensor | None] = []
        for i in range(len(case.shapes)):
            parts = [view.momentum(r, i, step) for r in results]
            if any(p is None for p in parts):
                out.append(None)
            elif case.mode == "dtensor":
                out.append(torch.cat(parts, 0))
            else:
                out.append(parts[0])
        return out
    return [None] * len(case.shapes)


def _configs(case: Case, preset: str | None, overrides: dict[str, Any]) -> list[tuple]:
    """(MuonConfig, MatrixLayout) of each param under the claim, read from the reference optimizer itself."""
    params = initial_params(case)
    opt = reference_optimizer(params, case, preset, overrides)
    out = []
    for p, group in zip(params, opt.param_groups):
        out.append((group_config(group), opt.layout_of(p, group)))
    return out


def update_vanishes(case: Case, preset: str | None, overrides: dict[str, Any]) -> bool:
    """Whether the claim's first update of every param of the case is exactly zero (its Newton-Schulz input
    underflows: the tiny family's gradients of 2^-40 cast to float16): the case then cannot show a scale bug."""
    grads = oracle_gradients(case, 0)
    for (cfg, layout), p, g in zip(_configs(case, preset, overrides), initial_params(case), grads):
        if g is None:
            continue
        # on the case's device, as the oracle ran
        _, D = momentum_direction(g, torch.zeros_like(g), cfg)
        if orthogonalize(D, layout, cfg).abs().max() != 0:
            return False
    return True


def is_stack_mode(located: Located) -> bool:
    """Whether a located departure is, bit for bit, the claim's under the other stack mode (an ns_stack alternative
    of DIRECTION_OPTIONS, named by _direction_named): a rounding the check accepts, not the departure itself."""
    return located.exact and located.detail.startswith("reproduced with ns_stack=")


def locate(outcome: Outcome, preset: str | None, overrides: dict[str, Any]) -> Located | None:
    """The first stage at which the case departs (module docstring), or None where the replay cannot read the
    candidate's state at that step (a crash, a case without its params)."""
    case, segments, view = outcome.case, outcome.results, outcome.view
    if outcome.first_step is None or segments is None or view is None:
        return None
    s = _first_departing_step(outcome)
    if s is None:
        return None
    before = initial_params(case) if s == 0 else full_params(case, segments, s - 1)
    after = full_params(case, segments, s)
    if before is None or after is None:
        return None
    m_before = (
        [torch.zeros_like(p) for p in before]
        if s == 0
        else _full_momentum(case, segments, view, s - 1)
    )
    m_after = _full_momentum(case, segments, view, s)
    reference = reference_steps(case, preset, overrides)["skip"]
    grads = oracle_gradients(case, s)
    dev = torch.device(case.device)
    found = []
    for i, (cfg, layout) in enumerate(_configs(case, preset, overrides)):
        if i in outcome.routed:
            continue
        if grads[i] is None:  # the claim leaves a param without a gradient as it is
            if _differs(after[i].to(dev), before[i].to(dev), outcome.tolerance):
                found.append(
                    _stepped_without_gradient(i, s, before[i].to(dev), after[i].to(dev), cfg)
                )
            continue
        m_prev = m_before[i]
        if m_prev is None:
            m_prev = reference.momenta[s - 1][i] if s > 0 else torch.zeros_like(before[i])
        located = _param(  # replayed on the case's device: its kernels' bits are the candidate's and the oracle's
            i,
            s,
            before[i].to(dev),
            after[i].to(dev),
            m_prev.to(dev),
            None if m_after[i] is None else m_after[i].to(dev),
            grads[i].to(dev),
            cfg,
            layout,
            outcome.tolerance,
        )
        if located is not None:
            found.append(located)
    return min(found, key=lambda x: STAGES.index(x.stage), default=None)


def _first_departing_step(outcome: Outcome) -> int | None:
    """The first step (0-based) whose params or recorded momentum differ; with a tolerance, by more than it (None
    where none does: a case that departs only in what a step does not show, its replicas or its resumed state)."""
    if outcome.tolerance is None:
        return outcome.first_step - 1
    diffs = [
        max(p, m or 0.0)
        for p, m in zip(
            outcome.param_diffs, outcome.momentum_diffs or (None,) * len(outcome.param_diffs)
        )
    ]
    return next((k for k, d in enumerate(diffs) if d > outcome.tolerance), None)


def _stepped_without_gradient(
    i: int, s: int, P: Tensor, P_cand: Tensor, cfg: MuonConfig
) -> Located:
    """A param without a gradient at step s that the candidate changed anyway: by the claim's decay alone (it
    stepped on a zero gradient), or otherwise."""
    if same_bits(P_cand, decay(P, cfg)):
        return Located(
            "weight decay",
            s + 1,
            i,
            "a param without a gradient at this step is decayed (stepped as if its gradient were zero); the claim "
            "leaves it as it is",
            exact=True,
        )
    return Located(
        "application",
        s + 1,
        i,
        "a param without a gradient at this step is changed; the claim leaves it as it is",
    )


def _param(
    i: int,
    s: int,
    P: Tensor,
    P_cand: Tensor,
    M: Tensor,
    M_cand: Tensor | None,
    G: Tensor,
    cfg: MuonConfig,
    layout: Any,
    tolerance: float | None = None,
) -> Located | None:
    """The stage at which param i departs at step s (module docstring); a candidate compared at a tolerance (one
    that differs from itself) departs only where a stage differs by more."""
    M_new, D = momentum_direction(G, M.to(G.dtype), cfg)
    if M_cand is not None and _differs(M_cand.to(M_new.dtype), M_new, tolerance):
        detail = _momentum_detail(M_cand, M_new, G, M, P, cfg)
        return Located("momentum", s + 1, i, detail, detail.startswith("its momentum is"))
    O = orthogonalize(D, layout, cfg)
    P_new = apply_update(P, O, layout, cfg)
    if not _differs(P_cand, P_new, tolerance):
        return None
    named = _exact_departure(P, P_cand, G, M_new, D, O, cfg, layout)
    if named is not None:
        return Located(named[0], s + 1, i, named[1], exact=True)
    stage, detail = _nearest_departure(P, P_cand, P_new, G, M_new, D, O, cfg, layout)
    return Located(stage, s + 1, i, detail)


def _exact_departure(
    P: Tensor,
    P_cand: Tensor,
    G: Tensor,
    M_new: Tensor,
    D: Tensor,
    O: Tensor,
    cfg: MuonConfig,
    layout: Any,
) -> tuple[str, str] | None:
    """(stage, what) where the candidate's params are, bit for bit, the param left as it is, a named variant of
    the shape scale, the decay or the application, or an alternative of the direction's stages; else None."""
    if same_bits(P_cand, P):
        return (
            "application",
            "the param is left as it is (no update, no decay): the candidate does not step it; the claim does",
        )
    for stage, variants in (
        ("shape scale", _scale_variants(cfg, P.dtype)),
        ("weight decay", _decay_variants(cfg, P.dtype)),
        ("application", _apply_variants(cfg)),
    ):
        for text, alt in variants:
            if same_bits(P_cand, apply_update(P, O, layout, alt)):
                return stage, text
    return _direction_named(P, P_cand, G, M_new, D, cfg, layout)


def _nearest_departure(
    P: Tensor,
    P_cand: Tensor,
    P_new: Tensor,
    G: Tensor,
    M_new: Tensor,
    D: Tensor,
    O: Tensor,
    cfg: MuonConfig,
    layout: Any,
) -> tuple[str, str]:
    """(stage, what) of a departure no variant reproduces: a rounding within one unit in the last place, else a
    least-squares fit of the step or the decay, else the closest alternative, else the distance from the claim."""
    ulp = _spacing(P_new)
    ratio = ((P_cand.double() - P_new.double()).abs() / ulp).max().item()
    if ratio <= 1.0:
        return (
            "application",
            f"a rounding: within {ratio:.2g} unit in the last place of {_dtype(P_new)} (the update's ops, "
            f"their dtype or memory order, or a difference before them too small to show in {_dtype(P_new)})",
        )
    fit = _fit(P, P_cand, P_new, O)
    c, a = _factors(cfg, layout)
    if fit is not None:
        return _fitted(fit, c, a)
    closest = _closest(P, P_cand, P_new, G, M_new, D, cfg, layout)
    if closest is not None:
        return closest[0], closest[1]
    return "orthogonalised direction", _distance(P, P_cand, O, c, a)


def _fitted(fit: tuple[float, float, float, float], c: float, a: float) -> tuple[str, str]:
    """(stage, what) a least-squares fit (_fit) names: the step where its update term outweighs its param term,
    else the decay, each against the claim's factor (c, a: _factors)."""
    alpha, beta, norm_p, norm_o = fit
    if abs(beta) * norm_o >= abs(alpha) * norm_p:
        return (
            "shape scale",
            f"the update is applied with a step of about {a - beta:.6g} where the claim's lr * scale is "
            f"{a:.6g} (a least-squares fit)",
        )
    return (
        "weight decay",
        f"the params are scaled by about {c + alpha:.7g} where the claim's 1 - lr * wd is {c:.7g} (a "
        "least-squares fit)",
    )


def _rounded(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=torch.float64).to(dtype))


def _decay_variants(cfg: MuonConfig, dtype: torch.dtype) -> list[tuple[str, MuonConfig]]:
    """Decays the field gets wrong in a known way: the factor rounded to a narrower dtype (an in-place foreach
    multiply with a Python float rounds it to the tensor's dtype on CPU), the other decay form, no decay."""
    lr, wd = float(cfg.lr), cfg.weight_decay
    c = 1 - lr * wd
    out = []
    for narrow in dict.fromkeys([dtype, torch.bfloat16, torch.float16]):
        r = _rounded(c, narrow)
        if r != c and lr > 0 and narrow.is_floating_point:
            text = f"the decay factor 1 - lr * wd = {c:.7g} rounded to {_name(narrow)} ({r:.9g})"
            out.append((text, cfg.replace(weight_decay=(1 - r) / lr)))
    other = "add_self" if cfg.weight_decay_form == "mul" else "mul"
    out.append((f"weight_decay_form={other!r}", cfg.replace(weight_decay_form=other)))
    if wd:
        out.append(("no weight decay", cfg.replace(weight_decay=0.0)))
    return out


def _scale_variants(cfg: MuonConfig, dtype: torch.dtype) -> list[tuple[str, MuonConfig]]:
    """Other shape scales (muon_ref.config.lr_scale), the other square root, and a learning rate rounded to the
    param's dtype."""
    out = [
        (f"lr_scale={name!r}", cfg.replace(lr_scale=name))
        for name in ("original", "match_rms_adamw", "spectral_norm", "spectral", "none")
        if name != cfg.lr_scale
    ]
    other = "pow" if cfg.scale_sqrt == "sqrt" else "sqrt"
    out.append((f"scale_sqrt={other!r}", cfg.replace(scale_sqrt=other)))
    lr = float(cfg.lr)
    if _rounded(lr, dtype) != lr:
        text = f"the learning rate rounded to {_name(dtype)}"
        out.append(
            (
                text,
                cfg.replace(
                    lr=_rounded(lr, dtype), weight_decay=cfg.weight_decay * lr / _rounded(lr, dtype)
                ),
            )
        )
    return out


def _apply_variants(cfg: MuonConfig) -> list[tuple[str, MuonConfig]]:
    """The other ways the field applies the scaled update (scale_apply) and its dtype (update_dtype)."""
    out = [
        (f"scale_apply={form!r}", cfg.replace(scale_apply=form))
        for form in ("alpha", "update", "update_lr", "update_lr_cast")
        if form != cfg.scale_apply
    ]
    for dtype in (None, torch.float32, torch.bfloat16):
        if dtype != cfg.update_dtype:
            out.append((f"update_dtype={_value(dtype)}", cfg.replace(update_dtype=dtype)))
    return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _alternatives(
    P: Tensor, G: Tensor, M_new: Tensor, D: Tensor, cfg: MuonConfig, layout: Any
) -> Iterator[tuple[str, str, Tensor]]:
    """(stage, what, params) of each alternative of the direction's stages: the field's Nesterov forms
    (NESTEROV_FORMS, with the claim's Newton-Schulz), then NORMALISATION_OPTIONS and DIRECTION_OPTIONS (on the
    claim's direction; the stack modes only on a param of two or more matrices in one stack)."""
    mu = cfg.momentum
    forms = {
        "the momentum itself (no Nesterov)": M_new,
        "G.add(M', alpha=mu)": G.add(M_new, alpha=mu),
        "M' * mu + G": M_new.mul(mu).add(G),
        "lerp(G, M', mu)": G.lerp(M_new, mu),
        "G + M'": G.add(M_new),
    }
    for name, D_alt in forms.items():
        if not same_bits(D_alt, D):
            P_alt = apply_update(P, orthogonalize(D_alt, layout, cfg), layout, cfg)
            yield "Nesterov input", f"its Newton-Schulz input is {name}", P_alt
    for stage, options in (
        ("Newton-Schulz input and normalisation", NORMALISATION_OPTIONS),
        ("orthogonalised direction", DIRECTION_OPTIONS),
    ):
        for option in options:
            try:
                alt = cfg.replace(**option)
            except ValueError:
                continue
            if "ns_stack" in option and not is_stack(layout):
                continue  # a stack mode changes nothing where there is no stack
            if alt != cfg:
                text = ", ".join(f"{k}={_value(v)}" for k, v in option.items())
                yield stage, text, apply_update(P, orthogonalize(D, layout, alt), layout, alt)


def _direction_named(
    P: Tensor,
    P_cand: Tensor,
    G: Tensor,
    M_new: Tensor,
    D: Tensor,
    cfg: MuonConfig,
    layout: Any,
) -> tuple[str, str] | None:
    """(stage, what) where one alternative of the direction's stages gives the candidate's params bit for bit."""
    for stage, text, P_alt in _alternatives(P, G, M_new, D, cfg, layout):
        if same_bits(P_cand, P_alt):
            prefix = "" if stage == "Nesterov input" else "reproduced with "
            return stage, prefix + text
    return None


def _closest(
    P: Tensor,
    P_cand: Tensor,
    P_new: Tensor,
    G: Tensor,
    M_new: Tensor,
    D: Tensor,
    cfg: MuonConfig,
    layout: Any,
) -> tuple[str, str] | None:
    """(stage, what) of the alternative that brings the params CLOSER times nearer the candidate's than the claim
    does (max |dP|), where one does: the first stage that departs when later ones depart too."""
    claim = (P_cand.double() - P_new.double()).abs().max().item()
    best = None
    for stage, text, P_alt in _alternatives(P, G, M_new, D, cfg, layout):
        d = (P_cand.double() - P_alt.double()).abs().max().item()
        if best is None or d < best[0]:
            best = (d, stage, text)
    if best is None or best[0] * CLOSER > claim:
        return None
    d, stage, text = best
    return (
        stage,
        f"closest to {text}: max |dP| {d:.3g} from the candidate where the claim is {claim:.3g}",
    )


def _distance(P: Tensor, P_cand: Tensor, O: Tensor, c: float, a: float) -> str:
    """How far the candidate's implied update (c * P - P_cand) / a is from the claim's Newton-Schulz output."""
    implied = (c * P.double() - P_cand.double()) / a if a else None
    distance = (
        ((implied - O.double()).norm() / O.double().norm().clamp_min(1e-300)).item()
        if implied is not None
        else math.nan
    )
    return (
        f"its implied update is {distance:.3g} (relative) from the claim's Newton-Schulz output; no single "
        "Newton-Schulz option reproduces it"
    )


def _momentum_detail(
    M_cand: Tensor, M_new: Tensor, G: Tensor, M: Tensor, P: Tensor, cfg: MuonConfig
) -> str:
    """What the candidate's momentum is, where one of the field's forms gives its bits."""
    mu = cfg.momentum
    coupled = G.add(
        P.to(G.dtype), alpha=cfg.weight_decay
    )  # weight decay coupled into the gradient (L2)
    forms = {
        "M * mu + (G + wd * P) (sum, weight decay coupled into the gradient)": M.to(G.dtype)
        .mul(mu)
        .add(coupled),
        "lerp(M, G + wd * P, 1 - mu) (EMA, weight decay coupled into the gradient)": M.to(
            G.dtype
        ).lerp(coupled, 1 - mu),
        "lerp(M, G, 1 - mu) (EMA)": M.to(G.dtype).lerp(G, 1 - mu),
        "M * mu + G (sum)": M.to(G.dtype).mul(mu).add(G),
        f"M * {_dtype(G)}(mu) + G (mu rounded to the param's dtype)": M.to(G.dtype)
        .mul(torch.tensor(mu, dtype=G.dtype))
        .add(G),
        "lerp(M, G, 1 - mu) in float32": M.float().lerp(G.float(), 1 - mu),
        "M * mu + G in float32": M.float().mul(mu).add(G.float()),
        "the claim's momentum divided by its Frobenius norm, clamped at eps (a buffer normalised in place: the "
        "Newton-Schulz input aliases it)": M_new / M_new.norm().clamp(min=cfg.eps),
        "the claim's momentum divided by its Frobenius norm plus eps (a buffer normalised in place)": M_new
        / (M_new.norm() + cfg.eps),
    }
    for name, value in forms.items():
        if same_bits(M_cand, value):
            return f"its momentum is {name}"
    d = (M_cand.double() - M_new.double()).abs().max().item()
    return f"max |dM| {d:.3g} from the claim's momentum"


def _differs(got: Tensor, want: Tensor, tolerance: float | None) -> bool:
    """Other bits, or (with a tolerance) a difference beyond it."""
    if same_bits(got, want):
        return False
    return tolerance is None or (got.double() - want.double()).abs().max().item() > tolerance


def _spacing(t: Tensor) -> Tensor:
    """One unit in the last place of each element of t, at its value or at t's RMS where that is larger (an element
    near zero, whose own unit is tiny, is measured as the tensor's others are: oracle.max_ulps)."""
    rms = t.double().pow(2).mean().sqrt().to(t.dtype)
    a = torch.maximum(t.abs(), rms)
    return (
        (torch.nextafter(a, torch.full_like(a, math.inf)) - a)
        .double()
        .clamp_min(torch.finfo(t.dtype).tiny)
    )


def _fit(
    P: Tensor, P_cand: Tensor, P_ref: Tensor, O: Tensor
) -> tuple[float, float, float, float] | None:
    """(alpha, beta, |P|, |O|) of P_cand - P_ref = alpha * P + beta * O, when what the fit leaves is within FIT_ULPS
    units in the last place of P_ref; None otherwise."""
    d = (P_cand.double() - P_ref.double()).reshape(-1)
    basis = torch.stack([P.double().reshape(-1), O.double().reshape(-1)], 1)
    if d.numel() < 2:
        return None
    x = torch.linalg.lstsq(basis, d.unsqueeze(1)).solution.squeeze(1)
    rest = (d - basis @ x).abs() / _spacing(P_ref).reshape(-1)
    if rest.max().item() > FIT_ULPS:
        return None
    return float(x[0]), float(x[1]), float(basis[:, 0].norm()), float(basis[:, 1].norm())


def _factors(cfg: MuonConfig, layout: Any) -> tuple[float, float]:
    """(c, a): the claim's decay factor 1 - lr * wd and step lr * scale (of the layout's matrices)."""
    lr = float(cfg.lr)
    c = 1 - lr * cfg.weight_decay
    if layout.separate:
        return c, lr
    return c, lr * lr_scale(
        cfg.lr_scale, layout.fan_out, layout.fan_in, cfg.scale_sqrt
    ) * cfg.scale_factor


def _dtype(t: Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _value(v: Any) -> str:
    return str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else repr(v)


__all__ = ["STAGES", "Located", "locate", "update_vanishes"]
