"""The rank pool turns a raising or hung rank into a test failure, then restarts cleanly."""

from __future__ import annotations

import time

import pytest

from muon_dist.launch import RankFailure, RankPool
from .workers import fail_on


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["raise", "hang"])
def test_a_failing_or_hung_rank_fails_the_call_and_the_next_call_gets_a_fresh_pool(how: str) -> None:
    pool = RankPool(3)
    try:
        start = time.monotonic()
        with pytest.raises(RankFailure, match="deliberate failure" if how == "raise" else "no answer"):
            pool.run(fail_on, 1, how, timeout=3)
        assert time.monotonic() - start < 10 and not pool.procs
        assert pool.run(fail_on, -1, how, timeout=30) == [0, 1, 2]
    finally:
        pool.close()
