"""The oracle's kept reference runs (muon_check.adapters.oracle._reference_run): a run asked for again is the one
kept, and a kept run has the bits a fresh run of its key has, after the checks that read it (callers only read).

Contract: for every key K kept, bits(_kept_runs[K]) == bits(_run_reference(*K[:5])) at K's thread count; a key
whose options cannot be hashed is run each time, never kept under another key."""

from __future__ import annotations

import pytest
import torch

from muon_check import conformance
from muon_check.adapters import oracle
from muon_check.adapters.cases import Case
from muon_check.adapters.planted import PLANTED
from muon_check.fixtures import same_bits
from muon_ref.presets import PRESETS


def _differs_from_fresh(kept: oracle.RefRun, args: tuple) -> list[str]:
    """Where a kept run differs from a fresh run of its arguments (empty: equal bit for bit)."""
    fresh = oracle._run_reference(*args)
    where = []
    for name in ("params", "momenta"):
        for s, (a, b) in enumerate(zip(getattr(kept, name), getattr(fresh, name))):
            where += [
                f"{name} step {s} param {i}"
                for i, (x, y) in enumerate(zip(a, b))
                if not same_bits(x, y)
            ]
    return where


@pytest.fixture
def empty_store(monkeypatch):
    monkeypatch.setattr(oracle, "_kept_runs", type(oracle._kept_runs)())
    return oracle._kept_runs


@pytest.mark.timeout(120)
def test_kept_runs_keep_their_bits_through_a_departing_check_and_its_search(
    empty_store, monkeypatch
) -> None:
    """A departing check (the planted padded-shape scale, one family) searches the nearest configuration, asking for
    many runs, some again: each kept run still has a fresh run's bits afterwards. Negative control: one kept tensor
    changed in place is found by the same comparison."""
    made: dict[int, tuple] = {}  # id of each run made -> its arguments
    run_reference = oracle._run_reference

    def recorded(*args):
        run = run_reference(*args)
        made[id(run)] = args
        return run

    monkeypatch.setattr(oracle, "_run_reference", recorded)
    (planted,) = [p for p in PLANTED if p.field_bug == 4]
    adapter = planted.adapter
    adapter_families = adapter.families
    try:
        adapter.families = frozenset({"padded_scale"})
        report = conformance.check(adapter, (2,), 1, 60.0, 0.0, log=lambda *_: None)
    finally:
        adapter.families = adapter_families
    monkeypatch.setattr(oracle, "_run_reference", run_reference)
    assert not report["conforms"] and "departs on padded_scale" in report["diagnosis"], report[
        "diagnosis"
    ]
    kept = list(empty_store.items())
    assert len(kept) > 10, len(kept)  # the search asked for runs: otherwise nothing here is tested
    for key, run in kept[:: max(1, len(kept) // 25)]:
        assert key[-1] == torch.get_num_threads()
        assert not _differs_from_fresh(run, made[id(run)]), key
    # negative control: a caller that wrote into a kept run would be caught
    key, run = kept[0]
    run.params[-1][0].add_(1.0)
    assert _differs_from_fresh(run, made[id(run)]) == [f"params step {len(run.params) - 1} param 0"]


def test_a_run_asked_again_is_the_kept_one_and_the_thread_count_is_part_of_its_key(
    empty_store,
) -> None:
    """_reference_run(K) is _reference_run(K) again (the same object); an override or the thread count changed is
    another key, another run."""
    case = Case("even", "single", 1, ((4, 5),))
    first = oracle._reference_run(case, "torch", {"lr": 0.02}, "skip", oracle.WHOLE)
    assert oracle._reference_run(case, "torch", {"lr": 0.02}, "skip", oracle.WHOLE) is first
    assert oracle._reference_run(case, "torch", {"lr": 0.03}, "skip", oracle.WHOLE) is not first
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        again = oracle._reference_run(case, "torch", {"lr": 0.02}, "skip", oracle.WHOLE)
    finally:
        torch.set_num_threads(threads)
    assert again is not first and len(empty_store) == 3


def test_an_option_that_cannot_be_hashed_is_run_each_time_and_not_kept(
    empty_store, monkeypatch
) -> None:
    """An override with no hashable value is run by _run_reference at every call and never kept; a hashable one is
    run once and kept. _frozen: equal for equal options in any order, unequal for a list and a tuple."""

    class Unhashable:
        __hash__ = None

    runs: list[object] = []
    monkeypatch.setattr(oracle, "_run_reference", lambda *args: runs.append(object()) or runs[-1])
    case = Case("even", "single", 1, ((4, 5),))
    for _ in range(2):
        oracle._reference_run(case, "torch", {"x": Unhashable()}, "skip", oracle.WHOLE)
    assert len(runs) == 2 and not empty_store
    # control: a hashable option is run once and kept
    for _ in range(2):
        oracle._reference_run(case, "torch", {"x": (1, [2])}, "skip", oracle.WHOLE)
    assert len(runs) == 3 and len(empty_store) == 1
    assert oracle._frozen({"b": [1, 2], "a": {"c": 3}}) == oracle._frozen(
        {"a": {"c": 3}, "b": [1, 2]}
    )
    assert oracle._frozen([1, 2]) != oracle._frozen((1, 2))


def test_a_preset_whose_options_change_is_a_new_claim(empty_store, monkeypatch) -> None:
    """The claim in the key is the preset's options as they are, not its name: a preset changed in place (as the
    presets' negative controls change one) gets runs of its own, with the changed convention's bits."""
    case = Case("even", "single", 1, ((37, 23),))
    before = oracle._reference_run(case, "torch", {}, "skip", oracle.WHOLE)
    monkeypatch.setitem(PRESETS, "torch", {**PRESETS["torch"], "step_form": "keller"})
    after = oracle._reference_run(case, "torch", {}, "skip", oracle.WHOLE)
    assert after is not before and len(empty_store) == 2
    assert not same_bits(after.params[-1][0], before.params[-1][0])
