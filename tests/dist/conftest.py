"""Fixtures of the distributed suite: one RankPool per world size for the session, and a check that every
path was exercised (the suite fails when a full run of tests/dist never took some path)."""

from __future__ import annotations

from pathlib import Path

from muon_dist.paths import PATHS

from muon_check.launch import RankPool

EXERCISED: set[str] = set()
_POOLS: dict[int, RankPool] = {}


def get_pool(world_size: int) -> RankPool:
    if world_size not in _POOLS:
        _POOLS[world_size] = RankPool(world_size)
    return _POOLS[world_size]


def record_paths(reports: list) -> None:
    """Note every path a step took (from the ranks' last_report paths)."""
    for report in reports:
        EXERCISED.update(p for _, p in report["paths"] if p)


_STATE = {"deselected": 0, "dist_items": 0}


def pytest_deselected(items):
    _STATE["deselected"] += sum("tests/dist" in str(i.fspath) for i in items)


def pytest_collection_modifyitems(session, config, items):
    _STATE["dist_items"] = sum("tests/dist" in str(i.fspath) for i in items)


def _whole_suite(config) -> bool:
    """True when the run named tests/dist (or a folder above it) as a whole, not single files or tests."""
    here = Path(__file__).parent.resolve()
    for arg in config.args or ["."]:
        path = (Path(config.invocation_params.dir) / arg.split("::")[0]).resolve()
        if path.is_dir() and (path == here or path in here.parents):
            return True
    return False


def pytest_sessionfinish(session, exitstatus):
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
    config = session.config
    full_run = (_STATE["dist_items"] > 0 and _STATE["deselected"] == 0 and not config.option.keyword
                and not config.option.collectonly and _whole_suite(config))
    missing = set(PATHS) - EXERCISED
    if full_run and exitstatus == 0 and missing:
        config.get_terminal_writer().line(f"\nmuon_dist: paths never exercised by tests/dist: {sorted(missing)}", red=True)
        session.exitstatus = 1
