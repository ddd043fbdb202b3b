"""A pytest plugin (tests/conftest.py registers it): a run of the whole distributed suite (tests/dist, or a folder
above it, nothing deselected in it, no -k) that passes must have taken every path of muon_dist.paths.PATHS at least
once; a path no test took fails the run and is named.

The paths a step took are recorded by `record` (tests/dist/conftest.py's record_paths, from the ranks' last_report).
Under pytest-xdist each worker runs part of the suite: a worker hands what it recorded and collected to the
controller in its workeroutput, the controller merges every worker's (pytest_testnodedown) and decides, so the
check sees the union of the workers' paths, as a run in one process does.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pytest

# what the check watches (a test of this plugin points it, and `required`, elsewhere)
WATCHED = Path(__file__).resolve().parent / "dist"


def required() -> set[str]:
    """The paths a whole run of WATCHED must take."""
    from muon_dist.paths import PATHS

    return set(PATHS)


OUTPUT_KEY = "muon_paths_exercised"

EXERCISED: set[str] = set()
STATE = {"deselected": 0, "collected": 0}


def record(reports: Iterable[dict]) -> None:
    """Note every path a step took (from the ranks' last_report paths)."""
    for report in reports:
        EXERCISED.update(p for _, p in report["paths"] if p)


def _watched(path: object) -> bool:
    return WATCHED in Path(str(path)).resolve().parents


def pytest_deselected(items) -> None:
    """Count the deselected tests of WATCHED (a run with any is not a whole run)."""
    STATE["deselected"] += sum(_watched(i.fspath) for i in items)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items) -> None:
    """Count the collected tests of WATCHED (none: the check does not apply)."""
    STATE["collected"] = sum(_watched(i.fspath) for i in items)


def _whole_suite(config: pytest.Config) -> bool:
    """True when the run named WATCHED (or a folder above it) as a whole, not single files or tests."""
    for arg in config.args or ["."]:
        path = (Path(config.invocation_params.dir) / arg.split("::")[0]).resolve()
        if path.is_dir() and (path == WATCHED or path in WATCHED.parents):
            return True
    return False


def missing(config: pytest.Config) -> list[str]:
    """The required paths no test took, where the run is one the check applies to (else [])."""
    full_run = (
        STATE["collected"] > 0
        and STATE["deselected"] == 0
        and not config.option.keyword
        and not config.option.collectonly
        and _whole_suite(config)
    )
    return sorted(required() - EXERCISED) if full_run else []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """Controller, pytest-xdist: merge a finished worker's paths and counts (every worker collects the whole run, so
    the counts are the largest any worker saw)."""
    out = getattr(node, "workeroutput", {}).get(OUTPUT_KEY)
    if out is None:
        return
    EXERCISED.update(out["exercised"])
    for key in STATE:
        STATE[key] = max(STATE[key], out[key])


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A worker hands its paths and counts to the controller; the controller (or the one process) fails a passing
    whole run that missed a required path, naming it."""
    config = session.config
    if hasattr(config, "workerinput"):  # an xdist worker: the controller decides
        config.workeroutput[OUTPUT_KEY] = {"exercised": sorted(EXERCISED), **STATE}
        return
    absent = missing(config)
    if exitstatus == 0 and absent:
        config.get_terminal_writer().line(
            f"\nmuon_dist: paths never exercised by {WATCHED.name}: {absent}", red=True
        )
        session.exitstatus = 1
