"""The step's pipeline runtime: paths as Steps (generators that pause after issuing each collective), and the
schedule that interleaves them.

A path's Steps yields right after issuing a collective (which then runs while the caller computes) and returns
its updates. staggered() runs the Steps of consecutive batches as a software pipeline in an order that is a pure
function of the batches, so every rank resumes the same Steps in the same order and issues the same collectives
in the same order (a mismatch would be a hang, not an error).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, TypeVar

# A path's run as a generator: None at each pause, the path's updates as its return value.
Steps = Generator[None, None, Any]

Item = TypeVar("Item")


def run_to_end(steps: Steps) -> Any:
    """The value a Steps generator returns, resumed until it ends."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def blocking(steps: Callable[..., Steps]) -> Callable[..., Any]:
    """A pipelined path's run from its steps: the same arguments, the Steps run to their end."""

    def run(*args: Any, **kwargs: Any) -> Any:
        return run_to_end(steps(*args, **kwargs))

    return run


class _Running:
    """One item's Steps in the pipeline: resumed one segment at a time until it returns its value."""

    def __init__(self, item: Any, steps: Steps) -> None:
        self.item, self.steps, self.finished, self.value = item, steps, False, None
        # whether any segment has run (a Steps that has not started holds nothing)
        self.started = False

    def advance(self) -> None:
        self.started = True
        try:
            next(self.steps)
        except StopIteration as end:
            self.finished, self.value = True, end.value

    def finish(self) -> tuple[Any, Any]:
        """(item, value), resumed to its end first; the value is then held by the caller alone (a batch's updates
        go as soon as they are written, wherever this object is still referenced)."""
        while not self.finished:
            self.advance()
        value, self.value = self.value, None
        return self.item, value


def writes_first(
    window: Sequence[_Running], pauses: Callable[[Any], bool] = lambda item: True
) -> list[_Running]:
    """staggered's order of the items in flight (`window`, oldest first): oldest first, so that the items before
    n - 1 wait for their updates (and each is handed back, to be written, as soon as it ends) before n - 1 waits
    for its directions, runs its kernels and issues its updates, and the newest, n, runs its momentum stage and
    issues its directions last; but the newest first where it does not pause (pauses(item) False: its Steps run
    to their end at once, issuing no collective that stays in flight), so that its work overlaps what the item
    before it has in flight, and it holds nothing past its segment. Where nothing is in flight (no started,
    unfinished item: the step's first items, or after the pipeline ran dry), such an item is held, not started:
    it runs right after the next item that pauses has run its first segment (its momentum stage, its directions
    issued), so that its work overlaps those directions instead of running before anything travels. A held item
    stays in the window in plan order, so it is handed back, and checked with its write group, as before; it runs
    before that next item's second segment (its kernels and its updates, which carry a write group's failure
    flag)."""
    newest = window[-1]
    if not pauses(newest.item):
        if any(r.started and not r.finished for r in window):
            return [newest, *list(window)[:-1]]
        return []  # held: nothing in flight that its work could overlap
    held = [r for r in window if not r.started and r is not newest]
    return [*(r for r in window if r.started), newest, *held]


def staggered(
    items: Sequence[Item],
    start: Callable[[Item], Steps],
    depth: int,
    order: Callable[[Sequence[_Running]], Sequence[_Running]] = writes_first,
) -> Iterator[tuple[Item, Any]]:
    """(item, start(item)'s value) for every item, in order, with the Steps of up to `depth` items interleaved:
    when item n starts, first the next segment of each older unfinished item runs, oldest first (n - 2 waits for
    its updates), then item n - 1's (it waits for its directions, runs its kernels and issues its updates), then
    item n's first segment (up to its first yield: its momentum stage, and it issues its directions); the oldest
    item runs to its end once `depth` items are in flight. Each item is handed back as soon as it and every item
    before it have ended, between segments: so n - 2 is written before n - 1's kernels run, which hold the step's
    largest working set, and no update buffer of n - 2 and no buffer of n is alive through them (docs/benchmarks.md,
    "Each batch written before the next kernels"). n's directions travel while n - 1's updates are waited for
    and written; n - 1's updates while n runs its momentum stage. An item n that does not pause (a batch with no
    all-to-all in flight: its work is done in one segment) runs first instead, while n - 1's directions are still
    in flight (writes_first's `pauses`); with nothing in flight it is held, unstarted, until the next item that
    pauses has issued its directions (writes_first). The depth counts held items too: one forced to its end
    runs at once.
    A pure function of the items and their segment counts: every rank issues the same collectives in the same
    order. `order`: the order in which the items in flight advance (writes_first; tests plant others)."""
    window: deque[_Running] = deque()  # oldest first
    for item in items:
        window.append(_Running(item, start(item)))
        for running in order(window):
            if not running.finished:
                running.advance()
            # each finished item handed back at once, before the next segment runs
            while window and window[0].finished:
                yield window.popleft().finish()
        while window and (window[0].finished or len(window) >= depth):
            yield window.popleft().finish()
    while window:
        yield window.popleft().finish()
