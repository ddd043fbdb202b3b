"""Reference conformance: each preset against the public implementation it names, bit for bit.

    python -m muon_ref.conformance [--steps 5] [--json FILE]

torch     -> torch.optim.Muon (installed torch)
keller    -> KellerJordan's SingleDeviceMuon (PyPI muon-optimizer 0.1.0)
moonlight, dion, xtuner, emerging -> muon_ref.origins (op-for-op restatements; see that module)
Prints, per preset and case, the max |difference| of parameters and momentum after the steps, and exits
non-zero on any mismatch (the contract is bitwise: torch.equal).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from . import origins
from .optim import Muon


@dataclass(frozen=True)
class Case:
    """One conformance case: a parameter shape, hyperparameters and a step count."""

    preset: str
    shape: tuple[int, ...]
    steps: int = 5
    seed: int = 0
    lr: float | None = None
    weight_decay: float | None = None
    nesterov: bool | None = None
    lr_scale: str | None = None  # torch's adjust_lr_fn / Dion's adjust_lr, by muon_ref name
    num_experts: int | None = None


@dataclass(frozen=True)
class Outcome:
    case: Case
    param_max_diff: float
    state_max_diff: float
    bitwise: bool


def _origin_optimizer(case: Case, p: Tensor) -> tuple[Callable[[], None], Callable[[], Tensor]]:
    """(step, momentum) for the origin named by the case's preset, with the case's hyperparameters."""
    hp = {k: v for k, v in (("lr", case.lr), ("weight_decay", case.weight_decay)) if v is not None}
    if case.preset == "torch":
        fn = {"original": "original", "match_rms_adamw": "match_rms_adamw", None: None}[case.lr_scale]
        opt = torch.optim.Muon([p], nesterov=True if case.nesterov is None else case.nesterov, adjust_lr_fn=fn, **hp)
        return opt.step, lambda: opt.state[p]["momentum_buffer"]
    if case.preset == "keller":
        import muon  # PyPI muon-optimizer 0.1.0

        opt = muon.SingleDeviceMuon([p], **hp)
        return opt.step, lambda: opt.state[p]["momentum_buffer"]
    state: dict = {}
    if case.preset == "moonlight":
        kw = dict(lr=hp.get("lr", 1e-3), wd=hp.get("weight_decay", 0.1), nesterov=case.nesterov is not False)
        return lambda: origins.moonlight_step([p], state, **kw), lambda: state[p]["momentum_buffer"]
    if case.preset in ("dion", "xtuner"):
        kw = dict(nesterov=bool(case.nesterov), **hp)
        if case.lr_scale is not None:
            kw["adjust_lr"] = {"spectral_norm": "spectral_norm", "match_rms_adamw": "rms_norm"}[case.lr_scale]
        if case.preset == "xtuner":
            kw["num_experts"] = case.num_experts or 1
        step = origins.dion_step if case.preset == "dion" else origins.xtuner_step
        return lambda: step([p], state, **kw), lambda: state[p]["momentum"]
    if case.preset == "emerging":
        kw = dict(use_nesterov=bool(case.nesterov), **hp)
        return lambda: origins.emerging_step([p], state, **kw), lambda: state[p]["momentum_buffer"]
    raise ValueError(f"no origin for preset {case.preset!r}")


def _reference_optimizer(case: Case, p: Tensor) -> Muon:
    overrides: dict[str, Any] = {k: v for k, v in (("lr", case.lr), ("weight_decay", case.weight_decay),
                                                   ("nesterov", case.nesterov), ("lr_scale", case.lr_scale),
                                                   ("num_experts", case.num_experts)) if v is not None}
    return Muon([p], preset=case.preset, **overrides)


def run_case(case: Case) -> Outcome:
    """Run the origin and the reference from the same parameter on the same gradients."""
    g = torch.Generator().manual_seed(case.seed)
    p_origin = torch.nn.Parameter(torch.randn(case.shape, generator=g))
    p_ref = torch.nn.Parameter(p_origin.detach().clone())
    origin_step, origin_momentum = _origin_optimizer(case, p_origin)
    ref = _reference_optimizer(case, p_ref)
    for _ in range(case.steps):
        grad = torch.randn(case.shape, generator=g)
        p_origin.grad, p_ref.grad = grad.clone(), grad.clone()
        origin_step()
        ref.step()
    m_origin, m_ref = origin_momentum().reshape(case.shape), ref.state[p_ref]["momentum_buffer"]
    return Outcome(
        case=case,
        param_max_diff=float((p_origin.detach() - p_ref.detach()).abs().max()),
        state_max_diff=float((m_origin - m_ref).abs().max()),
        bitwise=torch.equal(p_origin.detach(), p_ref.detach()) and torch.equal(m_origin, m_ref),
    )


SHAPES_2D = [(64, 32), (32, 64), (48, 48), (1, 40), (37, 23)]


def default_cases(steps: int = 5) -> list[Case]:
    cases: list[Case] = []
    for shape in SHAPES_2D:
        cases += [Case("torch", shape, steps), Case("torch", shape, steps, nesterov=False, lr_scale="match_rms_adamw")]
        cases += [Case("keller", shape, steps), Case("keller", shape, steps, weight_decay=0.1)]
        cases += [Case("moonlight", shape, steps), Case("moonlight", shape, steps, nesterov=False)]
        cases += [Case("dion", shape, steps), Case("dion", shape, steps, nesterov=True, lr_scale="match_rms_adamw")]
        cases += [Case("xtuner", shape, steps), Case("xtuner", shape, steps, nesterov=True)]
        cases += [Case("emerging", shape, steps), Case("emerging", shape, steps, nesterov=True)]
    cases += [Case("keller", (4, 24, 16), steps), Case("dion", (3, 16, 24), steps)]
    cases += [Case("xtuner", (4 * 12, 20), steps, num_experts=4)]
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", metavar="FILE", help="write the outcomes as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    outcomes = [run_case(c) for c in default_cases(args.steps)]
    print(f"muon_ref conformance: each preset against its origin, {args.steps} steps, fp32 params, bf16 NS")
    print(f"{'preset':<10} {'shape':<14} {'options':<38} {'max|dP|':>10} {'max|dM|':>10}  bitwise")
    for o in outcomes:
        c = o.case
        opts = ", ".join(f"{k}={v}" for k, v in (("nesterov", c.nesterov), ("wd", c.weight_decay),
                         ("lr_scale", c.lr_scale), ("num_experts", c.num_experts)) if v is not None) or "defaults"
        print(f"{c.preset:<10} {str(c.shape):<14} {opts:<38} {o.param_max_diff:>10.3g} {o.state_max_diff:>10.3g}  "
              f"{'yes' if o.bitwise else 'NO'}")
    bad = [o for o in outcomes if not o.bitwise]
    print(f"{len(outcomes) - len(bad)}/{len(outcomes)} cases bitwise equal")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(o) for o in outcomes], f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
