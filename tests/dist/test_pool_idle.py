"""RankPool(idle_s=): a call whose unanswered ranks use no CPU for idle_s seconds is reported hung long before its
timeout (ranks blocked in a collective that a peer never joins), and a rank that computes is never reported hung."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from muon_check.launch import RankFailure, RankPool


def blocked_or_busy(how: str, seconds: float) -> int:
    """Rank 0 all-reduces; rank 1 never joins it ("blocked": both end up waiting, rank 1 at a barrier of its own
    group) or computes for `seconds` before joining ("busy")."""
    side = dist.new_group(backend="gloo")
    if dist.get_rank() == 1:
        if how == "blocked":
            dist.barrier(group=side)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            torch.ones(64, 64).matmul(torch.ones(64, 64))
    dist.all_reduce(torch.ones(1))
    return dist.get_rank()


@pytest.mark.timeout(60)
def test_ranks_blocked_in_a_collective_are_reported_hung_after_idle_s_not_the_timeout() -> None:
    pool = RankPool(2, idle_s=1.0)
    try:
        start = time.monotonic()
        with pytest.raises(RankFailure, match="no CPU used for 1.0 s") as failure:
            pool.run(blocked_or_busy, "blocked", 0.0, timeout=40)
        assert failure.value.hung == {0, 1} and time.monotonic() - start < 15
    finally:
        pool.close()


@pytest.mark.timeout(60)
def test_a_rank_that_computes_longer_than_idle_s_is_not_reported_hung() -> None:
    pool = RankPool(2, idle_s=1.0)
    try:
        assert pool.run(blocked_or_busy, "busy", 3.0, timeout=40) == [0, 1]
    finally:
        pool.close()


def _simulated(monkeypatch: pytest.MonkeyPatch, waiting: bool) -> bool:
    """Whether _Progress calls a process stalled after 5 s of samples without CPU ticks, each sample reporting
    `waiting` (a rank waiting for the CPU or the disk), on a simulated clock."""
    from muon_check import launch

    clock = [0.0]
    monkeypatch.setattr(launch.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(launch, "_activity", lambda pids: (100, waiting))
    progress = launch._Progress(idle_s=2.0)
    for _ in range(50):
        if progress.stalled([1234], 2.0):
            return True
        clock[0] += 0.1
    return False


def test_a_rank_waiting_for_the_cpu_or_the_disk_is_not_reported_hung(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # an fsync of a checkpoint on a busy disk uses no CPU for seconds: state D is work, not a hang
    assert not _simulated(monkeypatch, waiting=True)
    # negative control: the same samples without the disk wait are a hang
    assert _simulated(monkeypatch, waiting=False)


def test_activity_reads_this_process_from_proc() -> None:
    import os

    from muon_check.launch import _activity

    sum(range(10**6))  # some CPU time of its own
    ticks, waiting = _activity([os.getpid()])
    assert ticks > 0 and isinstance(waiting, bool)
