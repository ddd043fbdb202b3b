"""The configuration search's first-step filter (muon_check.adapters.oracle.may_match): it rules out only
configurations that trial() would not find bitwise or close, so the search's answers are the same with it as
without it, at a fraction of the reference runs."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from muon_check.adapters import oracle
from muon_check.adapters.cases import Case, local_box
from muon_check.adapters.diagnose import Search, alternatives
from muon_check.adapters.oracle import (
    HYPERPARAMETERS,
    ROUNDINGS,
    WHOLE,
    Outcome,
    View,
    judge,
    may_match,
    reference_steps,
    trial,
)
from muon_check.fixtures import same_bits

CLAIM = ("torch", dict(HYPERPARAMETERS))
CASE = Case("tall", "dtensor", 2, ((12, 6), (7, 4)), "bfloat16", steps=2)
# the search's first steps as far as the claim's preset goes (each single change of it, each other preset as it is)
# and a few of its pairs
CONFIGS = [
    (p, t)
    for d, p, t in alternatives(*CLAIM, pairs=False)
    if d.startswith("matches claimed") or " with " not in d
] + [(p, t) for _, p, t in list(alternatives(*CLAIM))[-6:]]
MATCH = ("bitwise", "close")


def ranks(case: Case, run: oracle.RefRun, bump: bool = False) -> list:
    """The results case.world_size ranks would record of a candidate that computes `run`: each rank's boxes of the
    params after every step (bump: the first param's first element one unit in the last place up after step 1)."""
    params = [[p.clone() for p in step] for step in run.params]
    if bump:
        first = params[0][0].view(-1)
        first[0] = torch.nextafter(first[0], torch.tensor(math.inf, dtype=first.dtype))
    W = case.world_size
    return [
        (
            W,
            [
                {
                    "first_step": 0,
                    "params": [[local_box(p, case, rank, W) for p in step] for step in params],
                    "errors": [None] * len(params),
                    "momentum": [None] * len(case.shapes),
                    "recorded": {},
                }
                for rank in range(W)
            ],
        )
    ]


def outcomes() -> list[Outcome]:
    """Candidates that compute muon_ref's run under each Rounding of the claim and of its first alternative (the
    momentum summed), judged under the claim; and one a unit in the last place off the claim's run, judged at a
    tolerance (close)."""
    out = []
    for p, t in [CLAIM, CONFIGS[0]]:
        for rounding in ROUNDINGS:
            run = reference_steps(CASE, p, t, rounding)["skip"]
            out.append(judge(CASE, ranks(CASE, run), *CLAIM))
    results = ranks(CASE, reference_steps(CASE, *CLAIM)["skip"], bump=True)
    reference = reference_steps(CASE, *CLAIM)
    out.append(judge(CASE, results, *CLAIM, view=View.of(CASE, results, reference, tolerance=1.0)))
    assert out[-1].status == "close"
    return out


@pytest.fixture(scope="module")
def cases() -> list[Outcome]:
    return outcomes()


@pytest.fixture(scope="module")
def matches(cases) -> dict[tuple[int, int], bool]:
    """(outcome, configuration) -> does trial() find it bitwise or close (each judged once)."""
    return {
        (i, j): trial(o, p, t).status in MATCH
        for i, o in enumerate(cases)
        for j, (p, t) in enumerate(CONFIGS)
    }


def wrongly_ruled_out(
    may: Callable[[Outcome, Any, Any], bool], cases: list[Outcome], matches: dict
) -> list:
    """(outcome, configuration) where `may` rules a match out and trial() finds one."""
    return [
        (i, j)
        for i, o in enumerate(cases)
        for j, (p, t) in enumerate(CONFIGS)
        if matches[i, j] and not may(o, p, t)
    ]


def test_the_first_step_filter_never_rules_out_a_configuration_that_matches(cases, matches) -> None:
    """For every candidate and every configuration of the search's first steps: where may_match rules it out,
    trial() finds no match. Not vacuous: most configurations are ruled out, and every candidate matches one."""
    assert wrongly_ruled_out(may_match, cases, matches) == []
    ruled_out = sum(not may_match(o, p, t) for o in cases for p, t in CONFIGS)
    assert ruled_out > len(matches) // 2, (ruled_out, len(matches))
    assert all(any(matches[i, j] for j in range(len(CONFIGS))) for i in range(len(cases)))


def test_negative_control_a_filter_that_ignores_the_tolerance_is_caught(cases, matches) -> None:
    """A filter that compares bits where the view has a tolerance rules out the close candidate's own claim."""

    def bits_only(o: Outcome, p: Any, t: Any) -> bool:
        view = o.view if o.view is None else replace(o.view, tolerance=None)
        return may_match(replace(o, view=view), p, t)

    caught = wrongly_ruled_out(bits_only, cases, matches)
    assert caught and {i for i, _ in caught} == {len(cases) - 1}, caught


def test_negative_control_a_filter_that_tries_the_claims_rounding_only_is_caught_where_roundings_differ(
    cases, matches, monkeypatch
) -> None:
    """A filter that tries only the claim's rounding (WHOLE) rules out a candidate built under another rounding,
    wherever that rounding's first step differs from WHOLE's on the CPU that runs the test (measured here)."""

    def whole_only(o: Outcome, p: Any, t: Any) -> bool:
        with monkeypatch.context() as m:
            m.setattr(oracle, "ROUNDINGS", (WHOLE,))
            return may_match(o, p, t)

    def first_step(p: Any, t: Any, rounding: oracle.Rounding) -> list[torch.Tensor]:
        return reference_steps(CASE, p, t, rounding)["skip"].params[0]

    differ = [
        (p, r.name)
        for p, t in [CLAIM, CONFIGS[0]]
        for r in ROUNDINGS
        if not all(same_bits(a, b) for a, b in zip(first_step(p, t, r), first_step(p, t, WHOLE)))
    ]
    caught = wrongly_ruled_out(whole_only, cases, matches)
    assert bool(caught) == bool(differ), (caught, differ)


def test_the_search_finds_the_same_configuration_with_and_without_the_filter(
    cases, monkeypatch
) -> None:
    """Search.find over departing candidates built under another configuration gives the same answer whether
    the filter rules configurations out or lets every one through to trial()."""
    departing = [o for o in cases if o.status == "differs"]
    assert departing
    with_filter = [Search().find([o], *CLAIM, None) for o in departing]
    monkeypatch.setattr("muon_check.adapters.diagnose.may_match", lambda *_: True)
    without = [Search().find([o], *CLAIM, None) for o in departing]
    assert with_filter == without and any(with_filter), with_filter
