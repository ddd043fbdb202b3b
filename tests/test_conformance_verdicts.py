"""Verdicts of the conformance check on candidates written independently of the oracle: correct FSDP2 engines
conform (with their shard-local elementwise rounding named), a convention is named when other departures are
present, and the rounding convention never excuses a real difference (negative controls)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from muon_check.adapters.cases import (
    LONG_SAVE,
    Case,
    family_shapes,
    in_family,
    local_box,
    save_step,
)
from muon_check.adapters.controls import (
    GatherControl,
    GatherEngine,
    newton_schulz,
)
from muon_check.adapters.oracle import (
    ROUNDINGS,
    judge,
    reference_steps,
    shard_ranges,
)
from muon_check.conformance import check

pytestmark = pytest.mark.timeout(300)


def quiet(*_: Any) -> None:
    pass


def test_shard_ranges_tile_every_param():
    for mode, family in (("dtensor", "uneven"), ("dtensor", "empty"), ("unreduced", "straddle")):
        for W in (2, 3, 4):
            shapes = family_shapes(family, mode, W)
            if shapes is None:
                continue
            case = Case(family, mode, W, shapes)
            for shape, ranges in zip(shapes, shard_ranges(case, 0)):
                flat = [i for a, b in ranges for i in range(a, b)]
                assert flat == list(range(math.prod(shape))), (mode, family, W, ranges)


def _results(case: Case, per_step: list, momentum: list) -> list[dict]:
    """Every rank's result as the workers report it, made of full tensors."""
    return [
        {
            "first_step": 0,
            "params": [[local_box(t, case, r) for t in step] for step in per_step],
            "errors": [None] * len(per_step),
            "momentum": [local_box(m, case, r) for m in momentum],
        }
        for r in range(case.world_size)
    ]


def test_the_rounding_convention_does_not_excuse_a_one_ulp_difference():
    """Negative control: results equal to the reference except one element, one ulp away where no rounding of
    ELEMENTWISE puts it, are not conforming; the same results without the bump are."""
    case = Case("even", "dtensor", 2, family_shapes("even", "dtensor", 2), "bfloat16", 2)
    refs = {r: reference_steps(case, "torch", {}, r)["skip"] for r in ROUNDINGS}
    per_step, momentum = refs[ROUNDINGS[0]].params, refs[ROUNDINGS[0]].final_momenta
    last = per_step[-1][0]
    agree = torch.ones(last.shape, dtype=torch.bool)
    for run in refs.values():
        agree &= run.params[-1][0].view(torch.int16) == last.view(torch.int16)
    index = tuple(int(i) for i in agree.nonzero()[0])
    bumped = last.clone()
    bumped.view(torch.int16)[index] += 1  # the next bf16 value away from zero: one ulp
    assert bumped[index] != last[index]
    assert judge(case, [(2, _results(case, per_step, momentum))], "torch", {}).status == "bitwise"
    wrong = [*per_step[:-1], [bumped, *per_step[-1][1:]]]
    outcome = judge(case, [(2, _results(case, wrong, momentum))], "torch", {})
    assert outcome.status == "differs" and outcome.elementwise is None


class SumMomentumEngine(GatherEngine):
    """A gather engine with sum-style momentum and Nesterov as add(alpha) (Moonlight's convention):
        M <- mu * M + G;   D = G + mu * M
    and, in bf16 only, one real defect: the decay factor 1 - lr * wd is rounded to bf16 (a foreach multiply in
    place with a Python float does that on CPU: 0.998 becomes 0.99609375, twice the decay)."""

    @torch.no_grad()
    def step(self, closure=None):
        items = [(p, g) for g in self.param_groups for p in g["params"]]
        stepping = self._stepping([p for p, _ in items])
        work = []
        for (p, group), on in zip(items, stepping):
            if not on:
                continue
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            buf = self.state[p]["momentum_buffer"]
            buf = buf.to_local() if hasattr(buf, "to_local") else buf
            buf.mul_(group["momentum"]).add_(local)
            work.append((p, group, local.add(buf, alpha=group["momentum"])))
        boxes = self.orthogonalized([(p, d) for p, _, d in work])
        for (p, group, _), box in zip(work, boxes):
            m, n = p.shape[0], math.prod(p.shape[1:])
            shard = p.to_local() if hasattr(p, "to_local") else p
            factor = 1 - group["lr"] * group["weight_decay"]
            if shard.dtype == torch.bfloat16:
                factor = torch.tensor(factor, dtype=torch.bfloat16)  # the defect
            shard.mul_(factor)
            shard.add_(box, alpha=-(group["lr"] * math.sqrt(max(1, m / n))))


class SumMomentumControl(GatherControl):
    name, engine = "sum momentum with a bf16 defect", SumMomentumEngine
    families = frozenset({"tall", "square", "wide", "even", "uneven"})


def test_a_convention_is_named_beside_a_bf16_only_departure_located_at_its_stage():
    report = check(SumMomentumControl(), (2,), 2, 60.0, 0.0, log=quiet)
    diagnosis = report["diagnosis"]
    assert "conventions by partition: float32" in diagnosis, diagnosis
    assert "momentum_style='sum'" in diagnosis, diagnosis
    # located under the float32 convention: momentum and direction equal, the decay departs
    assert "weight decay departs on" in diagnosis and "bfloat16 only" in diagnosis, diagnosis
    assert "the decay factor 1 - lr * wd = 0.998 rounded to bfloat16 (0.99609375)" in diagnosis, (
        diagnosis
    )
    assert report["verdict"] == "departs"


def test_newton_schulz_of_the_controls_is_torchs():
    from torch.optim._muon import _zeropower_via_newtonschulz

    x = torch.randn(6, 4)
    want = _zeropower_via_newtonschulz(x, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert torch.equal(newton_schulz(x), want)


def _resumed_segments(case: Case, reference: dict, loaded_state: list[dict]) -> list:
    """A resume_long case's two segments made of the reference's own params and momentum (both bitwise): the
    save's ranks with their state at the save (a float32 counter at 257 and the momentum box), the resume's
    with `loaded_state` right after the load."""
    per_step, momentum = reference["skip"].params, reference["skip"].final_momenta
    save = save_step(case)
    saved = [
        {"step": ("float32", "cpu", torch.tensor(257.0)), "momentum_buffer": ("float32", "cpu", m)}
        for m in momentum
    ]
    first = _results(case, per_step[:save], momentum)
    for r in first:
        r["state"] = saved
    second = _results(case, per_step[save:], momentum)
    for rank, r in enumerate(second):
        r["first_step"] = save
        r["loaded"] = [local_box(t, case, rank) for t in per_step[save - 1]]
        r["loaded_state"] = loaded_state or saved
    return [(case.world_size, first), (case.world_size, second)]


def test_state_changed_by_a_load_departs_even_where_every_param_is_bitwise():
    """The state comparison of resume_long on results made of the reference itself, at W = 1: the same state
    conforms; a counter loaded as bf16, and a key lost by the load, each depart with the place named, and the
    diagnosis calls it a bug of the resume (no configuration of muon_ref can explain state)."""
    from muon_check.adapters.diagnose import diagnose

    case = Case("resume_long", "dtensor", 1, ((2, 3),), steps=LONG_SAVE + 1, resume_world_size=1)
    assert in_family(case)
    reference = reference_steps(case, "torch", {})
    same = judge(case, _resumed_segments(case, reference, []), "torch", {}, reference)
    assert same.status == "bitwise" and same.resumed is None
    momentum = reference["skip"].final_momenta[0]
    recast = [
        {
            "step": ("bfloat16", "cpu", torch.tensor(256.0, dtype=torch.bfloat16)),
            "momentum_buffer": ("float32", "cpu", momentum),
        }
    ]
    lost = [{"step": ("float32", "cpu", torch.tensor(257.0))}]
    outcomes = []
    for loaded, said in (
        (
            recast,
            "param 0 state 'step' on rank 0: saved float32 cpu 257.0, loaded bfloat16 cpu 256.0",
        ),
        (lost, "param 0 state 'momentum_buffer' on rank 0: lost by the load"),
    ):
        o = judge(case, _resumed_segments(case, reference, loaded), "torch", {}, reference)
        assert o.status == "differs" and o.max_diff == 0.0 and o.resumed.startswith(said), o.resumed
        outcomes.append(o)
    assert diagnose(outcomes + [same], "torch", {}).endswith(
        "the resume changes the optimizer state on resume_long (2/3: W=1)"
    )
