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
import ctypes
import gc
import os
import statistics
import sys
import threading
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


# ------------------------------------------------------------------------------- what is alive at the peak
#
# peak_sites reads the same profiler run with Python stacks on (with_stack) and walks its event tree
# (experimental_event_tree: each allocation and free under the op and Python frames that made it). Replaying a
# measured run's allocations and frees in time order gives the peak (the same reading as peak_extra_bytes) and the
# blocks alive at that moment; each is named by the site that allocated it (site_label). Blocks allocated before
# the run that it frees by then count as one negative line (EARLIER), blocks freed on a thread the profiler does
# not see as one more (UNSEEN, where their address is allocated again), so the lines sum to the peak exactly.

EARLIER = "(blocks from before the run, freed by its peak)"
UNSEEN = "(blocks freed unseen, on another thread)"
# Python frames in these parts of torch are the machinery under a call (DTensor's dispatch, the ops' and the
# profiler's wrappers), not its site; torch.optim's own optimizers are sites
_TORCH, _TORCH_SITES = "torch/", ("torch/optim/",)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _short(path: str) -> str:
    """A frame's file as the profiler names it (relative to its entry of sys.path), or an absolute one relative to
    the checkout or to site-packages where it lies under them."""
    if not os.path.isabs(path):
        return path
    if path.startswith(_ROOT + os.sep):
        return path[len(_ROOT) + 1 :]
    marker = "site-packages" + os.sep
    return path.split(marker, 1)[1] if marker in path else path


def site_label(op: str | None, frames: list[str], depth: int = 3) -> str:
    """The site of an allocation: the innermost op that made it and up to `depth` of the innermost Python frames
    around it that are not torch's machinery (_TORCH_SITES aside), each as "file:line (function)", the line of
    the function's def (the profiler records a Python call by its code object)."""
    kept = []
    for frame in frames:  # innermost first, each "path(line): function"
        path, _, rest = frame.partition("(")
        line, _, function = rest.partition("): ")
        path = _short(path)
        if path.startswith(_TORCH) and not path.startswith(_TORCH_SITES):
            continue
        kept.append(f"{path}:{line} ({function})")
        if len(kept) == depth:
            break
    return f"{op or '?'} @ {' < '.join(kept) or '?'}"


def peak_sites(
    call: Callable[[], object],
    prepare: Callable[[int], object],
    label: Callable[[str | None, list[str]], str] = site_label,
) -> tuple[int, dict[str, int]]:
    """(peak, sites) of run 1 of `call` (run 0 unmeasured, prepare(k) before run k, garbage settled: as
    peak_extra_bytes): the run's peak extra bytes and the bytes alive at that peak by the site that allocated
    them (label(op, Python frames innermost first)), with EARLIER for the blocks from before the run that it had
    freed by then (negative) and UNSEEN for blocks whose address was allocated again before their free was seen
    (freed on another thread: the running sum, so the peak, still holds them). The values sum to the peak; peak
    0 (no block ever above the run's start) gives no sites. The profiler's view: the thread that runs `call`
    only."""
    from torch._C._profiler import _EventType

    with (
        _quiet_stderr(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof,
    ):
        for k in range(2):
            prepare(k)
            with _settled(), record_function(f"{MARK}{k}"):
                call()
    tree, nodes = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        tree.append(node)
    (run,) = [n for n in tree if n.typed[0] == _EventType.TorchOp and n.name == f"{MARK}1"]
    allocations = [
        (node.start_time_ns, i, node.typed[1].ptr, node.typed[1].alloc_size, node)
        for i, node in enumerate(tree)
        if node.typed[0] == _EventType.Allocation
        and run.start_time_ns <= node.start_time_ns <= run.end_time_ns
    ]
    allocations.sort(key=lambda a: a[:2])
    return replay([(ptr, size, node) for _, _, ptr, size, node in allocations], _site_of(label))


def _site_of(label: Callable[[str | None, list[str]], str]) -> Callable[[object], str]:
    """An allocation node's label: its innermost op and its Python frames (innermost first), given to `label`."""
    from torch._C._profiler import _EventType

    def site(node: object) -> str:
        op, frames, parent = None, [], node.parent  # type: ignore[attr-defined]
        while parent is not None:
            kind = parent.typed[0]
            if kind == _EventType.TorchOp and op is None:
                op = parent.name
            elif kind == _EventType.PyCall:
                frames.append(parent.name)
            parent = parent.parent
        return label(op, frames)

    return site


def replay(
    events: list[tuple[int, int, object]], site: Callable[[object], str] = str
) -> tuple[int, dict[str, int]]:
    """A run's allocator events in time order, each (address, bytes: + allocated, - freed, what made it), replayed:
    (peak, sites) as peak_sites returns them. The peak is the first maximum of the running sum over the run's
    start (0 if it never rises above it). At that event, each block allocated in the run and not yet freed counts
    for site(its allocation); a free of an address the run did not allocate counts for EARLIER (a block from before
    the run); an address allocated again before its free was seen counts its first block for UNSEEN (freed on a
    thread the profiler does not see: the running sum still holds it). So the sites sum to the peak."""
    running = peak = 0
    at_peak = -1
    for i, (_, size, _) in enumerate(events):
        running += size
        if running > peak:
            peak, at_peak = running, i
    alive: dict[int, tuple[int, object]] = {}
    sites: dict[str, int] = {}
    for ptr, size, what in events[: at_peak + 1]:
        if size > 0:
            if ptr in alive:
                sites[UNSEEN] = sites.get(UNSEEN, 0) + alive[ptr][0]
            alive[ptr] = (size, what)
        elif ptr in alive:
            del alive[ptr]
        else:
            sites[EARLIER] = sites.get(EARLIER, 0) + size
    for size, what in alive.values():
        name = site(what)
        sites[name] = sites.get(name, 0) + size
    return peak, sites


# ------------------------------------------------------------------------------- resident memory, every thread
#
# The profiler above reports the allocations and frees of the thread that runs it only: a tensor freed (or
# allocated) on a collective's worker thread goes unseen, and a method with such tensors reads otherwise from step
# to step (torch.optim.Muon on DTensors over gloo). resident_peak_extra_bytes reads the process's resident memory
# instead (Linux: /proc/self/status VmHWM, the high-water mark that writing "5" to /proc/self/clear_refs resets to
# the current VmRSS), which counts every thread's pages. It needs a process started with glibc's mmap threshold
# fixed (RESIDENT_ENV): every block of 64 KiB or more is then mapped when allocated and unmapped when freed, so
# resident memory follows the live large blocks rather than the allocator's free lists; malloc_trim(0) before each
# run gives back the pages of smaller freed chunks. The kernel counts resident pages in per-thread batches of up to
# 64 pages, so a reading is good to a few hundred KiB (RESIDENT_TOLERANCE_BYTES, validate_resident).

RESIDENT_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 16)}
RESIDENT_TOLERANCE_BYTES = 512 << 10


def resident_unavailable() -> str | None:
    """None where resident_peak_extra_bytes can run in this process, else why not."""
    if not sys.platform.startswith("linux"):
        return f"resident peaks need Linux's /proc (platform {sys.platform})"
    missing = {k: v for k, v in RESIDENT_ENV.items() if os.environ.get(k) != v}
    if missing:
        return f"resident peaks need a process started with {missing} in its environment"
    if getattr(ctypes.CDLL(None), "malloc_trim", None) is None:
        return "resident peaks need glibc's malloc_trim"
    try:
        _reset_high_water()
        _resident()
    except OSError as error:
        return f"resident peaks need /proc/self/clear_refs and /proc/self/status: {error}"
    return None


def _reset_high_water() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _resident() -> tuple[int, int]:
    """(VmHWM, VmRSS) in bytes."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmHWM"], fields["VmRSS"]


def resident_peak_extra_bytes(
    call: Callable[[], object], prepare: Callable[[int], object], repeats: int, warmup: int = 1
) -> list[int]:
    """The peak extra resident bytes, every thread's, of runs warmup..warmup + repeats - 1 of `call` (the first
    `warmup` unmeasured): the high-water mark during the run over the resident memory at its start, garbage
    settled as in peak_extra_bytes. prepare(k) runs before run k, outside the reading."""
    why_not = resident_unavailable()
    if why_not:
        raise RuntimeError(why_not)
    trim = ctypes.CDLL(None).malloc_trim
    peaks = []
    for k in range(warmup + repeats):
        prepare(k)
        with _settled():
            trim(0)
            _reset_high_water()
            start = _resident()[1]
            call()
            high = _resident()[0]
        if k >= warmup:
            peaks.append(max(0, high - start))
    return peaks


THREADED_PEAK = 6 << 20


def _threaded_pattern() -> None:
    """Each run holds 4 MiB while another thread allocates, fills and frees 2 MiB, then 1 MiB more: a peak of
    THREADED_PEAK, 2 MiB of it on the other thread."""
    held = torch.ones(1 << 20)
    worker = threading.Thread(target=lambda: torch.ones(1 << 19).sum())
    worker.start()
    worker.join()
    more = torch.ones(1 << 18)
    del held, more


def threaded_readings(
    reader: Callable[[Callable[[], object], Callable[[int], object], int], list[int]],
) -> list[int]:
    """A peak reader's readings of three runs of _threaded_pattern; raises unless each lies within
    RESIDENT_TOLERANCE_BYTES of THREADED_PEAK (the profiler's peak_extra_bytes reads 5 MiB: it does not see the
    other thread)."""
    peaks = reader(_threaded_pattern, lambda k: None, 3)
    if any(abs(p - THREADED_PEAK) > RESIDENT_TOLERANCE_BYTES for p in peaks):
        raise RuntimeError(
            f"read {peaks} B on a pattern whose peak is {THREADED_PEAK} B, 2 MiB of it on a second thread"
        )
    return peaks


def validate_resident() -> int:
    """resident_peak_extra_bytes on the threaded pattern (threaded_readings): the median reading."""
    return int(statistics.median(threaded_readings(resident_peak_extra_bytes)))


@contextlib.contextmanager
def resident_environment() -> Iterator[None]:
    """RESIDENT_ENV in os.environ for the block (processes spawned in it start with it), then as it was."""
    saved = {k: os.environ.get(k) for k in RESIDENT_ENV}
    os.environ.update(RESIDENT_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
