"""Fixtures of the distributed suite: one RankPool per world size for the session (per process: each pytest-xdist
worker has its own), and record_paths, which feeds the check that a whole run of tests/dist took every path
(tests/paths_exercised.py)."""

from __future__ import annotations

from muon_check.launch import RankPool
from tests import paths_exercised

_POOLS: dict[int, RankPool] = {}


def get_pool(world_size: int) -> RankPool:
    if world_size not in _POOLS:
        _POOLS[world_size] = RankPool(world_size)
    return _POOLS[world_size]


def record_paths(reports: list) -> None:
    """Note every path a step took (from the ranks' last_report paths)."""
    paths_exercised.record(reports)


def pytest_sessionfinish(session, exitstatus):
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
