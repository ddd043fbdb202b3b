"""pipeline_depth: how many batches' Steps are in flight at once in a step (muon_dist.runtime.staggered; the
default muon_dist.plan.PIPELINE_DEPTH, 3). Any depth gives muon_ref's bits; the schedule never has more than that
many batches started and unfinished, and has exactly that many where there are enough batches; a bad value is
refused in one line at construction."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from muon_dist import DistributedMuon
from muon_dist.plan import PIPELINE_DEPTH
from muon_dist.runtime import staggered, writes_first

from .checks import run_case, timeout_for
from .workers import Case


def _in_flight(n_items: int, segments: int, depth: int, schedule=staggered) -> tuple[list, int]:
    """Items 0..n-1, each a Steps of `segments` pauses returning 10 * item; (the values in the order the schedule
    yields them, the most items started and not yet finished at any moment)."""
    live: set[int] = set()
    most = 0

    def start(item: int):
        nonlocal most
        live.add(item)
        most = max(most, len(live))
        for _ in range(segments):
            yield
        live.discard(item)
        return 10 * item

    values = [(item, value) for item, value in schedule(list(range(n_items)), start, depth)]
    return values, most


def _one_too_many(items, start, depth):
    """A planted schedule: staggered with one batch more in flight than asked for."""
    return staggered(items, start, depth + 1)


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("n_items", [1, 2, 5])
def test_the_schedule_holds_at_most_depth_batches_in_flight_and_exactly_that_many_where_it_can(
    depth: int, n_items: int
) -> None:
    """Contract: every item's value, in item order; the most items in flight at once is min(depth, n_items)
    (so depth 1 runs each to its end before the next starts); each item pauses 8 times, more than any depth here,
    so none ends on its own before the schedule ends it. Control: the same count on a schedule that keeps
    one more in flight breaks it wherever there are more items than the depth."""
    values, most = _in_flight(n_items, 8, depth)
    assert values == [(i, 10 * i) for i in range(n_items)]
    assert most == min(depth, n_items)
    _, planted = _in_flight(n_items, 8, depth, _one_too_many)
    assert (planted == min(depth, n_items)) == (n_items <= depth)


def _trace(
    n_items: int, depth: int, schedule=staggered, quiet: frozenset[int] = frozenset()
) -> list[tuple[int, int]]:
    """(item, segment) in the order a schedule runs them, and (item, WRITTEN) where it hands an item back (the step
    then writes it): items of three segments, as an exchange's Steps are (momentum and directions issued |
    directions waited for, kernels, updates issued | updates waited for), the items in `quiet` of one (a batch
    with no all-to-all: all its work at once), the schedule told which pause."""
    ran: list[tuple[int, int]] = []

    def start(item: int):
        for segment in range(1 if item in quiet else 3):
            ran.append((item, segment))
            if segment < 2 and item not in quiet:
                yield
        return item

    if schedule is staggered:
        order = functools.partial(writes_first, pauses=lambda item: item not in quiet)
        schedule = functools.partial(staggered, order=order)
    handed = []
    for item, _ in schedule(list(range(n_items)), start, depth):
        handed.append(item)
        ran.append((item, WRITTEN))
    assert handed == list(range(n_items))
    return ran


WRITTEN = -1  # _trace's mark of an item handed back to be written


def _newest_first(items, start, depth):
    """A planted schedule: the order before the kernels of n - 1 went first (n's directions issued before them)."""
    return staggered(items, start, depth, order=lambda window: list(reversed(window)))


def _kernels_first(items, start, depth):
    """A planted schedule: the order before writes went first (n - 1's kernels, then n's momentum and directions,
    then n - 2's wait for its updates)."""

    def order(window):
        newest = list(reversed(window))
        return newest[1:2] + newest[:1] + newest[2:]

    return staggered(items, start, depth, order=order)


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("n_items", [1, 2, 5])
def test_each_batch_is_written_before_the_next_kernels_and_those_run_before_the_next_directions(
    depth: int, n_items: int
) -> None:
    """Contract (muon_dist.runtime.staggered): batch n - 2 is handed back to be written before batch n - 1's
    kernels (its second segment) run, and batch n's first segment (its momentum stage and its directions'
    all-to-all) runs only after them, so neither n - 2's update buffers nor any buffer of n is alive while n - 1's
    kernels run; every segment of every batch runs once, each batch's in order, and each batch is handed back
    once, after its last; at depth >= 3 batch n - 1 waits for its updates after n has issued its directions.
    Controls: the newest-first order issues n's directions before n - 1's kernels wherever two batches are in
    flight, and the order before this one (n - 1's kernels, n's directions, then n - 2's updates) writes n - 2
    after n - 1's kernels wherever three are."""
    ran = _trace(n_items, depth)
    assert sorted(ran) == sorted([(i, s) for i in range(n_items) for s in (0, 1, 2, WRITTEN)])
    assert all(
        ran.index((i, 0)) < ran.index((i, 1)) < ran.index((i, 2)) < ran.index((i, WRITTEN))
        for i in range(n_items)
    )
    assert all(ran.index((n - 1, 1)) < ran.index((n, 0)) for n in range(1, n_items))
    assert all(ran.index((n - 2, WRITTEN)) < ran.index((n - 1, 1)) for n in range(2, n_items))
    if depth >= 3:
        assert all(ran.index((n, 0)) < ran.index((n - 1, 2)) for n in range(1, n_items))
    old = _trace(n_items, depth, _newest_first)
    broken = any(old.index((n - 1, 1)) > old.index((n, 0)) for n in range(1, n_items))
    assert broken == (n_items > 1 and depth > 1)
    before = _trace(n_items, depth, _kernels_first)
    late = any(before.index((n - 2, WRITTEN)) > before.index((n - 1, 1)) for n in range(2, n_items))
    assert late == (n_items > 2 and depth > 2)


@pytest.mark.parametrize("depth", [2, 3, 4])
def test_a_batch_that_does_not_pause_runs_while_the_batch_before_it_has_directions_in_flight(
    depth: int,
) -> None:
    """Contract: a batch whose Steps do not pause (no all-to-all in flight: a local path, a group of one) runs
    at once, before the batch before it waits for its directions, so its work overlaps them; a pausing batch after
    it still comes after the kernels of the batch before it. Control: told that every batch pauses, the schedule
    runs the quiet batch after those kernels."""
    quiet = frozenset({2, 4})
    ran = _trace(6, depth, quiet=quiet)
    assert sorted(ran) == sorted(
        [(i, 0) for i in quiet]
        + [(i, s) for i in range(6) if i not in quiet for s in range(3)]
        + [(i, WRITTEN) for i in range(6)]
    )
    for n in quiet:  # n - 1 pauses: its kernels (segment 1) come after the quiet batch
        assert ran.index((n, 0)) < ran.index((n - 1, 1))
    for n in (1, 3, 5):  # pausing after a pause, or after a quiet batch that has nothing left
        before = (n - 1, 1) if n - 1 not in quiet else (n - 1, 0)
        assert ran.index(before) < ran.index((n, 0))
    told_all_pause = _trace(6, depth, functools.partial(staggered, order=writes_first), quiet)
    assert all(told_all_pause.index((n - 1, 1)) < told_all_pause.index((n, 0)) for n in quiet)


def _quiet_at_once(window, pauses):
    """A planted order: the rule before quiet batches were held (a quiet newest runs at once, whatever is in
    flight)."""
    if not pauses(window[-1].item):
        return [window[-1], *list(window)[:-1]]
    return list(window)


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_batches_that_do_not_pause_with_nothing_in_flight_run_while_the_next_batch_s_directions_travel(
    depth: int,
) -> None:
    """Contract (runtime.writes_first): quiet batches (no all-to-all) at the start of a step, where nothing is in
    flight, are held until the next batch that pauses has run its first segment (its momentum stage, its
    directions issued); then they run, in plan order, before that batch's second segment (its kernels and the
    updates that carry a write group's failure flag), and are handed back in plan order. The depth counts held
    batches: at depth d, all but d - 1 of them run at once (depth 1: one at a time, as without a pipeline).
    Control: the rule before (a quiet batch runs at once) runs every quiet batch before anything travels."""
    quiet = frozenset({0, 1})
    expected = sorted(quiet)[len(quiet) - min(depth - 1, len(quiet)) :]

    def held(ran: list) -> list[int]:
        return [n for n in sorted(quiet) if ran.index((n, 0)) > ran.index((2, 0))]

    ran = _trace(4, depth, quiet=quiet)
    assert held(ran) == expected
    assert all(ran.index((n, 0)) < ran.index((2, 1)) for n in quiet)
    assert ran.index((0, 0)) < ran.index((1, 0))
    before = functools.partial(
        staggered,
        order=functools.partial(_quiet_at_once, pauses=lambda item: item not in quiet),
    )
    assert (held(_trace(4, depth, before)) == expected) == (depth == 1)


def _held_to_the_end(window, pauses):
    """A planted order: quiet batches with nothing in flight held, but never run before the next pausing batch's
    second segment (they run only when the depth or the end of the step forces them)."""
    newest = window[-1]
    if not pauses(newest.item):
        if any(r.started and not r.finished for r in window):
            return [newest, *list(window)[:-1]]
        return []
    return [r for r in window if r.started or r is newest]


def _kernels_before_each_flag(ran: list, quiet: frozenset[int], n_items: int) -> bool:
    """Whether every batch's kernels (a quiet batch's one segment, a pausing batch's second) ran before each later
    pausing batch's second segment, where its updates, and the failure flag of its write group, are issued."""
    kernels = {i: ran.index((i, 0 if i in quiet else 1)) for i in range(n_items)}
    return all(
        kernels[i] < ran.index((p, 1)) for p in range(n_items) if p not in quiet for i in range(p)
    )


@given(
    n_items=st.integers(1, 8),
    depth=st.integers(1, 5),
    quiet_bits=st.integers(0, 2**8 - 1),
)
def test_every_batch_s_kernels_run_before_a_later_batch_issues_its_failure_flag(
    n_items: int, depth: int, quiet_bits: int
) -> None:
    """Contract (runtime.staggered with writes_first), over any mix of quiet and pausing batches and any depth:
    every segment runs once, each batch's in order, batches are handed back in plan order, and every batch's kernels
    run before any later pausing batch issues its updates (the write group's failure flag rides on them, and is read
    then: a kernel run after it would fail unreported). Control: an order that holds quiet batches past the next
    pausing batch's updates breaks the last wherever a quiet batch with nothing in flight comes before a pausing
    one and the depth does not force it (asserted on the case below)."""
    quiet = frozenset(i for i in range(n_items) if quiet_bits >> i & 1)
    ran = _trace(n_items, depth, quiet=quiet)
    segments = [(i, s) for i in range(n_items) for s in ((0,) if i in quiet else (0, 1, 2))]
    assert sorted(ran) == sorted(segments + [(i, WRITTEN) for i in range(n_items)])
    assert all(
        ran.index((i, s)) < ran.index((i, s + 1)) for i, s in segments if (i, s + 1) in segments
    )
    assert _kernels_before_each_flag(ran, quiet, n_items)


def test_the_flag_control_fails_where_quiet_batches_are_held_too_long() -> None:
    """The control of the property above: quiet batches 0 and 1 before pausing batch 2 at depth 3, held by an order
    that never runs them before batch 2's second segment, run after it; writes_first runs them before it."""
    quiet = frozenset({0, 1})
    planted = functools.partial(
        staggered,
        order=functools.partial(_held_to_the_end, pauses=lambda item: item not in quiet),
    )
    assert not _kernels_before_each_flag(_trace(4, 3, planted), quiet, 4)
    assert _kernels_before_each_flag(_trace(4, 3, quiet=quiet), quiet, 4)


@pytest.mark.timeout(timeout_for(120))
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("depth", [1, 2, PIPELINE_DEPTH, 5])
def test_every_pipeline_depth_equals_muon_ref_bitwise(world_size: int, depth: int) -> None:
    """Contract: at any depth the step's params and momentum buffers are muon_ref's bitwise, with the planned
    paths, bytes and collectives (run_case). Several batches: global dispatch in four rounds over S0 and S1
    shard groups, a plain param, a 3-D expert stack. (The negative controls of run_case's comparison:
    tests/dist/test_equivalence.py's sabotaged steps.)"""
    shapes = ((8, 6),) * 4 + ((6, 10),) * 3 + ((5, 7),) + ((3, 4, 5),)
    placements = ("S0",) * 4 + ("S1",) * 3 + ("plain",) + ("S0",)
    case = Case(shapes, placements, options=(("rounds", 4), ("pipeline_depth", depth)))
    run_case(world_size, case)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2"])
def test_a_bad_pipeline_depth_is_refused_in_one_line_at_construction(bad) -> None:
    """pipeline_depth: None or an int >= 1; anything else raises ValueError naming the parameter and the value
    when the optimizer is built (on every rank, before any collective)."""
    with pytest.raises(ValueError) as refused:
        DistributedMuon([torch.zeros(4, 4, requires_grad=True)], pipeline_depth=bad)
    assert str(refused.value) == (
        f"pipeline_depth must be None or an int >= 1 (1: one batch at a time), got {bad!r}"
    )
    assert DistributedMuon([torch.zeros(4, 4, requires_grad=True)]).options.pipeline_depth == 3
