"""Peak extra memory of a repeated call on CPU, from torch.profiler's memory events.

With profile_memory=True, c10's CPU allocator reports each allocation (+bytes) made while a profiler runs and
each free (-bytes) of a block it saw allocated; the free of a block allocated before is not reported (it warns
"Memory block of unknown size"). So `call` runs 1 + repeats times under one profiler, each run inside a
record_function range, and only the runs after the first are measured: every block a measured run frees (the
momentum buffers and params of the previous step) was allocated under the profiler, and its free is seen.
A run's peak extra memory = max over the run of (running sum of the reported bytes) - (the sum at its start).
Not seen: memory outside c10's allocator (gloo's own transport buffers, Python objects). validate() checks the
method on a known allocation pattern.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

MARK = "benchmarks.memory run "


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Kineto writes a line to fd 2 at every start and stop, and the allocator warns about pre-existing blocks."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def peak_extra_bytes(
    call: Callable[[], object], prepare: Callable[[int], object], repeats: int
) -> list[int]:
    """The peak extra bytes of runs 1..repeats of `call` (run 0 is unmeasured); prepare(k) runs before run k,
    outside the measured range (setting a step's gradients)."""
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for k in range(repeats + 1):
            prepare(k)
            with record_function(f"{MARK}{k}"):
                call()
    events = prof.profiler.kineto_results.events()
    ranges = {
        int(e.name()[len(MARK) :]): (e.start_ns(), e.end_ns())
        for e in events
        if e.name().startswith(MARK)
    }
    memory = sorted(
        (e.start_ns(), i, e.nbytes()) for i, e in enumerate(events) if e.name() == "[memory]"
    )
    return [_peak_in(memory, *ranges[k]) for k in range(1, repeats + 1)]


def _peak_in(memory: list[tuple[int, int, int]], start: int, end: int) -> int:
    running = peak = 0
    for _, _, nbytes in (m for m in memory if start <= m[0] <= end):
        running += nbytes
        peak = max(peak, running)
    return peak


_held: list[torch.Tensor] = []


def _known_pattern() -> None:
    """Relative to its start, each run: -4,000 (the previous run's block), +8,000, +2,000 (peak 6,000), -10,000,
    +4,000 (kept for the next run). A method blind to the first free would read 10,000."""
    _held.clear()
    a = torch.empty(2000)
    b = torch.empty(500)
    del a, b
    _held.append(torch.empty(1000))


def validate() -> int:
    """The method on the known pattern; raises if it reads anything but 6,000 B."""
    _held.append(
        torch.empty(1000)
    )  # allocated before the profiler: run 0 frees it unseen, unmeasured
    peaks = peak_extra_bytes(_known_pattern, lambda k: None, repeats=2)
    if peaks != [6_000, 6_000]:
        raise RuntimeError(
            f"peak_extra_bytes read {peaks} B on a pattern whose peak is 6,000 B: not reliable here"
        )
    return peaks[0]
