"""The planner: a pure function whose plan is the same on every rank, checks itself, and whose digest changes
exactly when what the ranks must agree on changes."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muon_dist import Entry, Options, plan

from tests.conftest import examples

from .batches import layout_1d
from .checks import timeout_for

pytestmark = pytest.mark.timeout(timeout_for(60))


def entry(rank: int, W: int, shape: tuple[int, int], placement: str, group: int = 0, active: bool = True) -> Entry:
    """What rank `rank` plans for a param (a layout is rank-independent: `rank` shows the plan does not vary)."""
    return Entry(layout_1d(shape, placement, W, "torch.float32"), group, "torch.bfloat16", active)


specs = st.lists(st.tuples(st.sampled_from([(5, 3), (4, 4), (1, 7)]), st.sampled_from(["S0", "S1", "R"]),
                           st.integers(0, 1), st.booleans()), min_size=1, max_size=20)


@settings(max_examples=examples(2.0))
@given(W=st.integers(1, 8), spec=specs, options=st.sampled_from([Options(), Options("padded_all_to_all"),
                                                                  Options(force_path="agrs")]))
def test_every_rank_plans_the_same_batches_and_digest(W: int, spec: list, options: Options) -> None:
    plans = [plan(tuple(entry(r, W, *s) for s in spec), options) for r in range(W)]
    assert len({p.digest() for p in plans}) == 1
    assert len({p.batches for p in plans}) == 1
    paths = plans[0].path_of()
    assert [p is not None for p in paths] == [s[3] for s in spec]
    for batch in plans[0].batches:
        assert len({spec[i][:3] for i in batch.params}) == 1  # one layout and group per batch
        assert (batch.path == "replicated") == (spec[batch.params[0]][1] == "R")


@pytest.mark.parametrize("change", ["shape", "placement", "active", "group"])
def test_the_digest_changes_when_what_ranks_must_agree_on_changes(change: str) -> None:
    a = (entry(0, 4, (5, 3), "S0"), entry(0, 4, (4, 4), "S1"))
    changed = {"shape": entry(0, 4, (3, 5), "S0"), "placement": entry(0, 4, (5, 3), "S1"),
               "active": entry(0, 4, (5, 3), "S0", active=False), "group": entry(0, 4, (5, 3), "S0", group=1)}[change]
    assert plan(a, Options()).digest() != plan((changed, a[1]), Options()).digest()


def test_full_batches_take_all_to_all_and_the_remainder_the_remainder_path() -> None:
    entries = tuple(entry(0, 4, (5, 3), "S0") for _ in range(6))
    assert plan(entries, Options()).path_of() == ("all_to_all",) * 4 + ("agrs",) * 2
    padded = plan(entries, Options("padded_all_to_all"))
    last = padded.batches[-1]
    assert padded.path_of()[4:] == ("padded_all_to_all",) * 2 and last.group_size - len(last.params) == 2  # padding


@pytest.mark.parametrize("kwargs", [dict(remainder="all_to_all"), dict(force_path="replicated"),
                                    dict(force_path="all_to_all"), dict(force_path="x")])
def test_unknown_path_options_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="must be"):
        Options(**kwargs)


def test_the_plan_checks_its_own_invariants() -> None:
    p = plan(tuple(entry(0, 2, (5, 3), "S0") for _ in range(2)), Options())
    with pytest.raises(AssertionError):
        dataclasses.replace(p, batches=p.batches[:0])
