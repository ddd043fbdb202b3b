"""The conformance check's decision code, in this process and in seconds: the comparison and its roundings
(oracle.py), where the momentum is found (momentum.py), what an update says about routing (routing.py), the words
of a diagnosis (diagnose.py) and the verdict (conformance.verdict). Each decision is asserted both ways: the answer
where its cause is present, and the other answer where it is absent (the mutation target `check_decisions` runs
these first: docs/mutation.md)."""

from __future__ import annotations

import importlib
import math
from collections import OrderedDict
from typing import Any

import pytest
import torch

import muon_ref
from muon_check.adapters import Adapter
from muon_check.adapters.cases import Case, initial_params, oracle_gradients
from muon_check.adapters.diagnose import Context, Finding, diagnose, findings, phrase
from muon_check.adapters.momentum import find, second_moment, state_paths
from muon_check.adapters.oracle import (
    HYPERPARAMETERS,
    ROUNDINGS,
    WHOLE,
    Outcome,
    View,
    claim_options,
    compare,
    judge,
    max_ulps,
    other_layout,
    reference_steps,
    tried,
)
from muon_check.adapters.routing import Update, classify, update_of
from muon_check.adapters.stages import STAGES
from muon_check.conformance import run_here, verdict

conformance_module = importlib.import_module("muon_check.conformance")
oracle_module = importlib.import_module("muon_check.adapters.oracle")

CASE = Case("tall", "single", 1, ((12, 6),), "float32", steps=2)


def results_of(
    case: Case, params: list[list[torch.Tensor]], states: list[dict] | None = None
) -> list:
    """One rank's result, as the workers report it, made of full tensors: params after each step, the momentum
    the adapter exposes (none), and the recorded state of each step (`states[step]`: per param, path -> tensor)."""
    recorded = {}
    for step in range(len(params)):
        state = states[step] if states else [{} for _ in case.shapes]
        recorded[step] = {"momentum": [None] * len(case.shapes), "state": state}
    return [
        (
            1,
            [
                {
                    "first_step": 0,
                    "params": params,
                    "errors": [None] * len(params),
                    "momentum": [None] * len(case.shapes),
                    "state_keys": [[] for _ in case.shapes],
                    "recorded": recorded,
                }
            ],
        )
    ]


def ranks_of(case: Case, run: Any, states: list[dict]) -> list:
    """Each rank's result after one step of a one-param case: its boxes of the claim's params, no momentum from the
    adapter, and `states[rank]` (path -> tensor) as the state recorded after the step."""
    return [
        (
            len(states),
            [
                {
                    "first_step": 0,
                    "params": [[C.local_box(run.params[0][0], case, rank)]],
                    "errors": [None],
                    "momentum": [None],
                    "recorded": {0: {"momentum": [None], "state": [state]}},
                }
                for rank, state in enumerate(states)
            ],
        )
    ]


def reference_of(case: Case, **overrides: Any):
    """muon_ref under preset torch with the check's hyperparameters (lr 0.02, wd 0.1, momentum 0.9, Nesterov)."""
    return reference_steps(case, "torch", {**HYPERPARAMETERS, **overrides})


def one_ulp_up(t: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(t, torch.full_like(t, math.inf))


# ---------------------------------------------------------------- oracle: the comparison


def test_the_reference_itself_is_bitwise_and_one_ulp_anywhere_differs():
    reference = reference_of(CASE)
    run = reference["skip"]
    assert compare(CASE, results_of(CASE, run.params), reference).status == "bitwise"
    bumped = [list(step) for step in run.params]
    bumped[-1][0] = bumped[-1][0].clone()
    bumped[-1][0][3, 2] = one_ulp_up(bumped[-1][0][3, 2])
    outcome = compare(CASE, results_of(CASE, bumped), reference)
    assert outcome.status == "differs" and outcome.first_step == 2 and outcome.max_ulps == 1.0


def test_a_tolerance_makes_a_small_difference_close_and_never_a_large_one():
    reference = reference_of(CASE)
    run = reference["skip"]
    shifted = [[p + 1e-6 for p in step] for step in run.params]
    view = View(((("none", "test"),)), tolerance=1e-5)
    assert compare(CASE, results_of(CASE, shifted), reference, view).status == "close"
    view = View(((("none", "test"),)), tolerance=1e-7)
    assert compare(CASE, results_of(CASE, shifted), reference, view).status == "differs"


def test_a_routed_param_is_left_out_and_only_it():
    case = Case("mixed", "single", 1, ((12, 6), (6, 12)), "float32", steps=1)
    reference = reference_of(case)
    params = [[reference["skip"].params[0][0], torch.zeros(6, 12)]]
    assert compare(case, results_of(case, params), reference).status == "differs"
    routed = View((("none", "a"), ("none", "b")), routed={1: "Adam"})
    outcome = compare(case, results_of(case, params), reference, routed)
    assert outcome.status == "bitwise" and outcome.routed == {1: "Adam"}
    left = View((("none", "a"), ("none", "b")), routed={0: "Adam"})
    assert compare(case, results_of(case, params), reference, left).status == "differs"


def test_a_momentum_that_departs_after_a_recorded_step_names_that_step():
    reference = reference_of(CASE)
    run = reference["skip"]
    states = [[{"['buf']": run.momenta[0][0]}], [{"['buf']": run.momenta[1][0] * 2}]]
    segments = results_of(CASE, run.params, states)
    view = View.of(CASE, segments, reference)
    assert view.sources == (("state", "['buf']"),)
    outcome = compare(CASE, segments, reference, view)
    assert outcome.status == "differs" and outcome.max_diff == 0.0 and outcome.first_step == 2


def test_max_ulps_counts_units_in_the_last_place_at_the_tensors_scale():
    want = torch.tensor([1.0, 1e-30, -2.0], dtype=torch.bfloat16)
    assert max_ulps(want, want) == 0.0
    assert max_ulps(one_ulp_up(want), want) <= 1.0
    near_zero = want.clone()
    near_zero[1] = 1e-28  # far in its own ulps, nothing at the tensor's RMS
    assert max_ulps(near_zero, want) < 1.0
    assert max_ulps(want.float(), want) == math.inf


def test_the_other_update_layout_is_the_second_rounding_the_oracle_tries_on_one_device():
    assert ROUNDINGS[0] == WHOLE and not any(
        r.local for r in ROUNDINGS if r.other_layout and r.name == "whole"
    )
    assert other_layout("torch", {}) == "contiguous" and other_layout(
        "torch", {"update_layout": "contiguous"}
    ) == ("kernel")
    flipped = next(r for r in ROUNDINGS if r.other_layout and not r.local)
    assert claim_options(CASE, "torch", {}, flipped)["update_layout"] == "contiguous"
    assert "update_layout" not in claim_options(CASE, "torch", {}, WHOLE)


class ContiguousMuon(Adapter):
    name, preset = "contiguous layout", "torch"

    def build(self, params, **hp):
        return muon_ref.Muon(params, preset="torch", update_layout="contiguous", **hp)


def test_a_candidate_in_the_other_layout_conforms_under_the_named_rounding():
    case = Case("tall", "single", 1, ((64, 16),), "bfloat16", steps=2)
    outcome = run_here(ContiguousMuon(), case)
    assert outcome.status == "bitwise"
    direct = judge(
        case, outcome.results, "torch", {**HYPERPARAMETERS, "update_layout": "contiguous"}
    )
    assert direct.status == "bitwise" and direct.elementwise is None
    # where the CPU that runs the test rounds the two layouts differently, only the rounding makes it conform, and it is named
    assert (outcome.elementwise is None) == (
        compare(case, outcome.results, reference_of(case)).status == "bitwise"
    )
    if outcome.elementwise:
        assert "update layout 'contiguous'" in outcome.elementwise


# ---------------------------------------------------------------- a stack's products: each matrix alone or batched

# the module (muon_ref exports its function of the same name too)
NS_MODULE = importlib.import_module("muon_ref.newton_schulz")
STACK_CASE = Case("experts3d", "single", 1, ((3, 6, 4),), "float32", steps=3)


class BatchedStacks(Adapter):
    """muon_ref with each stack's Newton-Schulz run as one batch, claiming preset keller alone (each matrix
    alone): what KellerJordan's Muon does on a 3-D param."""

    name, preset = "batches its stacks", "keller"
    families = frozenset({"experts3d"})

    def build(self, params, **hp):
        return muon_ref.Muon(params, preset="keller", ns_stack="batched", **hp)


class BatchedStacksThenDecays(BatchedStacks):
    """BatchedStacks with twice the weight decay from its second step on: a departure after the stack rounding."""

    def build(self, params, **hp):
        opt = super().build(params, **hp)
        step, calls = opt.step, []

        def stepped(closure=None):
            calls.append(1)
            if len(calls) == 2:
                for group in opt.param_groups:
                    group["weight_decay"] *= 2
            return step(closure)

        opt.step = stepped
        return opt


@pytest.fixture
def batched_rounds_otherwise(monkeypatch):
    """A CPU whose batched products round otherwise than its single ones, simulated: each step of the kernel on a
    [B, m, n] stack (stack="batched") moves its result one unit in the last place up, in the candidate and in the
    reference alike, single matrices untouched; the oracle's kept runs are set aside, so no run from before is read."""
    step = NS_MODULE._step

    def nudged(X, *args):
        out = step(X, *args)
        return one_ulp_up(out) if X.ndim == 3 else out

    monkeypatch.setattr(NS_MODULE, "_step", nudged)
    monkeypatch.setattr(oracle_module, "_kept_runs", OrderedDict())


def test_a_candidate_that_batches_its_stacks_conforms_under_the_named_stack_rounding(
    batched_rounds_otherwise, monkeypatch
):
    """A stack's products batched is a rounding of the kernel, not a configuration: where it changes the bits, the
    case is bitwise under the other ns_stack and names it (oracle.Rounding.other_stack). Control: judged in the
    claim's stack mode only, the same candidate departs, located exactly at the orthogonalised direction."""
    outcome = run_here(BatchedStacks(), STACK_CASE)
    assert outcome.status == "bitwise", outcome.summary()
    assert "ns_stack 'batched'" in (outcome.elementwise or ""), outcome.elementwise
    line = diagnose([outcome], "keller", {})
    assert (
        line.startswith("conforms") and "candidate's Newton-Schulz products and elementwise" in line
    ), line
    assert (
        "ns_stack 'batched' (one batched product over each stack; the claim's is the other)" in line
    ), line
    monkeypatch.setattr(
        oracle_module, "ROUNDINGS", tuple(r for r in ROUNDINGS if not r.other_stack)
    )
    monkeypatch.setattr(oracle_module, "_kept_runs", OrderedDict())
    control = run_here(BatchedStacks(), STACK_CASE)
    assert control.status == "differs" and control.stage == "orthogonalised direction"
    assert control.stage_exact and "reproduced with ns_stack='batched'" in control.stage_detail


def test_a_departure_after_the_stack_rounding_is_located_where_it_is(
    batched_rounds_otherwise, monkeypatch
):
    """A candidate that batches its stacks and departs later is located at its departure (step 2, the decay), under
    the stack mode that its first step shows, never at the stack rounding. Control: without the second location
    (the outcome not judged again under the other stack mode) the rounding of step 1 is what is named."""
    outcome = run_here(BatchedStacksThenDecays(), STACK_CASE)
    assert outcome.status == "differs" and outcome.stage == "weight decay", outcome.stage_detail
    assert outcome.stage_detail.startswith("step 2, param 0")
    assert (
        "(under ns_stack='batched', the stack rounding of its first steps)" in outcome.stage_detail
    )
    monkeypatch.setattr(conformance_module, "judged_under", lambda o, preset, overrides: o)
    control = run_here(BatchedStacksThenDecays(), STACK_CASE)
    assert control.stage == "orthogonalised direction" and control.stage_detail.startswith("step 1")


def test_the_other_stack_mode_is_tried_only_where_a_param_is_a_stack():
    """oracle.tried: the other stack mode only where the reference reads some param as a stack (a 3-D param not
    flattened, fused experts with num_experts); claim_options sets the mode that is not the claim's."""
    stacked = next(r for r in ROUNDINGS if r.other_stack and not r.local and not r.other_layout)
    assert tried(STACK_CASE, stacked, "keller", {}) and not tried(CASE, stacked, "keller", {})
    assert not tried(STACK_CASE, stacked, "keller", {"flatten": True})
    conv = Case("conv4d", "single", 1, ((4, 3, 2, 2),))  # read (4, 12): one matrix
    assert not tried(conv, stacked, "keller", {})
    fused = Case("experts_fused", "single", 1, ((12, 5),), options=(("num_experts", 4),))
    assert tried(fused, stacked, "keller", {})
    assert claim_options(STACK_CASE, "keller", {}, stacked)["ns_stack"] == "batched"
    assert (
        claim_options(STACK_CASE, "keller", {"ns_stack": "batched"}, stacked)["ns_stack"]
        == "per_matrix"
    )


# ---------------------------------------------------------------- momentum found by value


def test_the_momentum_is_found_by_its_bits_then_by_proportion_and_otherwise_not():
    reference = reference_of(CASE)
    run = reference["skip"]
    grad = oracle_gradients(CASE, 0)[0]
    noise = torch.rand(12, 6, generator=torch.Generator().manual_seed(0))
    exact = [[{"[0]['buf']": run.momenta[0][0], "['noise']": noise}]] * 2
    assert find(CASE, results_of(CASE, run.params, exact), reference, 0) == "[0]['buf']"
    doubled = [[{"['m']": grad * 3.0, "['noise']": noise}]] * 2
    assert find(CASE, results_of(CASE, run.params, doubled), reference, 0) == "['m']"
    neither = [[{"['noise']": noise}]] * 2
    segments = results_of(CASE, run.params, neither)
    assert find(CASE, segments, reference, 0) is None
    assert View.of(CASE, segments, reference).sources == (("unmapped", ("['noise']",)),)
    assert View.of(CASE, results_of(CASE, run.params), reference).sources[0][0] == "none"
    assert View.of(CASE, segments, reference, search=False).sources[0] == (
        "none",
        "left out (--state-map none)",
    )
    assert state_paths(segments, 0) == ["['noise']"]


def test_an_adam_second_moment_is_told_from_a_momentum():
    grad = oracle_gradients(CASE, 0)[0]
    run = reference_of(CASE)["skip"]
    adam = [[{"['exp_avg']": grad * 0.1, "['exp_avg_sq']": grad * grad * 1e-3}]]
    assert second_moment(CASE, results_of(CASE, run.params[:1], adam), 0) == "['exp_avg_sq']"
    two = [[{"['exp_avg_sq']": grad * grad * 1e-3, "['v']": grad * grad * 2e-3}]]
    assert (
        second_moment(CASE, results_of(CASE, run.params[:1], two), 0) == "['exp_avg_sq']"
    )  # sorted first
    momentum_only = [[{"['exp_avg']": grad * 0.1, "['abs']": grad.abs()}]]
    assert second_moment(CASE, results_of(CASE, run.params[:1], momentum_only), 0) is None


# ---------------------------------------------------------------- routing: what an update says


def _updates(p1: torch.Tensor, p1_ref: torch.Tensor, case: Case = CASE) -> Update | None:
    from muon_check.adapters.routing import _views

    p0 = initial_params(case)[0]
    grad = oracle_gradients(case, 0)[0]
    return update_of(p0, p1, p1_ref, grad, 0.02, 0.1, _views(case.shapes[0], {}))


def test_a_muon_update_is_orthogonalised_and_an_sgd_update_is_not_and_is_elementwise():
    p0 = initial_params(CASE)[0]
    grad = oracle_gradients(CASE, 0)[0]
    p1_ref = reference_of(CASE)["skip"].params[0][0]
    muon = _updates(p1_ref, p1_ref)
    assert muon.orthogonalised is True and not muon.elementwise
    sgd = _updates(p0 * (1 - 0.002) - 0.02 * grad, p1_ref)
    assert sgd.orthogonalised is False and sgd.elementwise
    adam = _updates(p0 * (1 - 0.002) - 0.02 * grad.sign(), p1_ref)
    assert adam.elementwise
    assert "singular values span" in sgd.describe()


def test_a_vectors_update_is_elementwise_where_it_is_a_multiple_of_the_gradient_or_its_sign_only():
    """routing.update_of on a vector: elementwise exactly where the update's cosine with G (>= ELEMENTWISE_COS) or
    with sign(G) (>= SIGN_COS) says it is a multiple of one; a vector has no spreads and no orthogonalisation
    answer."""
    gen = torch.Generator().manual_seed(5)
    p0, grad, other = (torch.randn(64, generator=gen, dtype=torch.float64) for _ in range(3))
    muon = p0 * (1 - 0.002) - 0.02 * other  # the claim's update, unrelated to G here
    for p1, elementwise in (
        (p0 * (1 - 0.002) - 0.02 * grad, True),
        (p0 * (1 - 0.002) - 0.02 * grad.sign(), True),
        (muon, False),
    ):
        update = update_of(p0, p1, muon, grad, 0.02, 0.1, [])
        assert update.elementwise is elementwise and update.orthogonalised is None, update
        assert math.isnan(update.candidate), update  # a vector has no spreads


def test_an_update_below_the_params_rounding_is_not_read():
    case = Case("tall", "single", 1, ((12, 6),), "bfloat16", steps=1)
    p1_ref = reference_of(case)["skip"].params[0][0]
    assert _updates(p1_ref, p1_ref, case) is None


def test_classify_routes_an_adam_param_and_an_sgd_param_and_keeps_a_muon_one():
    case = Case("mixed", "single", 1, ((12, 6), (8, 8), (6, 12)), "float32", steps=1)
    run = reference_of(case)["skip"]
    p0, grads = initial_params(case), oracle_gradients(case, 0)
    params = [
        [run.params[0][0], p0[1] * 0.998 - 0.02 * grads[1], p0[2] * 0.998 - 0.02 * grads[2].sign()]
    ]
    states = [[{}, {}, {"['exp_avg_sq']": grads[2] ** 2}]]
    got = classify(case, results_of(case, params, states), run.params[0], 0.02, 0.1, {})
    assert got[0].routed is None and got[0].orthogonalised is True
    assert got[1].routed.startswith("not orthogonalised, elementwise")
    assert got[2].routed.startswith("Adam-style second moment at state[p]['exp_avg_sq']")


# ---------------------------------------------------------------- diagnose: the words


def _outcome(family: str, status: str, dtype: str = "float32", **fields: Any) -> Outcome:
    return Outcome(Case(family, "single", 1, ((12, 6),), dtype), status, **fields)


NOT_ORTHO = Update(3.0, 0.5, 3.1, False, True, "not orthogonalised, elementwise: spread")
ORTHO = Update(0.5, 0.5, 3.1, True, False)


def test_not_a_muon_needs_every_read_update_unorthogonalised_and_no_conforming_case():
    routed = [
        _outcome(f, "routed", routed={0: NOT_ORTHO.routed}, updates={0: NOT_ORTHO})
        for f in ("tall", "wide")
    ]
    assert findings(routed, "torch", {})[0].kind == "not a Muon"
    mixed = routed + [_outcome("square", "differs", updates={0: ORTHO}, stage="shape scale")]
    assert all(f.kind != "not a Muon" for f in findings(mixed, "torch", {}))
    with_bitwise = routed + [_outcome("square", "bitwise")]
    kinds = [f.kind for f in findings(with_bitwise, "torch", {})]
    assert "not a Muon" not in kinds and "routing" in kinds


def test_routing_unsupported_input_and_non_determinism_are_listed_and_never_a_departure():
    outcomes = [
        _outcome("tall", "bitwise"),
        _outcome("row", "routed", routed={0: "Adam-style second moment at state[p]['v']"}),
        _outcome("conv4d", "unsupported", error="ValueError: only 2-D"),
        _outcome("square", "close"),
    ]
    context = Context(self_differences={"bfloat16": 1e-3}, tolerance=2e-3)
    kinds = [f.kind for f in findings(outcomes, "torch", {}, context)]
    assert kinds == ["routing", "unsupported input", "non-deterministic"]
    line = diagnose(outcomes, "torch", {}, context)
    assert line.startswith(
        "conforms: every compared case equal to the claim (within the stated tolerance)"
    )
    assert "bug" not in line and "departs" not in line


def test_a_located_departure_is_a_bug_where_another_family_of_its_dtype_conforms_else_it_departs():
    def line(extra: list[Outcome]) -> str:
        departing = _outcome(
            "micro_batches", "differs", stage="momentum", stage_detail="step 1, param 0: x"
        )
        return diagnose([departing, *extra], "torch", {}, Context(search_budget_s=0.0))

    assert line([_outcome("tall", "bitwise")]).startswith("bug: momentum departs on micro_batches")
    assert line([_outcome("tall", "bitwise", dtype="bfloat16")]).startswith(
        "departs: momentum departs on"
    )
    assert line([]).startswith("departs: momentum departs on")


def test_a_one_ulp_application_difference_is_a_rounding_not_a_bug():
    rounding = _outcome(
        "tall", "differs", stage="application", stage_detail="a rounding: within 1 unit"
    )
    got = diagnose(
        [rounding, _outcome("wide", "bitwise")], "torch", {}, Context(search_budget_s=0.0)
    )
    assert got.startswith("rounding: the update's application rounds differently on tall"), got
    other = _outcome("tall", "differs", stage="application", stage_detail="scale_apply='update'")
    assert diagnose(
        [other, _outcome("wide", "bitwise")], "torch", {}, Context(search_budget_s=0.0)
    ).startswith("bug: application departs")


def test_phrases_keep_the_lines_old_forms():
    assert phrase(Finding("convention", "by partition: x")) == "conventions by partition: x"
    assert phrase(Finding("crashes", "on tall")) == "crashes on tall"
    assert phrase(Finding("bug", "x")) == "bug: x"
    assert STAGES[0] == "momentum" and STAGES[-1] == "application"


# ---------------------------------------------------------------- verdict


class Named(Adapter):
    name = "named"


def test_each_verdict_and_only_its_cause():
    def v(
        *outcomes: Outcome, not_a_muon: bool = False, state_key: str | None = "momentum_buffer"
    ) -> str:
        adapter = Named()
        adapter.state_key = state_key
        return verdict(list(outcomes), adapter, not_a_muon)

    bitwise, close = _outcome("tall", "bitwise"), _outcome("wide", "close")
    assert v(bitwise) == "conforms"
    assert v(bitwise, close) == "conforms within tolerance"
    assert v(bitwise, _outcome("row", "routed"), _outcome("conv4d", "unsupported")) == "conforms"
    assert v(bitwise, _outcome("wide", "differs")) == "departs"
    assert v(bitwise, _outcome("wide", "crash")) == "departs"
    assert v(_outcome("wide", "crash"), _outcome("tall", "unsupported")) == "could not run"
    assert v(bitwise, not_a_muon=True) == "not a Muon"
    unmapped = _outcome("wide", "bitwise", unmapped=("['x']",))
    assert v(unmapped) == "incomplete" and v(unmapped, state_key=None) == "conforms"


@pytest.mark.parametrize(
    "status", ["bitwise", "close", "differs", "crash", "hang", "unsupported", "routed"]
)
def test_every_status_is_summarised(status):
    summary = _outcome("tall", status).summary()
    assert summary["status"] == status and "stage" in summary and "routed" in summary


def test_a_resume_of_lazily_created_state_is_named_and_other_crashes_stay_crashes():
    lazy = _outcome(
        "checkpoint_unstepped",
        "crash",
        error="rank 0: RuntimeError: Missing key in checkpoint state_dict: optim.state.params.1.momentum_buffer.",
    )
    other = _outcome("uneven", "crash", error="rank 0: RuntimeError: shapes differ")
    line = diagnose([lazy, other, _outcome("tall", "bitwise")], "torch", {})
    assert (
        line.startswith("resume fails (state created lazily") and "on checkpoint_unstepped" in line
    ), line
    assert "crashes on uneven" in line and "crashes on checkpoint_unstepped" not in line, line


def test_the_tiny_family_is_vacuous_where_the_claims_newton_schulz_flushes_it_to_zero():
    from muon_check.adapters.stages import update_vanishes

    tiny = Case("tiny", "single", 1, ((8, 6),), "float32", steps=1)
    fp16 = {**HYPERPARAMETERS, "ns_dtype": torch.float16, "eps": 1e-6, "eps_mode": "add"}
    assert update_vanishes(tiny, "torch", fp16)
    assert not update_vanishes(
        tiny, "torch", dict(HYPERPARAMETERS)
    )  # bf16 keeps fp32's exponent range


# ---------------------------------------------------------------- cases: the families and what ranks feed

from muon_check.adapters import cases as C  # noqa: E402


@pytest.mark.parametrize(
    "family, mode, W, shapes",
    [
        ("even", "dtensor", 3, ((6, 5),) * 3),
        ("uneven", "dtensor", 2, ((3, 3),) * 2),
        ("empty", "dtensor", 4, ((3, 4),) * 4),
        ("remainder", "dtensor", 2, ((4, 5),) * 3),
        ("experts", "dtensor", 2, ((3, 4, 3),) * 2),
        ("padded_scale", "dtensor", 2, ((5, 3),) * 2),
        ("mixed", "replicated", 2, ((6, 4),) * 3 + ((3, 5),)),
        ("straddle", "unreduced", 2, ((3, 5),) * 3),
        ("badly_scaled", "unreduced", 2, ((5, 4),) * 4),
        ("row_sharded", "dtensor", 3, ((1, 6),) * 2),
        ("resume_long", "dtensor", 2, ((3, 3),)),
        ("fused_sharded", "dtensor", 2, ((10, 3),)),
        ("checkpoint", "dtensor", 2, ((5, 2),) * 2),
    ],
)
def test_each_family_has_its_shapes_and_keeps_its_cases_inside_it(family, mode, W, shapes):
    assert C.family_shapes(family, mode, W) == shapes
    case = Case(
        family,
        mode,
        W,
        shapes,
        steps=C.LONG_SAVE + 1 if family == "resume_long" else 3,
        resume_world_size=W if family in C.CHECKPOINT_FAMILIES else None,
        options=C.FAMILY_OPTIONS.get(family, ()),
    )
    assert C.in_family(case)
    assert all(C.in_family(c) for c in C.smaller(case)) and case not in C.smaller(case)


@pytest.mark.parametrize(
    "family, mode, W",
    [
        ("remainder", "dtensor", 1),
        ("uneven", "dtensor", 1),
        ("even", "unreduced", 3),
        ("straddle", "dtensor", 2),
        ("resume_long", "dtensor", 3),
        ("fused_sharded", "dtensor", 3),
        ("mixed", "dtensor", 2),
    ],
)
def test_a_family_that_cannot_exist_there_has_no_shapes(family, mode, W):
    assert C.family_shapes(family, mode, W) is None


@pytest.mark.parametrize(
    "family, mode, W, shapes",
    [
        ("tall", "single", 1, ((6, 6),)),
        ("wide", "single", 1, ((6, 6),)),
        ("square", "single", 1, ((6, 5),)),
        ("row", "single", 1, ((2, 5),)),
        ("primes", "single", 1, ((9, 7),)),
        ("experts3d", "single", 1, ((3, 4),)),
        ("conv4d", "single", 1, ((3, 4, 2),)),
        ("even", "dtensor", 2, ((3, 5),)),
        ("remainder", "dtensor", 2, ((4, 5),) * 2),
        ("uneven", "dtensor", 2, ((4, 3),)),
        ("empty", "dtensor", 2, ((4, 3),)),
        ("experts", "dtensor", 2, ((4, 3),)),
        ("padded_scale", "dtensor", 2, ((4, 3),)),
        ("straddle", "unreduced", 2, ((4, 4),) * 2),
        ("asym_none", "dtensor", 1, ((4, 4),)),
        ("checkpoint_unstepped", "dtensor", 2, ((5, 2),)),
        ("row_sharded", "dtensor", 2, ((2, 6),)),
        ("badly_scaled", "dtensor", 2, ((5, 4),)),
        ("mixed", "replicated", 2, ((6, 4),) * 3),
        ("even", "unreduced", 3, ((6, 5),) * 3),
        ("", "dtensor", 2, ()),
    ],
)
def test_a_case_outside_its_family_is_refused(family, mode, W, shapes):
    assert not C.in_family(Case(family or "even", mode, W, shapes))


def test_default_cases_run_every_family_dtype_variant_and_resume_where_the_list_says():
    cases = C.default_cases(
        frozenset({"tall", "even", "checkpoint", "resume_long"}),
        "dtensor",
        (1, 2),
        ("float32", "bfloat16"),
        3,
        variants=({}, {"nesterov": False}),
    )
    assert sum(c.family == "tall" for c in cases) == 4  # 2 dtypes x 2 variants, one device only
    assert {(c.world_size, c.resume_world_size) for c in cases if c.family == "checkpoint"} == {
        (1, 2),
        (2, 1),
    }
    assert {
        (c.world_size, c.resume_world_size, c.steps) for c in cases if c.family == "resume_long"
    } == {(1, 1, C.LONG_SAVE + 1), (2, 2, C.LONG_SAVE + 1)}
    assert all(c.steps == 3 for c in cases if c.family != "resume_long")
    assert C.default_cases(frozenset({"tall", "even"}), None, (2,), ("float32",), 3) == [
        Case("tall", "single", 1, ((12, 6),), "float32", 3)
    ]


def test_what_ranks_feed_sums_to_what_the_oracle_steps_on_exactly():
    case = Case("accumulation", "unreduced", 2, ((4, 5),) * 2, "bfloat16", 2)
    fed = [C.rank_gradients(case, 0, r) for r in range(2)]
    assert len(fed[0]) == C.MICRO_BATCHES and not torch.equal(fed[0][0][0], fed[1][0][0])
    total = sum(micro[0].double() for per_rank in fed for micro in per_rank) / 2
    assert torch.equal(C.oracle_gradients(case, 0)[0].double(), total)
    single = Case("tall", "single", 1, ((12, 6),))
    assert torch.equal(C.rank_gradients(single, 1, 0)[0][0], C.gradients(single, 1)[0])
    assert C.gradient_scale(Case("tiny", "single", 1, ((8, 6),)), 0) == C.TINY
    assert (
        C.gradient_scale(Case("badly_scaled", "dtensor", 2, ((5, 4),) * 4), 3) == C.BADLY_SCALED[3]
    )
    assert C.gradient_scale(single, 0) == 1.0


def test_gradients_missing_on_some_ranks_follow_each_policy():
    case = Case("asym_none", "dtensor", 3, ((6, 5),) * 3, steps=3)
    step = C.asym_step(case)
    assert step == 1 and C.asym_step(replace_steps(case, 1)) == 0
    missing = [[g is None for g in C.rank_gradients(case, step, r)[0]] for r in range(3)]
    assert missing == [[False, False, False], [True, False, False], [False, True, False]]
    skip, raised = C.oracle_gradients(case, step, "skip"), C.oracle_gradients(case, step, "raise")
    assert [g is None for g in skip] == [True, True, False] and all(g is None for g in raised)
    assert all(g is not None for g in C.oracle_gradients(case, 0, "raise"))


def replace_steps(case: Case, steps: int) -> Case:
    from dataclasses import replace

    return replace(case, steps=steps)


def test_checkpoint_steps_and_world_sizes():
    case = Case("checkpoint", "dtensor", 2, ((5, 2),) * 2, steps=3, resume_world_size=4)
    assert C.save_step(case) == 2 and [C.world_at(case, s) for s in range(3)] == [2, 2, 4]
    long = Case("resume_long", "dtensor", 2, ((3, 3),), steps=C.LONG_SAVE + 1, resume_world_size=2)
    assert C.save_step(long) == C.LONG_SAVE
    unstepped = Case(
        "checkpoint_unstepped", "dtensor", 2, ((5, 2),) * 2, steps=3, resume_world_size=2
    )
    assert (
        C.rank_gradients(unstepped, 0, 0)[0][1] is None
        and C.rank_gradients(unstepped, 2, 0)[0][1] is not None
    )
    assert C.local_box(torch.arange(10.0).reshape(5, 2), case, 1).tolist() == [
        [6.0, 7.0],
        [8.0, 9.0],
    ]
    assert (
        C.placement(case) == "S0"
        and C.placement(Case("even", "replicated", 2, ((4, 5),))) == "plain"
    )


def test_exact_gradients_sum_exactly_in_any_order():
    parts = [C.exact_gradient((4, 4), seed, "bfloat16") for seed in range(8)]
    forward = sum(p.float() for p in parts)
    backward = sum(p.float() for p in reversed(parts))
    assert torch.equal(forward, backward) and torch.equal(forward.bfloat16().float(), forward)


# ---------------------------------------------------------------- the search, in this process


class Sum(Adapter):
    name, preset = "sum momentum", "torch"

    def build(self, params, **hp):
        return muon_ref.Muon(
            params, preset="torch", momentum_style="sum", nesterov_form="add_alpha", **hp
        )


class SumSpectral(Adapter):
    name, preset = "two away", "torch"

    def build(self, params, **hp):
        return muon_ref.Muon(
            params, preset="torch", lr_scale="spectral_norm", weight_decay_form="add_self", **hp
        )


def _run(adapter: Adapter, families=("tall", "wide", "square")) -> list[Outcome]:
    shapes = {"tall": ((12, 6),), "wide": ((6, 12),), "square": ((8, 8),)}
    return [run_here(adapter, Case(f, "single", 1, shapes[f], steps=2)) for f in families]


def test_the_search_finds_one_option_then_two_and_a_partition_only_where_it_must():
    from muon_check.adapters.diagnose import Search, explain

    preset, overrides = "torch", dict(HYPERPARAMETERS)
    found, rest = explain(_run(Sum()), preset, overrides)
    assert found == [
        (
            "all cases",
            "matches claimed preset 'torch' with momentum_style='sum', nesterov_form='add_alpha'",
        )
    ]
    assert rest == []
    found, _ = explain(_run(SumSpectral()), preset, overrides, Search(120.0))
    assert (
        "lr_scale='spectral_norm'" in found[0][1] and "weight_decay_form='add_self'" in found[0][1]
    )
    found, rest = explain(
        _run(SumSpectral()), preset, overrides, Search(0.0)
    )  # no time: nothing found
    assert found == [] and len(rest) == 3


def test_the_nearest_configuration_is_named_only_where_it_is_nearer_than_the_claim():
    from muon_check.adapters.diagnose import Search

    outcomes = _run(SumSpectral())
    near = Search(120.0).nearest(outcomes, "torch", dict(HYPERPARAMETERS))
    # sqrt(fo / fi) equals sqrt(max(1, fo / fi)) on tall and square matrices: the decay form alone fixes those two
    assert near.description == "matches claimed preset 'torch' with weight_decay_form='add_self'"
    assert (near.bitwise, near.total) == (2, 3) and near.ulps > 0
    assert "departing cases bitwise" in near.describe()
    assert Search(120.0).nearest(_run(Sum())[:0], "torch", dict(HYPERPARAMETERS)) is None


def test_a_shard_local_rounding_is_named_with_its_row_boundaries():
    from muon_check.adapters.oracle import elementwise_label, rounding_label

    case = Case("uneven", "dtensor", 2, ((5, 4), (5, 4)), "bfloat16", steps=2)
    label = elementwise_label(case, "shard-local")
    assert label == "shard-local, boundaries rows [0:3 | 3:5] of (5, 4) at W=2", label
    flat = Case("straddle", "unreduced", 2, ((3, 5),) * 3, "bfloat16", steps=1)
    assert elementwise_label(flat, "shard-local momentum").startswith(
        "shard-local momentum, boundaries elements [0:15] of (3, 5) at W=2"
    )
    assert elementwise_label(case, "whole") == "whole"
    # a checkpoint case names the boundaries of each world that runs a step: one step runs before the save only
    one = Case("checkpoint", "dtensor", 2, ((5, 4),), "bfloat16", steps=1, resume_world_size=1)
    assert (
        elementwise_label(one, "shard-local")
        == "shard-local, boundaries rows [0:3 | 3:5] of (5, 4) at W=2"
    )
    four = Case("checkpoint", "dtensor", 2, ((5, 4),), "bfloat16", steps=4, resume_world_size=1)
    assert "at W=1" in elementwise_label(four, "shard-local")
    both = next(r for r in ROUNDINGS if r.local and r.other_layout and r.name == "shard-local")
    assert rounding_label(case, both, "torch", {}).endswith(
        "; update layout 'contiguous' (the claim's is the other)"
    )


def test_the_shape_scale_variants_include_a_learning_rate_rounded_to_the_params_dtype_with_the_same_decay():
    from muon_check.adapters.stages import _scale_variants
    from muon_ref.config import MuonConfig

    cfg = MuonConfig(lr=0.02, weight_decay=0.1)
    (text, alt), *_ = [v for v in _scale_variants(cfg, torch.bfloat16) if "learning rate" in v[0]]
    assert text == "the learning rate rounded to bfloat16" and alt.lr == float(
        torch.tensor(0.02).bfloat16()
    )
    assert math.isclose(1 - alt.lr * alt.weight_decay, 1 - 0.02 * 0.1, rel_tol=1e-15)
    assert not [
        v for v in _scale_variants(MuonConfig(lr=0.5), torch.bfloat16) if "learning rate" in v[0]
    ]
    for claimed, other in (("sqrt", "pow"), ("pow", "sqrt")):
        variants = dict(_scale_variants(MuonConfig(lr=0.5, scale_sqrt=claimed), torch.float32))
        assert variants[f"scale_sqrt={other!r}"].scale_sqrt == other


def test_nothing_is_listed_as_not_compared_for_a_muon_that_keeps_its_momentum_where_it_says():
    from muon_check.adapters.verdict import not_compared

    class Plain(Adapter):
        name, preset = "plain", "torch"

        def build(self, params, **hp):
            return muon_ref.Muon(params, preset="torch", **hp)

    outcome = run_here(Plain(), CASE)
    assert outcome.status == "bitwise" and not_compared([outcome], Plain()) == []
    keyed = Plain()
    keyed.state_key = (
        "mom"  # a key it does not have: the momentum is found by value, nothing left out
    )
    found = run_here(keyed, CASE)
    assert not_compared([found], keyed) == [] and "found by value" in found.momentum_sources[0]


def test_the_momentum_read_is_not_listed_as_other_state_when_its_path_is_an_equal_string_from_another_rank():
    """verdict._other_state compares state paths by value: the path the view read is never listed as other state,
    whichever rank's str object it is; any other param-sized state is."""
    from muon_check.adapters.verdict import _other_state

    # each rank's results arrive in a pickle of their own: equal paths, distinct str objects
    read = "".join(["['momentum", "_buffer']"])
    results = [{"recorded": {0: {"state": [{"['momentum_buffer']": torch.zeros(12, 6)}]}}}]
    outcome = _outcome("tall", "bitwise", results=[(1, results)], view=View((("state", read),)))
    assert _other_state(outcome, Adapter()) == []
    results[0]["recorded"][0]["state"][0]["['exp_avg_sq']"] = torch.zeros(12, 6)
    assert _other_state(outcome, Adapter()) == ["['exp_avg_sq']"]


def _errors(per_rank: list[list[str | None]]) -> list:
    return [(len(per_rank), [{"first_step": 0, "errors": errors} for errors in per_rank])]


def test_an_asym_none_answer_is_raise_only_when_every_rank_raises_one_type_at_that_step():
    from muon_check.adapters.oracle import _policy

    case = Case("asym_none", "dtensor", 2, ((4, 5),) * 2, steps=3)
    assert _policy(case, _errors([[None] * 3, [None] * 3])) == ("skip", None)
    same = "ValueError: missing"
    assert _policy(case, _errors([[None, same, None], [None, same, None]])) == ("raise", None)
    policy, crash = _policy(case, _errors([[same, None, None], [same, None, None]]))  # another step
    assert policy == "" and crash.startswith("at step 1 rank 0 raised ValueError")
    policy, crash = _policy(case, _errors([[None, same, None], [None, None, None]]))  # one rank
    assert crash.endswith("; ranks [1] did not")
    policy, crash = _policy(case, _errors([[None, same, None], [None, "TypeError: x", None]]))
    assert crash.endswith("; the ranks raised different errors")


@pytest.mark.parametrize(
    "form, expected",
    [
        ("sum", "M * mu + G (sum)"),
        ("ema", "lerp(M, G, 1 - mu) (EMA)"),
        ("ema32", "lerp(M, G, 1 - mu) in float32"),
        ("sum_coupled", "M * mu + (G + wd * P) (sum, weight decay coupled into the gradient)"),
        (
            "ema_coupled",
            "lerp(M, G + wd * P, 1 - mu) (EMA, weight decay coupled into the gradient)",
        ),
        ("normalised", "the claim's momentum divided by its Frobenius norm, clamped at eps"),
        ("mu_rounded", "M * bfloat16(mu) + G (mu rounded to the param's dtype)"),
        ("sum32", "M * mu + G in float32"),
    ],
)
@pytest.mark.parametrize("mu", [0.9, 0.3])  # 0.3: 1 - mu and other spellings of it part below 0.5
def test_the_momentum_forms_of_the_field_are_named_by_their_bits(form, expected, mu):
    from muon_check.adapters.stages import _momentum_detail
    from muon_ref.config import MuonConfig

    cfg = MuonConfig(momentum=mu, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    G = torch.randn(6, 4, generator=gen).bfloat16()
    M = torch.randn(6, 4, generator=gen).bfloat16()
    P = torch.randn(6, 4, generator=gen).bfloat16()
    claim = M.lerp(G, 1 - mu)
    coupled = G.add(P, alpha=0.1)
    candidate = {
        "sum": M.mul(mu).add(G),
        "ema": M.lerp(G, 1 - mu),
        "ema32": M.float().lerp(G.float(), 1 - mu),
        "sum_coupled": M.mul(mu).add(coupled),
        "ema_coupled": M.lerp(coupled, 1 - mu),
        "normalised": claim / claim.norm().clamp(min=cfg.eps),
        "mu_rounded": M.mul(torch.tensor(mu, dtype=torch.bfloat16)).add(G),
        "sum32": M.float().mul(mu).add(G.float()),
    }[form]
    assert _momentum_detail(candidate, claim, G, M, P, cfg).startswith(
        f"its momentum is {expected}"
    )
    assert _momentum_detail(claim * 3, claim, G, M, P, cfg).startswith("max |dM|")


def test_a_buffer_normalised_by_its_norm_plus_eps_is_told_from_one_clamped_at_eps():
    """stages._momentum_detail names M' / (||M'|| + eps) and M' / max(||M'||, eps) apart, each by its own bits."""
    from muon_check.adapters.stages import _momentum_detail
    from muon_ref.config import MuonConfig

    cfg = MuonConfig(momentum=0.9, eps=1e-3)
    gen = torch.Generator().manual_seed(0)
    G, M, P = (torch.randn(6, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    claim = M.lerp(G, 0.1)
    plus = _momentum_detail(claim / (claim.norm() + 1e-3), claim, G, M, P, cfg)
    assert plus.startswith(
        "its momentum is the claim's momentum divided by its Frobenius norm plus eps"
    ), plus
    clamped = _momentum_detail(claim / claim.norm().clamp(min=1e-3), claim, G, M, P, cfg)
    assert "clamped at eps" in clamped, clamped


def test_the_rounding_bound_is_half_a_unit_in_the_last_place():
    from muon_check.adapters.routing import _rounding

    assert _rounding(torch.tensor([1.0])).item() == 2.0**-24
    assert _rounding(torch.tensor([1.0], dtype=torch.bfloat16)).item() == 2.0**-8


def test_of_several_matching_state_tensors_the_one_named_like_a_momentum_is_read_first_in_order():
    """momentum.find: of several state tensors with the momentum's bits, the one whose path names a momentum, else
    the first."""
    reference = reference_of(CASE)
    run = reference["skip"]
    m = run.momenta[0][0]
    several = [[{"['copy']": m, "['mom_a']": m, "['mom_b']": m}]] * 2
    assert find(CASE, results_of(CASE, run.params, several), reference, 0) == "['mom_a']"
    unnamed = [[{"['x']": m, "['y']": m}]] * 2
    assert find(CASE, results_of(CASE, run.params, unnamed), reference, 0) == "['x']"


def test_a_step_without_a_closure_is_named_as_the_resume_failure_it_causes():
    """A crash of get_optimizer_state_dict's step(closure=...) is the finding 'resume fails' with its cause, not a
    plain crash."""
    crash = _outcome(
        "checkpoint",
        "crash",
        error="rank 0: TypeError: Muon.step() got an unexpected keyword argument 'closure'",
    )
    line = diagnose([crash, _outcome("tall", "bitwise")], "torch", {})
    assert line.startswith("resume fails (its step() takes no closure") and "crashes" not in line, (
        line
    )


def test_a_departure_named_exactly_gets_no_nearest_configuration_and_an_unnamed_one_does():
    """diagnose: the nearest configuration is searched only for a departure that no named variant of its stage gives
    bit for bit."""
    from tests.test_conformance_words import RoundedDecay

    named = [
        run_here(RoundedDecay(), Case(f, "single", 1, s, "bfloat16", steps=2))
        for f, s in (("tall", ((12, 6),)), ("wide", ((6, 12),)))
    ]
    assert all(o.stage_exact for o in named)
    line = diagnose(named, "torch", dict(HYPERPARAMETERS), Context(search_budget_s=60.0))
    assert line.startswith("departs: weight decay departs on") and "nearest" not in line, line
    unnamed = _run(SumSpectral())
    assert not any(o.stage_exact for o in unnamed if o.stage == "orthogonalised direction")


def test_a_param_without_a_gradient_that_the_candidate_decays_anyway_is_located_there():
    """stages._stepped_without_gradient: a param without a gradient changed by exactly the claim's decay is 'weight
    decay' (exact); changed otherwise, 'application'; the step is 1-based."""
    from muon_check.adapters.stages import _stepped_without_gradient
    from muon_ref.config import MuonConfig
    from muon_ref.functional import decay

    cfg = MuonConfig(lr=0.02, weight_decay=0.1)
    P = torch.randn(5, 2, generator=torch.Generator().manual_seed(0))
    decayed = _stepped_without_gradient(1, 2, P, decay(P, cfg), cfg)
    assert decayed.stage == "weight decay" and decayed.exact and "decayed" in decayed.detail
    other = _stepped_without_gradient(1, 2, P, P + 1e-3, cfg)
    assert other.stage == "application" and not other.exact
    assert {(x.step, x.param) for x in (decayed, other)} == {(3, 1)}  # 1-based step


def test_a_departure_near_one_alternative_is_named_at_that_alternatives_stage():
    """At a later step (the momentum no longer a multiple of G), a candidate whose direction is G + M' and whose
    update has one more small difference is closest to the G + M' alternative: located at the Nesterov input."""
    from muon_check.adapters.stages import _closest
    from muon_ref.config import MuonConfig
    from muon_ref.functional import apply_update, matrix_layout, momentum_direction, orthogonalize

    cfg, layout = MuonConfig(lr=0.02, weight_decay=0.1, momentum=0.9), matrix_layout((12, 6))
    gen = torch.Generator().manual_seed(5)
    P, G, M = (torch.randn(12, 6, generator=gen) for _ in range(3))
    M_new, D = momentum_direction(G, M, cfg)
    P_new = apply_update(P, orthogonalize(D, layout, cfg), layout, cfg)
    P_cand = apply_update(P, orthogonalize(G + M_new, layout, cfg), layout, cfg) + 1e-6
    stage, text = _closest(P, P_cand, P_new, G, M_new, D, cfg, layout)
    assert stage == "Nesterov input" and text.startswith(
        "closest to its Newton-Schulz input is G + M'"
    ), text
    assert (
        _closest(P, P_new + 1e-3, P_new, G, M_new, D, cfg, layout) is None
    )  # nothing nearer than the claim


def test_proportion_routes_sgd_only_where_the_gradient_is_far_from_its_polar_factor():
    """Where a gradient is nearly orthogonal (its singular values close), its polar factor is nearly a multiple of
    it: neither that nor SGD's update is routed by proportion (undecided). Where it is not, SGD's update is, and a
    Muon's is not."""
    from muon_check.adapters.routing import _views

    gen = torch.Generator().manual_seed(3)
    Q = torch.linalg.qr(
        torch.randn(12, 2, generator=gen, dtype=torch.float64)
    ).Q.T  # orthonormal rows
    P0 = torch.randn(2, 12, generator=gen, dtype=torch.float64)

    def proportional(sigma: tuple[float, float], muon: bool) -> bool:
        G = torch.diag(torch.tensor(sigma, dtype=torch.float64)) @ Q
        svd = torch.linalg.svd(G, full_matrices=False)
        O = svd.U @ svd.Vh
        ref = P0 * 0.998 - 0.02 * O
        p1 = ref if muon else P0 * 0.998 - 0.02 * G
        return update_of(P0, p1, ref, G, 0.02, 0.1, _views((2, 12), {})).proportional

    assert not proportional((1.0, 0.97), muon=True) and not proportional((1.0, 0.97), muon=False)
    assert proportional((1.0, 0.2), muon=False) and not proportional((1.0, 0.2), muon=True)


def test_degenerate_families_conforming_do_not_make_a_departure_a_bug():
    """A departure is a bug only where a non-degenerate family of its dtype conforms; row and tiny (DEGENERATE)
    conforming are no such evidence."""
    departing = _outcome("tall", "differs", stage="Nesterov input", stage_detail="x")
    only_row = diagnose(
        [departing, _outcome("row", "bitwise"), _outcome("tiny", "close")],
        "torch",
        {},
        Context(search_budget_s=0.0),
    )
    assert only_row.startswith("departs: Nesterov input departs on tall"), only_row
    with_square = diagnose(
        [departing, _outcome("square", "bitwise")], "torch", {}, Context(search_budget_s=0.0)
    )
    assert with_square.startswith("bug: Nesterov input departs on tall"), with_square
    other_dtype = diagnose(
        [departing, _outcome("square", "bitwise", dtype="bfloat16")],
        "torch",
        {},
        Context(search_budget_s=0.0),
    )
    assert other_dtype.startswith("departs:"), other_dtype


def test_a_second_moment_routes_only_where_the_update_is_adams_first_one():
    """routing.classify: a second moment routes a param to Adam only where its first update is sign-like (Adam's
    first step) or unreadable."""
    case = Case("row", "single", 1, ((1, 10),), "float32", steps=1)
    p0, grad = initial_params(case)[0], oracle_gradients(case, 0)[0]
    moment = [[{"['v']": grad * grad * 0.05}]]
    adam = [[p0 * 0.998 - 0.02 * grad.sign()]]
    normuon = [
        [p0 * 0.998 - 0.02 * grad / grad.norm()]
    ]  # an orthogonalised row is a multiple of it
    ref = reference_of(case)["skip"].params[0]
    routed = classify(case, results_of(case, adam, moment), ref, 0.02, 0.1, {})
    kept = classify(case, results_of(case, normuon, moment), ref, 0.02, 0.1, {})
    assert routed[0].routed.startswith("Adam-style second moment") and kept[0].routed is None


def test_a_candidate_compared_at_a_tolerance_that_drifts_beyond_it_is_said_to_drift():
    """A tolerance-compared candidate beyond the tolerance with no single step beyond it is said to drift, never a
    located bug."""
    drift = _outcome("tall", "differs", tolerance=1e-3)
    line = diagnose(
        [drift, _outcome("square", "close", tolerance=1e-3)],
        "torch",
        {},
        Context(search_budget_s=0.0),
    )
    assert line.startswith("departs: drifts beyond the stated tolerance on tall"), line


def test_routing_goes_by_shape_to_cases_where_the_update_cannot_be_read():
    """Shapes read as routed (or kept) in some case hold for cases of the same shape whose update cannot be read."""
    from muon_check.conformance import Runner

    runner = Runner(Named(), 0.0)
    case = Case("row", "single", 1, ((1, 10),), "float32")
    kept = Update(math.nan, math.nan, math.nan, None, False)
    assert runner._routed(case, {0: kept}, {}) == {} and (1, 10) in runner.kept_shapes
    unread = Update(
        math.nan, math.nan, math.nan, None, True, routed="Adam-style second moment", read=False
    )
    assert runner._routed(replace_dtype(case), {0: unread}, {}) == {}  # kept where it was read
    other = Case("tall", "single", 1, ((12, 6),), "float32")
    assert runner._routed(other, {0: NOT_ORTHO}, {}) == {0: NOT_ORTHO.routed}
    carried = runner._routed(replace_dtype(other), {}, {})
    assert carried[0].endswith("(read on another case of this shape)")


def replace_dtype(case: Case) -> Case:
    from dataclasses import replace

    return replace(case, dtype="bfloat16")


def test_primes_are_primes():
    """cases._prime, which draws the primes family's sides, is a primality test: the primes below 20."""
    assert [n for n in range(1, 20) if C._prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19]


def test_a_construction_hint_names_the_key_in_the_error_and_the_keywords_without_a_default():
    """verdict.construction_hint: one line naming the param-group key the error names, else the constructor's
    keywords without a default."""
    from muon_check.adapters import ImportPath
    from muon_check.adapters.verdict import construction_hint

    hint = construction_hint(Named(), "ValueError: `use_muon` must be set.")
    assert hint.startswith(
        "hint: it names use_muon: a param-group key goes in with --group '{\"use_muon\": ...}'"
    )
    assert hint.endswith(
        'or write an adapter whose build() makes the optimizer as its users do (README, "Check '
        'your own Muon")'
    )
    bare = construction_hint(Named(), "RuntimeError: no CUDA")
    assert (
        bare
        == 'hint: write an adapter whose build() makes the optimizer as its users do (README, "Check your '
        'own Muon")'
    )
    needs = construction_hint(ImportPath(f"{__name__}:NeedsKeyword"), "TypeError: missing 'mesh'")
    assert "its constructor has keywords without a default: mesh (--kwargs)" in needs


class NeedsKeyword(torch.optim.Optimizer):
    def __init__(self, params, mesh, lr=0.1):
        super().__init__(params, {"lr": lr})


def test_the_momentum_is_found_only_where_every_rank_holding_a_box_has_it():
    """momentum.find: a path counts only where every rank with a non-empty box holds the momentum's bits there."""
    case = Case("even", "dtensor", 2, ((4, 5),), "float32", steps=1)
    reference = reference_of(case)
    run = reference["skip"]
    boxes = [C.local_box(run.momenta[0][0], case, r) for r in range(2)]
    states = [
        {"['m']": box, "['other']": box if rank == 0 else box * 7} for rank, box in enumerate(boxes)
    ]
    assert find(case, ranks_of(case, run, states), reference, 0) == "['m']"


def test_replicas_whose_momentum_disagrees_are_named_with_the_ranks():
    """oracle._disagreement names the param, step and ranks whose momentum differs from rank 0's."""
    from muon_check.adapters.oracle import _disagreement

    case = Case("even", "replicated", 2, ((4, 5),), "float32", steps=1)
    p = torch.ones(4, 5)
    results = [{"first_step": 0, "params": [[p]], "momentum": [m]} for m in (p, p * 2)]
    assert (
        _disagreement(case, [(2, results)])
        == "momentum of param 0 at the end: ranks [1] differ from rank 0 (W=2)"
    )
    results[1]["momentum"] = [p.clone()]
    assert _disagreement(case, [(2, results)]) is None


def test_a_departure_of_several_units_in_the_last_place_is_no_rounding():
    """stages._param: within 1 ulp of P' is a rounding at the application; a few ulps explained by the least-squares
    fit P_cand - P' = alpha P + beta O is the decay or scale with its fitted value; noise no fit explains is the
    orthogonalised direction. Step 1-based, param index kept."""
    from muon_check.adapters.stages import _param
    from muon_ref.config import MuonConfig
    from muon_ref.functional import apply_update, matrix_layout, momentum_direction, orthogonalize

    cfg, layout = MuonConfig(lr=0.02, weight_decay=0.1, momentum=0.9), matrix_layout((12, 6))
    gen = torch.Generator().manual_seed(7)
    P, G = (torch.randn(12, 6, generator=gen) for _ in range(2))
    M = torch.zeros(12, 6)
    _, D = momentum_direction(G, M, cfg)
    P_new = apply_update(P, orthogonalize(D, layout, cfg), layout, cfg)
    one_ulp = torch.nextafter(P_new, torch.full_like(P_new, math.inf))
    located = _param(1, 2, P, one_ulp, M, None, G, cfg, layout)
    assert located.stage == "application" and (located.step, located.param) == (3, 1), located
    scaled = P_new * (
        1 + 2.0**-19
    )  # eight units in the last place or so: a decay factor, by the fit
    located = _param(1, 2, P, scaled, M, None, G, cfg, layout)
    assert located.stage == "weight decay" and "least-squares fit" in located.detail, located
    assert (located.step, located.param) == (3, 1), located  # 1-based step, the param's index
    assert "scaled by about 0.9980019 where the claim's 1 - lr * wd is 0.998" in located.detail, (
        located
    )
    noise = P_new + torch.randn(12, 6, generator=gen) * 1e-5  # no decay and no step size makes this
    located = _param(1, 2, P, noise, M, None, G, cfg, layout)
    assert located.stage == "orthogonalised direction" and (located.step, located.param) == (3, 1)


def test_a_fitted_step_size_is_said_beside_the_claims_lr_times_its_shape_scale():
    """stages._param on P' - 0.1 a O: shape scale, 'a step of about 1.1 a where the claim's lr * scale is a' (a = lr
    * lr_scale * scale_factor)."""
    from muon_check.adapters.stages import _param
    from muon_ref.config import MuonConfig, lr_scale
    from muon_ref.functional import apply_update, matrix_layout, momentum_direction, orthogonalize

    cfg, layout = (
        MuonConfig(lr=0.02, weight_decay=0.1, lr_scale="match_rms_adamw"),
        matrix_layout((12, 6)),
    )
    gen = torch.Generator().manual_seed(11)
    P, G = (torch.randn(12, 6, generator=gen, dtype=torch.float64) for _ in range(2))
    M = torch.zeros_like(P)
    _, D = momentum_direction(G, M, cfg)
    O = orthogonalize(D, layout, cfg)
    a = 0.02 * lr_scale("match_rms_adamw", 12, 6, cfg.scale_sqrt) * cfg.scale_factor
    P_new = apply_update(P, O, layout, cfg)
    located = _param(0, 0, P, P_new - 0.1 * a * O.double(), M, None, G, cfg, layout)
    assert located.stage == "shape scale", located
    assert (
        f"a step of about {1.1 * a:.6g} where the claim's lr * scale is {a:.6g}" in located.detail
    ), located


def test_a_param_the_candidate_never_steps_is_named_so_and_a_stepped_one_is_not():
    """stages._param: P_cand == P bit for bit (the claim steps it) is 'the param is left as it is', application,
    exact; a half-step is a shape scale instead."""
    from muon_check.adapters.stages import _param
    from muon_ref.config import MuonConfig
    from muon_ref.functional import apply_update, matrix_layout, momentum_direction, orthogonalize

    cfg, layout = MuonConfig(lr=0.02, weight_decay=0.0, momentum=0.9), matrix_layout((8, 5))
    gen = torch.Generator().manual_seed(3)
    P, G = (torch.randn(8, 5, generator=gen) for _ in range(2))
    M = torch.zeros(8, 5)
    located = _param(1, 2, P, P.clone(), M, None, G, cfg, layout)
    assert located.stage == "application" and located.exact, located
    assert (located.step, located.param) == (3, 1), located
    assert "the param is left as it is" in located.detail, located
    _, D = momentum_direction(G, M, cfg)
    halved = apply_update(P, orthogonalize(D, layout, cfg), layout, cfg.replace(lr=0.01))
    located = _param(1, 2, P, halved, M, None, G, cfg, layout)
    assert "left as it is" not in located.detail and located.stage == "shape scale", located
    assert (located.step, located.param) == (3, 1), located


def test_a_located_stage_says_its_step():
    """A located outcome's stage detail starts with its 1-based step and the param's index."""
    from tests.test_conformance_words import _located

    outcome = _located({"lr_scale": "match_rms_adamw"}, (12, 6))
    assert outcome.stage_detail.startswith("step 1, param 0: lr_scale='match_rms_adamw'"), (
        outcome.stage_detail
    )


def test_the_decay_variants_include_the_other_form_whichever_the_claim_has():
    """stages._decay_variants always offers the other weight_decay_form than the claim's."""
    from muon_check.adapters.stages import _decay_variants
    from muon_ref.config import MuonConfig

    for form, other in (("mul", "add_self"), ("add_self", "mul")):
        texts = [t for t, _ in _decay_variants(MuonConfig(weight_decay_form=form), torch.float32)]
        assert f"weight_decay_form={other!r}" in texts, texts


def test_replicas_that_disagree_are_named_by_rank_and_step():
    """oracle._disagreement: 'param i after step s: ranks [...] differ from rank 0 (W=...)'."""
    from muon_check.adapters.oracle import _disagreement

    case = Case("even", "replicated", 3, ((4, 5),), "float32", steps=2)
    p = torch.ones(4, 5)
    results = [
        {"first_step": 0, "params": [[p], [p * (2 if r == 2 else 1)]], "momentum": [None]}
        for r in range(3)
    ]
    assert (
        _disagreement(case, [(3, results)])
        == "param 0 after step 2: ranks [2] differ from rank 0 (W=3)"
    )


def test_the_badly_scaled_family_reaches_below_every_presets_eps():
    """The badly_scaled family's smallest gradient norm is below every preset's eps (so eps decides there), its
    scales powers of two (exact)."""
    from muon_ref import PRESETS

    assert all(s > 0 and math.log2(s) == int(math.log2(s)) for s in C.BADLY_SCALED)
    smallest = (
        min(C.BADLY_SCALED) * C.gradients(Case("tall", "single", 1, ((5, 4),)), 0)[0].norm().item()
    )
    assert smallest < min(p["eps"] for p in PRESETS.values())


def test_the_momentum_is_found_past_a_rank_with_an_empty_box():
    """momentum.find skips a rank whose box is empty instead of failing the match there."""
    case = Case("empty", "dtensor", 2, ((1, 4),), "float32", steps=1)
    reference = reference_of(case)
    run = reference["skip"]
    boxes = [C.local_box(run.momenta[0][0], case, rank) for rank in range(2)]
    states = [{"['m']": box} if box.numel() else {} for box in boxes]
    assert find(case, ranks_of(case, run, states), reference, 0) == "['m']"


def test_a_second_moment_is_found_past_a_rank_with_an_empty_box():
    """momentum.second_moment skips a rank whose box is empty: Adam's exp_avg_sq is found on the others."""
    case = Case("empty", "dtensor", 2, ((1, 4),), "float32", steps=1)
    run = reference_of(case)["skip"]
    grad = oracle_gradients(case, 0)[0]
    boxes = [C.local_box(grad, case, rank) for rank in range(2)]
    states = [
        {"['exp_avg']": g * 0.1, "['exp_avg_sq']": g * g * 1e-3} if g.numel() else {} for g in boxes
    ]
    assert [g.numel() for g in boxes].count(0) == 1
    assert second_moment(case, ranks_of(case, run, states), 0) == "['exp_avg_sq']"


def test_the_momentum_of_a_step_no_segment_recorded_is_unknown_for_every_param():
    """stages._full_momentum: a step no segment recorded gives None for every param."""
    from muon_check.adapters.stages import _full_momentum

    case = Case("even", "dtensor", 2, ((4, 5), (6, 5)), "float32", steps=2)
    segments = [(2, [{"recorded": {0: {}}} for _ in range(2)])]
    assert _full_momentum(case, segments, None, 1) == [None, None]


def test_a_candidate_without_momentum_diffs_departs_at_its_first_step_past_the_tolerance():
    """stages._first_departing_step: with a tolerance, the first step whose param or momentum difference exceeds it
    (momentum diffs may be absent); without one, first_step - 1."""
    from types import SimpleNamespace

    from muon_check.adapters.stages import _first_departing_step

    for momentum_diffs in (None, []):
        outcome = SimpleNamespace(
            tolerance=1e-3,
            first_step=1,
            param_diffs=[1e-4, 5e-3, 1.0],
            momentum_diffs=momentum_diffs,
        )
        assert _first_departing_step(outcome) == 1
    outcome = SimpleNamespace(
        tolerance=1e-3, first_step=1, param_diffs=[1e-4, 1e-4], momentum_diffs=[1e-4, 2e-3]
    )
    assert _first_departing_step(outcome) == 1
    assert _first_departing_step(SimpleNamespace(tolerance=None, first_step=3)) == 2


def test_a_shrunk_crash_keeps_its_exception_type_whatever_its_message():
    """verdict.failure_kind keys a crash by its exception type: the same type with another message is the same
    failure, another type is not."""
    from muon_check.adapters.verdict import failure_kind

    def crash(error: str) -> Outcome:
        return _outcome("tall", "crash", error=error)

    one, other = (
        crash("rank 0: ValueError: shape (3, 4)"),
        crash("rank 1: ValueError: shape (1, 2)"),
    )
    assert failure_kind(one) == failure_kind(other)
    assert failure_kind(one)[1] == "ValueError"
    assert failure_kind(crash("rank 0: TypeError: shape (3, 4)")) != failure_kind(one)


def test_initial_params_differ_between_params_and_between_case_seeds():
    """cases.initial_params are seeded per param and per case seed: no two params and no two seeds share them."""
    case = Case("tall", "single", 1, ((4, 3), (4, 3)))
    first, second = initial_params(case)
    assert not torch.equal(first, second)
    reseeded = initial_params(Case("tall", "single", 1, ((4, 3), (4, 3)), seed=1))
    assert not torch.equal(first, reseeded[0]) and not torch.equal(second, reseeded[1])


def test_the_shape_features_of_a_routing_rule():
    """routing._feature: ndim, min/max side and aspect of the last two dims, flat min side and aspect of (shape[0],
    prod(rest)), numel."""
    from muon_check.adapters.routing import FEATURES, _feature

    want = {
        (4, 3, 2, 6): (4, 2, 6, 3.0, 4, 9.0, 144),
        (2, 256): (2, 2, 256, 128.0, 2, 128.0, 512),
        (7,): (1, 7, 7, 1.0, 7, 1.0, 7),
    }
    for shape, values in want.items():
        assert tuple(_feature(name, shape) for name in FEATURES) == values, shape


def test_a_candidate_that_differs_from_itself_is_measured_and_one_that_does_not_is_not():
    """verdict.self_difference: max |dP| over every rank of two runs; 0 where they agree bit for bit."""
    from muon_check.adapters.verdict import self_difference

    def run(*params: torch.Tensor) -> list:
        return [(2, [{"params": [[p]]} for p in params])]

    a, b = torch.zeros(3), torch.tensor([0.0, 0.25, 0.0])
    assert self_difference(run(a, a), run(a, a)) == 0.0
    assert self_difference(run(a, a), run(a, b)) == 0.25  # the second rank differs


def test_other_state_beside_the_adapters_momentum_is_listed_whatever_its_name_sorts_as():
    """verdict._other_state: with the adapter's momentum read, every other param-sized state is listed; where the
    adapter exposed none, its key is listed too."""
    from muon_check.adapters.verdict import _other_state

    adapter = Adapter()
    adapter.state_key = "momentum_buffer"
    state = {
        "['momentum_buffer']": torch.zeros(12, 6),
        "['exp_avg']": torch.zeros(12, 6),
        "['z']": torch.zeros(12, 6),
    }
    results = [{"recorded": {0: {"state": [state]}}}]
    outcome = _outcome("tall", "bitwise", results=[(1, results)], view=View((("adapter", None),)))
    assert _other_state(outcome, adapter) == ["['exp_avg']", "['z']"]
    # where the adapter's momentum() exposed nothing, its key is state the check did not read, and is listed
    for source in (("unmapped", tuple(sorted(state))), ("none", "left out (--state-map none)")):
        outcome = _outcome("tall", "differs", results=[(1, results)], view=View((source,)))
        assert _other_state(outcome, adapter) == sorted(state), source


def test_a_candidate_that_differs_from_itself_is_compared_at_twice_its_largest_difference_per_dtype():
    """conformance._tolerant: tolerance per dtype = TOLERANCE_FACTOR (2) x the run-to-run difference, the context's
    the largest."""
    from types import SimpleNamespace

    from muon_check.conformance import _tolerant

    runner = SimpleNamespace(tolerance=None)
    context = _tolerant(runner, {"float32": 1e-6, "bfloat16": 4e-3}, Context())
    assert runner.tolerance == {"float32": 2e-6, "bfloat16": 8e-3}
    assert context.tolerance == 8e-3 and context.self_differences == {
        "float32": 1e-6,
        "bfloat16": 4e-3,
    }


def test_a_difference_grows_where_its_last_step_is_larger_than_its_first():
    """Outcome.grows: last step's max |dP| > the first differing step's; None where nothing differs."""
    case = Case("tall", "single", 1, ((12, 6),), steps=3)
    assert Outcome(case, "differs", param_diffs=[0.0, 1e-3, 2e-3]).grows is True
    assert Outcome(case, "differs", param_diffs=[0.0, 2e-3, 1e-3]).grows is False
    assert Outcome(case, "differs", param_diffs=[0.0, 1e-3, 1e-3]).grows is False
    assert Outcome(case, "bitwise", param_diffs=[0.0] * 3).grows is None


def test_each_named_rounding_is_its_own_configuration():
    """oracle.ROUNDINGS: sixteen distinct (momentum_local, update_local, other_layout, other_stack) configurations,
    the claim's own (WHOLE) first, every one in the claim's stack mode before any in the other."""
    from muon_check.adapters.oracle import ELEMENTWISE

    assert ELEMENTWISE == {
        "whole": (False, False),
        "shard-local": (True, True),
        "shard-local momentum": (True, False),
        "shard-local update": (False, True),
    }
    configs = [(r.momentum_local, r.update_local, r.other_layout, r.other_stack) for r in ROUNDINGS]
    assert len(set(configs)) == len(configs) == 16 and ROUNDINGS[0] == WHOLE
    assert [r.other_stack for r in ROUNDINGS] == [False] * 8 + [True] * 8


def test_a_cases_gradients_differ_for_every_param_and_step_whatever_its_seed():
    """cases.gradients: a distinct gradient per (step, param) for any case seed."""
    for seed in (0, 1, 12345):
        case = Case("tall", "single", 1, ((2, 2),) * 12, seed=seed, steps=3)
        seen = [g for step in range(3) for g in oracle_gradients(case, step)]
        assert len({tuple(g.reshape(-1).tolist()) for g in seen}) == len(seen) == 36, seed


def test_a_routing_rule_of_two_terms_is_inferred_where_no_single_term_separates():
    """routing.infer_rule: the simplest rule of one term, else two joined by 'or', that routes exactly the routed
    shapes; None where no pair does."""
    from muon_check.adapters.routing import infer_rule, parse_rule

    routed, kept = {(1, 10), (64, 64)}, {(6, 8), (12, 6)}  # a thin matrix and a large one
    rule = infer_rule(routed, kept)
    assert rule == "min_side < 6 or max_side > 12", rule
    predicate = parse_rule(rule)
    assert all(predicate(s) for s in routed) and not any(predicate(s) for s in kept)
    assert infer_rule({(1, 10)}, kept) == "min_side < 6"  # one term where one does
    assert infer_rule(routed, kept | {(2, 100)}) is None  # and none where no pair separates them


def test_an_update_whose_spread_departs_from_a_near_orthogonal_gradients_does_not_follow_it():
    """A multiple of G has G's singular values: within SAME_SPREAD of G's spread, floored at 0.1 (an orthogonal G
    has spread 0, and 0.1 of spread apart is not a multiple of it, though its cosine with G is 0.999)."""
    from muon_check.adapters.routing import _views

    gen = torch.Generator().manual_seed(0)
    G, _ = torch.linalg.qr(torch.randn(12, 6, generator=gen, dtype=torch.float64))
    stretched = torch.ones(6, dtype=torch.float64)
    stretched[-1] = math.exp(-0.1)
    p0 = torch.randn(12, 6, generator=gen, dtype=torch.float64)
    claim = 0.998 * p0 - 0.02 * torch.randn(12, 6, generator=gen, dtype=torch.float64)
    for u, follows in ((G * stretched, False), (G * 3.0, True)):
        update = update_of(p0, 0.998 * p0 - 0.02 * u, claim, G, 0.02, 0.1, _views((12, 6), {}))
        assert update.elementwise is follows and update.follows, update


def test_the_cosine_of_a_matrix_with_its_polar_factor():
    """routing._polar_cos = sum(s) / (sqrt(k) |s|) over the singular values: 1 for a multiple of an orthogonal
    matrix, 1 for zero."""
    from muon_check.adapters.routing import _polar_cos

    gen = torch.Generator().manual_seed(1)
    Q, _ = torch.linalg.qr(torch.randn(8, 4, generator=gen, dtype=torch.float64))
    assert _polar_cos(Q * 3.0) == pytest.approx(
        1.0, abs=1e-12
    )  # a multiple of its own polar factor
    spread = Q * torch.tensor(
        [1.0, 1.0, 1.0, 0.0], dtype=torch.float64
    )  # singular values (1, 1, 1, 0)
    assert _polar_cos(spread) == pytest.approx(3 / (2 * math.sqrt(3)), abs=1e-12)
    assert _polar_cos(torch.zeros(8, 4)) == 1.0


def test_when_a_run_cannot_go_on():
    """verdict.stop: could not run (import), could not build (constructor refuses a plain matrix, with a hint),
    refused (torch.distributed without being declared distributed); None otherwise."""
    from muon_check.adapters.verdict import stop

    distributed = Named()
    distributed.distributed = "dtensor"
    case = Case("tall", "single", 1, ((12, 6),))
    looks = _outcome(
        "tall", "crash", error="rank 0: ValueError: Default process group has not been initialized"
    )
    assert stop(Named(), looks)[0] == "refused" and stop(distributed, looks) is None
    missing = _outcome("tall", "crash", error="rank 0: ModuleNotFoundError: No module named 'x'")
    assert stop(Named(), missing) == (
        "could not run",
        "could not run: rank 0: ModuleNotFoundError: No module named 'x'",
    )
    assert stop(Named(), _outcome("tall", "differs")) is None
    assert (
        stop(Named(), Outcome(case, "unsupported", error="ValueError: no"))[0] == "could not build"
    )
    assert (
        stop(
            Named(), Outcome(Case("conv4d", "single", 1, ((4, 3, 2, 2),)), "unsupported", error="x")
        )
        is None
    )


def test_a_rounding_needed_for_the_momentum_alone_is_named_so():
    """Where shard-local momentum changes bits on the CPU that runs it, a candidate with exactly that rounding
    conforms under it and the report names it; where it does not, the same results are bitwise as they are."""
    from muon_check.adapters.oracle import Rounding

    case = Case("uneven", "dtensor", 2, ((7, 7),) * 2, "bfloat16", steps=3)
    rounding = next(r for r in ROUNDINGS if r.name == "shard-local momentum" and not r.other_layout)
    assert rounding == Rounding("shard-local momentum", True, False)
    run = reference_steps(case, "torch", dict(HYPERPARAMETERS), rounding)["skip"]
    segments = [
        (
            2,
            [
                {
                    "first_step": 0,
                    "params": [[C.local_box(t, case, r) for t in step] for step in run.params],
                    "errors": [None] * 3,
                    "momentum": [C.local_box(m, case, r) for m in run.final_momenta],
                }
                for r in range(2)
            ],
        )
    ]
    outcome = judge(case, segments, "torch", dict(HYPERPARAMETERS))
    assert outcome.status == "bitwise"
    whole = compare(case, segments, reference_of(case))
    assert (outcome.elementwise is None) == (whole.status == "bitwise")
    if outcome.elementwise:
        assert outcome.elementwise.startswith("shard-local momentum, boundaries"), (
            outcome.elementwise
        )
