"""The check's words for what is not a bug, and where a departure starts: each answer on a small candidate written
here, with a negative control that the same machinery answers otherwise when the cause is absent.

- stage location (stages.py): a candidate one convention away from its claim, at each stage, is located there;
- routing (routing.py): params sent to AdamW are listed apart with the rule, a claim can state it, and a bug on the
  params it keeps is still a departure;
- not a Muon: SGD under a Muon claim;
- non-deterministic: a candidate with stochastic rounding is compared at its own run-to-run tolerance, and a real
  defect beyond it still departs;
- unsupported input: torch.optim.Muon's construction refusal of N-D params;
- the no-adapter route: a class that needs a param-group key stops at once with a hint; `betas` is mapped;
- claimed conventions reach the oracle (flatten included), the search finds two options at once and names the
  nearest configuration when none is exact, and the shrinker keeps the cause.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from typing import Any

import pytest
import torch

import muon_ref
from muon_check import conformance
from muon_check.adapters import Adapter, ImportPath, keyword_map
from muon_check.adapters.cases import Case
from muon_check.adapters.oracle import Outcome, reference_optimizer
from muon_check.adapters.routing import infer_rule, parse_rule
from muon_check.conformance import check, run_here
from muon_ref.config import CONFIG_KEYS
from muon_ref.functional import LAYOUT_DEFAULTS
from tests.conftest import quiet
from tests.conftest import run_conformance as run_main

pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------- stage location


class Configured(Adapter):
    """muon_ref.Muon under preset torch with `options` over it, claiming plain preset torch."""

    name, preset = "configured muon_ref", "torch"
    options: dict[str, Any] = {}

    def build(self, params, **hp):
        groups = [{"params": [p], "flatten": p.ndim >= 4} for p in params]
        return muon_ref.Muon(groups, preset="torch", **{**hp, **self.options})


def _located(options: dict[str, Any], shape: tuple[int, ...], dtype: str = "float32") -> Outcome:
    adapter = Configured()
    adapter.options = options
    return run_here(adapter, Case("drawn", "single", 1, (shape,), dtype, steps=2))


@pytest.mark.parametrize(
    "options, stage",
    [
        ({"momentum_style": "sum", "nesterov_form": "add_alpha"}, "momentum"),
        ({"nesterov": False}, "Nesterov input"),
        (
            {"normalize_before_cast": True, "ns_dtype": torch.bfloat16},
            "Newton-Schulz input and normalisation",
        ),
        ({"schedule": "you5"}, "orthogonalised direction"),
        ({"lr_scale": "match_rms_adamw"}, "shape scale"),
        ({"weight_decay_form": "add_self"}, "weight decay"),
        ({"scale_apply": "update_lr"}, "application"),
    ],
)
def test_a_candidate_one_convention_away_is_located_at_that_stage(options, stage):
    outcome = _located(options, (12, 6))
    assert outcome.status == "differs" and outcome.stage == stage, (
        outcome.stage,
        outcome.stage_detail,
    )


def test_negative_control_the_claim_itself_has_no_stage():
    outcome = _located({}, (12, 6))
    assert outcome.status == "bitwise" and outcome.stage is None


def test_a_bf16_decay_factor_rounded_in_place_is_located_at_the_weight_decay_with_its_value():
    outcome = run_here(RoundedDecay(), Case("drawn", "single", 1, ((12, 6),), "bfloat16", steps=2))
    assert outcome.stage == "weight decay", outcome.stage_detail
    assert "0.998 rounded to bfloat16 (0.99609375)" in outcome.stage_detail


class RoundedDecayMuon(muon_ref.Muon):
    """muon_ref's torch preset, but the decay factor multiplies bf16 params as a bf16 tensor (0.998 -> 0.99609375:
    pytorch-optimizer 4.1.0's foreach path does this on CPU)."""

    def param_step(self, p, grad, buf, cfg, layout):
        if p.dtype == torch.bfloat16:
            rounded = float(
                torch.tensor(1 - float(cfg.lr) * cfg.weight_decay, dtype=torch.bfloat16)
            )
            cfg = cfg.replace(weight_decay=(1 - rounded) / float(cfg.lr))
        return super().param_step(p, grad, buf, cfg, layout)


class RoundedDecay(Adapter):
    name, preset = "rounded decay", "torch"

    def build(self, params, **hp):
        return RoundedDecayMuon(params, preset="torch", **hp)


# ---------------------------------------------------------------- routing


class RoutingMuon(torch.optim.Optimizer):
    """Muon (muon_ref, preset torch) on 2-D params with both sides >= `min_side`, AdamW on every other param, as
    timm and keras route; `defect` adds a wrong scale to the Muon params (a bug routing must not hide)."""

    min_side, defect = 2, False

    def __init__(self, params, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=True):
        params = list(params)
        super().__init__(params, {"lr": lr})
        muon = [p for p in params if p.ndim == 2 and min(p.shape) >= self.min_side]
        other = [p for p in params if not any(p is q for q in muon)]
        options = {"lr_scale": "spectral"} if self.defect else {}
        self.inner = []
        if muon:
            self.inner.append(
                muon_ref.Muon(
                    muon,
                    preset="torch",
                    lr=lr,
                    weight_decay=weight_decay,
                    momentum=momentum,
                    nesterov=nesterov,
                    **options,
                )
            )
        if other:
            self.inner.append(torch.optim.AdamW(other, lr=lr, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for opt in self.inner:
            opt.step()
            self.state.update(opt.state)


class TallToAdamW(RoutingMuon):
    """Routes by an aspect ratio: a (12, 6) hidden matrix goes to AdamW too (min_side 7 sends sides below 7)."""

    min_side = 7


class BuggyRoutingMuon(RoutingMuon):
    defect = True


ROUTING_FAMILIES = [
    "--families",
    "tall",
    "square",
    "row",
    "experts3d",
    "--steps",
    "2",
    "--shrink-budget",
    "0",
]


def test_params_sent_to_adamw_are_listed_apart_with_the_rule_and_the_rest_conforms(tmp_path):
    out_json = tmp_path / "r.json"
    code, out, _ = run_main(
        [
            "--adapter",
            f"{__name__}:RoutingMuon",
            "--preset",
            "torch",
            *ROUTING_FAMILIES,
            "--json",
            str(out_json),
        ]
    )
    assert code == 0 and "verdict: conforms" in out, out
    assert "routing: params of shape (1, 10), (3, 6, 4) go to another optimizer" in out, out
    assert "Adam-style second moment" in out and "rule inferred: min_side < 6" in out, out
    assert "bug" not in out.split("diagnosis:")[1], out
    report = json.loads(out_json.read_text())["reports"][0]
    assert any("routed" in item for item in report["not_compared"]), report["not_compared"]


def test_a_tall_matrix_sent_to_adamw_is_routing_not_a_bug():
    code, out, _ = run_main(
        ["--adapter", f"{__name__}:TallToAdamW", "--preset", "torch", *ROUTING_FAMILIES]
    )
    assert code == 0 and "(12, 6)" in out.split("routing:")[1], out


def test_a_stated_routing_is_honoured_and_a_bug_on_the_kept_params_still_departs():
    stated = ["--routing", "ndim != 2 or min_side < 2"]
    code, out, _ = run_main(["--adapter", f"{__name__}:RoutingMuon", *stated, *ROUTING_FAMILIES])
    assert code == 0 and "the claim states: ndim != 2 or min_side < 2" in out, out
    # negative control: routing never hides a departure of the params the candidate keeps
    code, out, _ = run_main(
        ["--adapter", f"{__name__}:BuggyRoutingMuon", *stated, *ROUTING_FAMILIES]
    )
    assert code == 1 and "lr_scale='spectral'" in out.split("diagnosis:")[1], out


def test_routing_rules_parse_and_infer():
    rule = parse_rule("ndim != 2 or min_side < 2")
    assert rule((3, 6, 4)) and rule((1, 10)) and not rule((12, 6))
    assert infer_rule({(1, 10), (3, 6, 4)}, {(12, 6), (8, 8)}) == "min_side < 6"
    # timm's rule (min(shape[0], prod(rest)) < 4) and keras's (ndim != 2), from the shapes the check runs
    kept = {(12, 6), (6, 12), (8, 8), (13, 7), (6, 4), (6, 8), (8, 6)}
    assert infer_rule({(1, 10), (3, 6, 4)}, kept | {(4, 3, 2, 2)}) == "flat_min_side < 4"
    assert infer_rule({(3, 6, 4), (4, 3, 2, 2)}, kept | {(1, 10)}) == "ndim != 2"
    routed, kept = {(1, 10), (3, 6, 4)}, {(12, 6), (8, 8), (20, 3)}
    inferred = parse_rule(infer_rule(routed, kept))
    assert all(inferred(s) for s in routed) and not any(inferred(s) for s in kept)
    assert infer_rule({(20, 2)}, {(12, 6), (8, 8), (6, 12)}) == "min_side < 6"
    assert infer_rule(set(), {(8, 8)}) is None
    assert infer_rule({(8, 8)}, {(8, 8)}) is None  # one shape both ways: no rule
    with pytest.raises(ValueError, match="'side < 2' is not one of"):
        parse_rule("side < 2")


# ---------------------------------------------------------------- not a Muon


def test_sgd_under_a_muon_claim_is_not_a_muon_with_its_singular_values():
    adapter = ImportPath("torch.optim:SGD", preset="torch")
    adapter.families = frozenset({"tall", "square", "wide"})
    report = check(adapter, (1,), 2, 60.0, 0.0, dtypes=("float32",), log=quiet)
    assert report["verdict"] == "not a Muon", report["diagnosis"]
    assert "singular values span" in report["diagnosis"]
    # negative control: muon_ref under the same claim is a Muon and conforms
    control = ImportPath("muon_ref:Muon", preset="torch")
    control.families = adapter.families
    assert (
        check(control, (1,), 2, 60.0, 0.0, dtypes=("float32",), log=quiet)["verdict"] == "conforms"
    )


# ---------------------------------------------------------------- non-deterministic


class StochasticMuon(muon_ref.Muon):
    """muon_ref, then each bf16 param moved one unit in the last place up or down at random (torch's generator):
    stochastic rounding's effect. `bug` doubles the weight decay as well."""

    bug = False

    def param_step(self, p, grad, buf, cfg, layout):
        if self.bug:
            cfg = cfg.replace(weight_decay=2 * cfg.weight_decay)
        new_p, new_buf = super().param_step(p, grad, buf, cfg, layout)
        if new_p.dtype == torch.bfloat16:
            up = torch.nextafter(new_p, torch.full_like(new_p, math.inf))
            down = torch.nextafter(new_p, torch.full_like(new_p, -math.inf))
            coin = torch.rand(new_p.shape) < 0.5
            new_p = torch.where(torch.rand(new_p.shape) < 0.5, torch.where(coin, up, down), new_p)
        return new_p, new_buf


class BuggyStochasticMuon(StochasticMuon):
    bug = True


def _stochastic(cls: type) -> dict:
    adapter = ImportPath(f"{__name__}:{cls.__name__}", preset="torch")
    adapter.families = frozenset({"tall", "square"})
    return check(adapter, (1,), 2, 60.0, 0.0, log=quiet)


def test_a_stochastic_rounding_muon_is_named_non_deterministic_and_compared_at_its_tolerance():
    report = _stochastic(StochasticMuon)
    assert report["verdict"] == "conforms within tolerance", report["diagnosis"]
    assert "non-deterministic: two runs on the same inputs differ by up to" in report["diagnosis"]
    assert set(report["self_differences"]) == {"bfloat16"} and report["tolerance"] > 0
    # negative control: a real defect beyond the tolerance still departs
    buggy = _stochastic(BuggyStochasticMuon)
    assert buggy["verdict"] == "departs" and "weight decay departs" in buggy["diagnosis"], buggy[
        "diagnosis"
    ]


# ---------------------------------------------------------------- unsupported input, construction


def test_torch_muon_refusing_nd_params_at_construction_is_unsupported_input_not_a_crash():
    adapter = ImportPath("torch.optim:Muon", preset="torch")
    adapter.families = frozenset({"conv4d", "experts3d", "tall"})
    report = check(adapter, (1,), 2, 60.0, 30.0, log=quiet)
    assert report["verdict"] == "conforms", report["diagnosis"]
    assert "unsupported input: refused at construction on conv4d" in report["diagnosis"]
    assert (
        "Muon only supports 2D parameters" in report["diagnosis"]
        and "crash" not in report["diagnosis"]
    )
    assert report["minimal_failing_cases"] == []  # a refusal is not shrunk


class GroupKeyMuon(muon_ref.Muon):
    """Needs every param group to say use_muon (pytorch-optimizer's Muon does: its groups are Muon or AdamW)."""

    def add_param_group(self, group):
        if "use_muon" not in group:
            raise ValueError("`use_muon` must be set.")
        super().add_param_group({k: v for k, v in group.items() if k != "use_muon"})


def test_a_class_that_needs_a_group_key_stops_at_once_with_a_hint_and_runs_with_it():
    started = time.monotonic()
    code, out, _ = run_main(
        ["--adapter", f"{__name__}:GroupKeyMuon", "--families", "tall", "square"]
    )
    assert code == 2 and "verdict: could not build" in out, out
    assert "it names use_muon" in out and "--group" in out, out
    assert time.monotonic() - started < 60  # no shrinking of a construction failure
    code, out, _ = run_main(
        [
            "--adapter",
            f"{__name__}:GroupKeyMuon",
            "--families",
            "tall",
            "square",
            "--group",
            '{"use_muon": true}',
        ]
    )
    assert code == 0 and "verdict: conforms" in out, out


class BetasMuon(muon_ref.Muon):
    """Takes betas=(momentum, second) and no momentum keyword."""

    def __init__(self, params, lr=1e-3, betas=(0.95, 0.99), weight_decay=0.0, nesterov=True):
        super().__init__(
            params,
            preset="torch",
            lr=lr,
            momentum=betas[0],
            weight_decay=weight_decay,
            nesterov=nesterov,
        )


def test_betas_is_mapped_by_signature_and_an_ambiguous_signature_is_not():
    names, defaults = keyword_map(BetasMuon)
    assert names["momentum"] == "betas" and defaults["betas"] == (0.95, 0.99)
    code, out, _ = run_main(
        ["--adapter", f"{__name__}:BetasMuon", "--families", "tall", "--steps", "2"]
    )
    assert code == 0 and "momentum as betas" in out, out

    def both(params, momentum=0.9, betas=(0.9, 0.99)): ...

    assert keyword_map(both)[0]["momentum"] == "momentum"  # its own name wins over a synonym

    def mu_and_beta(params, mu=0.9, beta=0.9): ...

    assert keyword_map(mu_and_beta)[0]["momentum"] is None  # two synonyms: not guessed


# ---------------------------------------------------------------- claims reach the oracle


@pytest.mark.parametrize("key", [*CONFIG_KEYS, *LAYOUT_DEFAULTS])
def test_every_option_a_claim_may_set_reaches_the_reference(key):
    values = {
        "lr": 0.3,
        "weight_decay": 0.2,
        "momentum": 0.5,
        "nesterov": False,
        "momentum_style": "sum",
        "nesterov_form": "mul_add",
        "weight_decay_form": "add_self",
        "lr_scale": "spectral",
        "scale_sqrt": "pow",
        "scale_factor": 0.5,
        "scale_apply": "update",
        "update_dtype": torch.float32,
        "update_layout": "contiguous",
        "schedule": "you5",
        "ns_steps": 7,
        "eps": 1e-3,
        "ns_dtype": torch.float32,
        "step_form": "dion",
        "eps_mode": "add",
        "safety": 1.05,
        "normalize_before_cast": True,
        "precondition": "aol",
        "ns_stack": "batched",
        "flatten": True,
        "nonfinite": "skip",
        "num_experts": 3,
        "split_sizes": (2, 2),
        "num_heads": 2,
        "split_dim": 0,
    }
    shape = (3, 4, 2) if key == "flatten" else ((6, 2) if key == "num_experts" else (4, 2))
    options = {key: values[key]}
    if key == "momentum_style":
        options["nesterov_form"] = "add_alpha"
    if key == "nesterov_form":
        options["momentum_style"] = "sum"
    if key == "split_dim":
        options["num_heads"] = 2
    params = [torch.zeros(shape)]
    case = Case("drawn", "single", 1, (shape,))
    group = reference_optimizer(params, case, "torch", options).param_groups[0]
    assert group[key] == values[key] if key != "split_sizes" else tuple(group[key]) == (2, 2)


class FlattenMuon(Adapter):
    """muon_ref with every 3-D param flattened to (shape[0], -1) (pytorch-optimizer's Muon does)."""

    name, preset = "flattens 3-D", "torch"
    families = frozenset({"experts3d", "tall"})

    def build(self, params, **hp):
        return muon_ref.Muon(
            [{"params": [p], "flatten": p.ndim >= 3} for p in params], preset="torch", **hp
        )


class ClaimsFlatten(FlattenMuon):
    overrides = {"flatten": True}


def test_a_claimed_flatten_reaches_the_oracle_and_an_unclaimed_one_is_found_as_a_convention():
    assert check(ClaimsFlatten(), (1,), 2, 60.0, 0.0, log=quiet)["verdict"] == "conforms"
    report = check(FlattenMuon(), (1,), 2, 60.0, 0.0, log=quiet)
    assert report["verdict"] == "departs" and "flatten=True" in report["diagnosis"], report[
        "diagnosis"
    ]


# ---------------------------------------------------------------- search depth, nearest, shrinker


class TwoAway(Configured):
    options = {"lr_scale": "spectral_norm", "weight_decay_form": "add_self"}
    families = frozenset({"tall", "wide", "square"})


class NotExpressible(Configured):
    """lr_scale match_rms_adamw (a convention) and every param scaled by 1 + 2^-21 after the step (no option has
    it: a few units in the last place of fp32)."""

    options = {"lr_scale": "match_rms_adamw"}
    families = frozenset({"tall", "wide", "square"})
    dtypes = ("float32",)

    def build(self, params, **hp):
        opt = super().build(params, **hp)
        inner_step = opt.step

        def step(closure=None):
            inner_step(closure)
            with torch.no_grad():
                for p in params:
                    p.mul_(1 + 2.0**-21)

        opt.step = step
        return opt


def test_the_search_finds_two_options_at_once():
    report = check(TwoAway(), (1,), 2, 60.0, 0.0, log=quiet)
    assert (
        "lr_scale='spectral_norm'" in report["diagnosis"]
        and "weight_decay_form='add_self'" in report["diagnosis"]
    ), report["diagnosis"]
    assert report["diagnosis"].startswith("convention: matches claimed preset 'torch' with")
    # it tried what it needed to: nothing to qualify
    assert "search stopped" not in report["diagnosis"]


def test_a_search_stopped_at_its_budget_says_so_beside_the_departures_it_left():
    """A departure that the configuration search did not explain is a bug or a departure only as far as the search
    went: where its budget ran out first, the diagnosis says so once, after the departures, and names no convention
    it did not reach. The candidate is TwoAway (two conventions at once, found with the default budget: the test
    above is the negative control); with a budget of 0 the search stops before its first configuration."""
    report = check(TwoAway(), (1,), 2, 60.0, 0.0, log=quiet, search_budget=0.0)
    diagnosis = report["diagnosis"]
    assert report["verdict"] == "departs" and "convention:" not in diagnosis, diagnosis
    assert diagnosis.endswith(
        "; the configuration search stopped at its 0 s budget (--search-budget), so a convention it did not reach "
        "is not ruled out"
    ), diagnosis
    assert diagnosis.count("search stopped") == 1, diagnosis


def test_where_nothing_is_exact_the_nearest_configuration_is_named_with_its_distance():
    report = check(NotExpressible(), (1,), 2, 60.0, 0.0, log=quiet)
    assert report["verdict"] == "departs"
    assert (
        "nearest configuration: claimed preset 'torch' with lr_scale='match_rms_adamw'"
        in report["diagnosis"]
    ), report["diagnosis"]
    assert "units in the last place" in report["diagnosis"]


class Scripted:
    """A runner whose run() answers from a table (the shrinker's view of a runner)."""

    timeout = 60.0

    def __init__(self, answers: dict[Case, Outcome]) -> None:
        self.answers = answers

    def run(self, case, timeout=None):
        return self.answers.get(case, Outcome(case, "bitwise"))


def test_the_shrinker_keeps_the_cause_stage_partition_and_routing():
    case = Case("tall", "single", 1, ((12, 6),), "bfloat16", steps=2)
    first = Outcome(case, "differs", stage="weight decay")
    smaller_steps = replace(case, steps=1)
    half = replace(case, shapes=((11, 6),))
    answers = {
        smaller_steps: Outcome(smaller_steps, "differs", stage="momentum"),  # another cause
        half: Outcome(half, "differs", stage="weight decay", routed={0: "Adam"}),  # routed
    }
    assert conformance.shrink(Scripted(answers), first, 10.0).case == case
    answers[smaller_steps] = Outcome(smaller_steps, "differs", stage="weight decay")
    assert conformance.shrink(Scripted(answers), first, 10.0).case.steps == 1
