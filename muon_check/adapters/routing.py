"""Which params a candidate orthogonalises, and which it sends to another optimizer (routing).

A Muon orthogonalises each matrix's update: the update's singular values are pulled together (Newton-Schulz maps
every singular value of the normalised direction into a band around 1), where the direction's are spread. Read
from the first step, where the momentum is a multiple of the gradient G for every convention:

    U     = (1 - lr * wd) * P0 - P1        the candidate's update (its decay taken out at the claim's lr and wd)
    U_ref = (1 - lr * wd) * P0 - P1_ref    the claim's (reference) update
    spread(M) = log(sigma_max(M) / sigma_min(M)), the largest over the matrices of a view of the param
    readable iff ||U_ref|| >= SIGNAL * ||half an ulp of P1_ref|| (the update stands out of the params' rounding:
        not so for bf16 params at small learning rates); then
    decidable iff some view has matrices with both sides >= 2 and spread(G) - spread(U_ref) > log(1.5) (the claim
        visibly orthogonalises)
    orthogonalised(U) iff |spread(U) - spread(U_ref)| <= |spread(U) - spread(G)| in some view: the claim's layout,
        a 3-D or larger param flattened to (shape[0], -1), or a 3-D param's matrices along any two of its axes
    elementwise(U) iff cos(U, G) >= ELEMENTWISE_COS and U keeps G's spread in every view (within SAME_SPREAD,
        relative), or cos(U, sign(G)) >= SIGN_COS with U read with the claim's decay taken out or with none (the
        other optimizer may decay otherwise): the update is a multiple of the gradient (SGD, momentum SGD, coupled
        decay included) or of its sign (a sign update: Adam's first step, whatever its eps)

A param is routed to another optimizer when
    its optimizer state holds an Adam-style second moment (momentum.second_moment: >= 0 and proportional to G * G
        after the first step) and its update, where it can be read, is Adam's first one, nearly sign(G) (NorMuon
        keeps a second moment of its orthogonalised update, which for a vector is proportional to G * G too), or
    its update is not orthogonalised and is elementwise, or
    its update is a multiple of sign(G) to rounding (cosine >= SIGN_COS, read with or without the claim's decay)
        where the claim's view of G is not nearly orthogonal (cosine with its polar factor <= POLAR_COS), or a
        multiple of G where G is nearly orthogonal in no view (there an orthogonalised update is nearly a multiple
        of it too) and the update has at least half G's spread; never where the claim's own update is a multiple of
        G (gradients below Newton-Schulz's eps): a matrix whose spread is too small for the spread test, stepped by
        SGD or Adam.
A param whose update is not orthogonalised and is not elementwise is a Muon that departs at its orthogonalised
direction (stages.py), not a routing; a candidate none of whose params is orthogonalised anywhere is not a Muon
(diagnose.py).

The rule a candidate routes by is inferred from the shapes it routes and those it orthogonalises (infer_rule), and
a claim may state its rule (Adapter.routing, --routing): RULE is terms joined by " or ", each a feature of
FEATURES, then !=, ==, > or <, then a number: ndim; min_side, max_side, aspect (max / min) of the last two dims;
flat_min_side, flat_aspect of (shape[0], prod(shape[1:])), the matrix an optimizer that flattens sees; numel.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import Tensor

from muon_ref import matrix_layout, read_block

from .cases import Case, initial_params, oracle_gradients
from .momentum import second_moment

# the claim must narrow the spread by this much (log) for the answer to mean anything
DECIDES = math.log(1.5)
ELEMENTWISE_COS = 0.98
# relative: a multiple of G keeps G's spread in every view, up to the decay's noise
SAME_SPREAD = 0.25
SIGN_COS = 0.999
# a gradient this close to its polar factor (in some view) leaves proportion undecided
POLAR_COS = 0.99
# Adam's first update, m / (sqrt(v) + eps), is sign(G) to within its eps
SIGN_LIKE = 0.99
# an update is read only where it is this many times the params' rounding (Frobenius norms)
SIGNAL = 8.0


@dataclass(frozen=True)
class Update:
    """One param's first-step update: spreads of the candidate's update, the claim's and the gradient's, whether
    it is orthogonalised (None: undecidable for this shape or scale) and whether it is elementwise (module
    docstring); routed: why it goes to another optimizer, or None."""

    candidate: float
    claim: float
    gradient: float
    orthogonalised: bool | None
    elementwise: bool
    routed: str | None = None
    # a multiple of G or of sign(G) to rounding (cosine >= SIGN_COS), where that can be told apart
    proportional: bool = False
    follows: bool = False  # a multiple of G to rounding: what a Muon's update of a vector is
    sign_like: bool = False  # nearly sign(G) (cosine >= SIGN_LIKE): Adam's first update
    read: bool = True  # False: the update could not be read (routed by its state alone)

    def describe(self) -> str:
        return (
            f"its update's singular values span {_ratio(self.candidate)} (the claim's {_ratio(self.claim)}, the "
            f"gradient's {_ratio(self.gradient)})"
        )


def _ratio(spread: float) -> str:
    """sigma_min / sigma_max as a figure: 'a ratio of 0.03'."""
    return f"a ratio of {math.exp(-spread):.2g}" if math.isfinite(spread) else "a ratio of 0"


def full_params(case: Case, segments: list, step: int) -> list[Tensor] | None:
    """The candidate's whole params after `step` (0-based), reassembled from the ranks' boxes (torch.chunk boxes
    along dim 0 in dtensor mode, rank 0's copy otherwise), or None where that step is not in the results."""
    for _, results in segments:
        first = results[0]["first_step"]
        k = step - first
        if 0 <= k < len(results[0]["params"]):
            if case.mode != "dtensor":
                return [t.clone() for t in results[0]["params"][k]]
            return [
                torch.cat([r["params"][k][i] for r in results], 0) for i in range(len(case.shapes))
            ]
    return None


View = Callable[[Tensor], list[Tensor]]


def _views(shape: tuple[int, ...], options: dict[str, Any]) -> list[View]:
    """Ways to read a param as matrices (module docstring)."""
    views: list[View] = []
    keys = {k: options.get(k) for k in ("num_experts", "split_sizes", "num_heads")}
    flatten = options.get("flatten", len(shape) >= 4)
    for flat in dict.fromkeys([flatten, True] if len(shape) >= 3 else [flatten]):
        try:
            blocks = matrix_layout(
                shape, flatten=flat, **{k: v for k, v in keys.items() if v}
            ).blocks
        except ValueError:
            continue
        views.append(lambda t, blocks=blocks: [read_block(t, b) for b in blocks])
    if len(shape) == 3:
        views.append(lambda t: list(t.permute(1, 0, 2)))  # (d0, d2) per d1
        views.append(lambda t: list(t.permute(2, 0, 1)))  # (d0, d1) per d2
        views.append(lambda t: [t.reshape(-1, t.shape[-1])])  # (d0 * d1, d2)
    return views


def _rounding(t: Tensor) -> Tensor:
    """Half a unit in the last place of every element of t (its rounding error's bound), in float64."""
    a = t.abs()
    return 0.5 * (torch.nextafter(a, torch.full_like(a, math.inf)) - a).double()


def _polar_cos(t: Tensor) -> float:
    """The cosine between a matrix and its polar factor, sum(s) / (sqrt(k) * |s|) over its singular values s: near 1
    where it is nearly orthogonal already, so that no update can tell an orthogonalisation from the matrix itself."""
    s = torch.linalg.svdvals(t.double())
    norm = s.norm()
    return float(s.sum() / (math.sqrt(s.numel()) * norm)) if norm > 0 else 1.0


def _spread(t: Tensor) -> float:
    s = torch.linalg.svdvals(t.double())
    return math.inf if s[-1] <= 0 else math.log(float(s[0] / s[-1]))


def _cos(a: Tensor, b: Tensor) -> float:
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    norms = a.norm() * b.norm()
    return float(a @ b / norms) if norms > 0 else 0.0


def update_of(
    p0: Tensor, p1: Tensor, p1_ref: Tensor, grad: Tensor, lr: float, wd: float, views: list[View]
) -> Update | None:
    """The Update of one param (None where the params' rounding hides the update; a vector's has no spreads)."""
    decay = 1 - lr * wd
    u = decay * p0.double() - p1.double()
    u_ref = decay * p0.double() - p1_ref.double()
    raw = p0.double() - p1.double()  # the other optimizer may decay otherwise, or not at all
    g = grad.double()
    if u_ref.norm() < SIGNAL * _rounding(p1_ref).norm():
        return None  # the params' rounding is as large as the update (bf16 params, a small lr): nothing to read
    spreads, polar = [], []
    for view in views:
        mats = list(zip(view(u), view(u_ref), view(g)))
        mats = [m for m in mats if min(m[0].shape) >= 2]
        if mats:
            spreads.append(tuple(max(_spread(m[k]) for m in mats) for k in range(3)))
            polar.append(max(_polar_cos(m[2]) for m in mats))
    g_cos = max(_cos(u, g), _cos(raw, g))
    sign_cos = max(_cos(u, g.sign()), _cos(raw, g.sign()))
    # follows G: a multiple of it has its singular values in every view
    follows_g = _cos(u, g) >= ELEMENTWISE_COS and all(
        abs(cand - grad) <= SAME_SPREAD * max(grad, 0.1) for cand, _, grad in spreads
    )
    by_sign = sign_cos >= SIGN_COS and bool(polar) and polar[0] <= POLAR_COS
    by_g = (
        g_cos >= SIGN_COS
        and all(p <= POLAR_COS for p in polar)
        and all(cand >= 0.5 * grad for cand, _, grad in spreads)
    )
    proportional = (by_sign or by_g) and _cos(u_ref, g) <= POLAR_COS
    elementwise = follows_g or sign_cos >= SIGN_COS
    trials = []
    for cand, claim, gradient in spreads:
        decidable = gradient - claim > DECIDES and math.isfinite(claim)
        ortho = (abs(cand - claim) <= abs(cand - gradient)) if decidable else None
        trials.append(Update(cand, claim, gradient, ortho, elementwise, proportional=proportional))
    extra = {"follows": g_cos >= SIGN_COS, "sign_like": sign_cos >= SIGN_LIKE}
    for answer in (True, False, None):  # orthogonalised in some view wins; undecidable last
        chosen = next((t for t in trials if t.orthogonalised is answer), None)
        if chosen is not None:
            return replace(chosen, **extra)
    # no matrix view (a vector): nothing to orthogonalise, only what the update is a multiple of
    return Update(math.nan, math.nan, math.nan, None, elementwise, **extra)


def classify(
    case: Case,
    segments: list,
    reference_params: list[Tensor],
    lr: float,
    wd: float,
    options: dict[str, Any],
) -> dict[int, Update]:
    """param index -> its first-step Update with `routed` set where the candidate sends it to another optimizer
    (module docstring). reference_params: the claim's params after the first step."""
    p1 = full_params(case, segments, 0)
    if p1 is None:
        return {}
    p0, grads = initial_params(case), oracle_gradients(case, 0)
    out = {}
    for i, shape in enumerate(case.shapes):
        if grads[i] is None:
            continue
        views = _views(tuple(shape), {**options, **dict(case.options)})
        update = update_of(p0[i].cpu(), p1[i], reference_params[i], grads[i].cpu(), lr, wd, views)
        moment = second_moment(case, segments, i)
        if moment is not None and (update is None or update.sign_like):
            # a second moment and Adam's first update, where the update can be read: NorMuon keeps a second moment
            # of its orthogonalised update too, which for a vector is proportional to G * G
            base = update or Update(math.nan, math.nan, math.nan, None, True, read=False)
            out[i] = _routed(base, f"Adam-style second moment at state[p]{moment}")
        elif update is not None and update.orthogonalised is False and update.elementwise:
            out[i] = _routed(update, f"not orthogonalised, elementwise: {update.describe()}")
        elif update is not None and update.proportional:
            out[i] = _routed(
                update, f"a multiple of the gradient or of its sign: {update.describe()}"
            )
        elif update is not None:
            out[i] = update
    return out


def _routed(update: Update, why: str) -> Update:
    return replace(update, routed=why)


# ------------------------------------------------------------------------------------------------ rules

_OPS: dict[str, Callable[[float, float], bool]] = {
    "!=": operator.ne,
    "==": operator.eq,
    ">": operator.gt,
    "<": operator.lt,
}
FEATURES = ("ndim", "min_side", "max_side", "aspect", "flat_min_side", "flat_aspect", "numel")
_TERM = re.compile(rf"^\s*({'|'.join(FEATURES)})\s*(!=|==|>|<)\s*([0-9.]+)\s*$")


def _feature(name: str, shape: tuple[int, ...]) -> float:
    """A shape's feature: ndim; min_side, max_side, aspect of its last two dims (a matrix's, an expert's); and
    flat_min_side, flat_aspect of (shape[0], prod(shape[1:])), the matrix a flattening optimizer sees; numel."""
    sides = shape[-2:] if len(shape) >= 2 else shape
    flat = (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else shape
    return {
        "ndim": len(shape),
        "min_side": min(sides),
        "max_side": max(sides),
        "aspect": max(sides) / min(sides),
        "flat_min_side": min(flat),
        "flat_aspect": max(flat) / min(flat),
        "numel": math.prod(shape),
    }[name]


def parse_rule(text: str) -> Callable[[tuple[int, ...]], bool]:
    """The predicate of a routing RULE (module docstring); ValueError naming the bad term and the valid forms."""
    terms = []
    for term in text.split(" or "):
        m = _TERM.match(term)
        if not m:
            raise ValueError(
                f"routing rule term {term.strip()!r} is not one of: {'|'.join(FEATURES)} followed by "
                "!=, ==, > or < and a number (terms joined by ' or ')"
            )
        terms.append((m.group(1), _OPS[m.group(2)], float(m.group(3))))
    return lambda shape: any(op(_feature(f, tuple(shape)), v) for f, op, v in terms)


def infer_rule(routed: set[tuple[int, ...]], kept: set[tuple[int, ...]]) -> str | None:
    """The simplest rule of one or two terms that sends exactly the `routed` shapes elsewhere and keeps the `kept`
    ones (None when there are none to route, or no such rule separates them)."""
    if not routed:
        return None
    candidates = _single_terms(routed, kept)
    for term in candidates:
        if _separates([term], routed, kept):
            return term
    for i, a in enumerate(candidates):
        for b in candidates[i + 1 :]:
            if _separates([a, b], routed, kept):
                return f"{a} or {b}"
    return None


def _single_terms(routed: set[tuple[int, ...]], kept: set[tuple[int, ...]]) -> list[str]:
    """Terms that route no kept shape, each as wide as the kept shapes allow, simplest first."""
    terms = []
    ndims = {len(s) for s in kept}
    if len(ndims) == 1:
        terms.append(f"ndim != {next(iter(ndims))}")
    elif ndims:
        terms.append(f"ndim > {max(ndims)}")
    for name, low in (
        ("min_side", True),
        ("flat_min_side", True),
        ("aspect", False),
        ("flat_aspect", False),
        ("max_side", False),
        ("numel", True),
    ):
        values = [_feature(name, s) for s in kept]
        if values:
            terms.append(f"{name} < {min(values):g}" if low else f"{name} > {max(values):g}")
    return terms


def _separates(terms: list[str], routed: set, kept: set) -> bool:
    rule = parse_rule(" or ".join(terms))
    return all(rule(s) for s in routed) and not any(rule(s) for s in kept)


__all__ = ["Update", "classify", "full_params", "infer_rule", "parse_rule"]
