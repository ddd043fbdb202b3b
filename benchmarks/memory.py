"""Peak extra memory of a repeated call on CPU, from torch.profiler's memory events.

With profile_memory=True, c10's CPU allocator reports each allocation (+bytes) made while a profiler runs and
each free (-bytes) of a block it saw allocated; the free of a block allocated before is not reported (it warns
"Memory block of unknown size"). So `call` runs 1 + repeats times under one profiler, each run inside a
record_function range, and only the runs after the first are measured: every block a measured run frees (the
momentum buffers and params of the previous step) was allocated under the profiler, and its free is seen.
A run's peak extra memory = max over the run of (running sum of the reported bytes) - (the sum at its start).
Not seen: memory outside c10's allocator (gloo's own transport buffers, Python objects). validate() checks the
method on known allocation patterns.

Garbage: Python's cyclic collector runs whenever its allocation counts cross a threshold, so it may run inside a
measured run and free there blocks that reference cycles kept from before it (a DTensor gradient replaced before
the step is such a block); the run then reads lower by their size, by chance. So each measured run starts after a
collection and runs with the collector off (settle_garbage): it reads what the call holds by reference counting,
the same in every run.
"""

from __future__ import annotations

import contextlib
import gc
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
    call: Callable[[], object],
    prepare: Callable[[int], object],
    repeats: int,
    settle_garbage: bool = True,
) -> list[int]:
    """The peak extra bytes of runs 1..repeats of `call` (run 0 is unmeasured); prepare(k) runs before run k,
    outside the measured range (setting a step's gradients). settle_garbage (module docstring): a collection
    after prepare, and the cyclic collector off during the run (as it was, after); False only to show what a
    collection inside a run does to the reading."""
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for k in range(repeats + 1):
            prepare(k)
            with _settled() if settle_garbage else contextlib.nullcontext():
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


@contextlib.contextmanager
def _settled() -> Iterator[None]:
    """Garbage collected now, and the cyclic collector off until the block ends (then as it was)."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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


def _garbage(k: int) -> None:
    """A prepare step that leaves a 12,000 B block in a reference cycle: garbage that only the cyclic collector
    frees."""
    cycle: list[object] = [torch.empty(3000)]
    cycle.append(cycle)


def _pattern_after_a_collection() -> None:
    """_known_pattern, after the collection that an allocation threshold would start there if the collector
    is on (gc.collect() only where gc.isenabled(): deterministic, where the threshold is not). With the garbage
    of _garbage freed inside the run, a run reads 12,000 B less: 0 B."""
    if gc.isenabled():
        gc.collect()
    _known_pattern()


def validate(settle_garbage: bool = True) -> int:
    """The method on the known pattern, alone and after garbage that a collection inside the run would free;
    raises if it reads anything but 6,000 B."""
    peaks = []
    for call, prepare in ((_known_pattern, None), (_pattern_after_a_collection, _garbage)):
        _held.append(
            torch.empty(1000)
        )  # allocated before the profiler: run 0 frees it unseen, unmeasured
        peaks += peak_extra_bytes(
            call, prepare or (lambda k: None), repeats=2, settle_garbage=settle_garbage
        )
        _held.clear()
    if peaks != [6_000] * 4:
        raise RuntimeError(
            f"peak_extra_bytes read {peaks} B on patterns whose peak is 6,000 B: not reliable here"
        )
    return peaks[0]
