"""The suite's own plugins, each in a fresh pytest or in this run: tests/paths_exercised.py, the check that a whole
run of tests/dist took every path of muon_dist.paths.PATHS, on a small suite of its own: a path no test took fails
the run and is named, in one process and under pytest-xdist, where the paths the workers took are merged in the
controller (each worker records a path named after itself, so only the union of two workers has both); and
tests/conftest.py's timeouts under xdist."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = """from pathlib import Path
from tests import paths_exercised
paths_exercised.WATCHED = Path(__file__).resolve().parent / "watched"
paths_exercised.required = lambda: {required!r}
"""
TEST = """import os
from tests import paths_exercised

def test_records_its_worker():
    paths_exercised.record([{"paths": [(0, os.environ.get("PYTEST_XDIST_WORKER", "gw0"))]}])
"""


def run(tmp_path: Path, required: set[str], *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST.format(required=required))
    (tmp_path / "watched").mkdir(exist_ok=True)
    (tmp_path / "watched" / "test_paths.py").write_text(TEST)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "tests.paths_exercised",
    ]
    return subprocess.run(
        [*cmd, *args, "."], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.timeout(240)
def test_a_path_no_test_took_fails_a_whole_run_and_is_named(tmp_path: Path) -> None:
    """In one process: a whole run that took every required path exits 0; one required path no test took makes it
    exit 1 with that path named (the negative control)."""
    assert run(tmp_path, {"gw0"}).returncode == 0
    proc = run(tmp_path, {"gw0", "gw1"})
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "paths never exercised by watched: ['gw1']" in proc.stdout


@pytest.mark.timeout(240)
def test_under_xdist_the_controller_checks_the_union_of_the_workers_paths(tmp_path: Path) -> None:
    """On two workers (`--dist each`, each recording a path named after itself): the controller checks the union,
    so a run that needs both workers' paths exits 0, and one that needs a path neither took exits 1 naming it."""
    pytest.importorskip("xdist", reason="pytest-xdist is not installed (pip install -e .[dev])")
    both = run(tmp_path, {"gw0", "gw1"}, "-n", "2", "--dist", "each")
    assert both.returncode == 0, both.stdout[-2000:] + both.stderr[-2000:]
    # the negative control: a path neither worker took fails the run there too (a controller that merged nothing
    # would check nothing and pass)
    three = run(tmp_path, {"gw0", "gw1", "gw2"}, "-n", "2", "--dist", "each")
    assert three.returncode == 1, three.stdout[-2000:]
    assert "paths never exercised by watched: ['gw2']" in three.stdout


@pytest.mark.timeout(7)
def test_under_xdist_a_tests_timeout_is_its_own_times_the_workers(request) -> None:
    """tests/conftest.py: the timeout pytest-timeout applies (the closest marker) is the test's own, multiplied by
    the number of pytest-xdist workers when the suite runs under xdist (`make test`), as written in one process."""
    workers = int(getattr(request.config, "workerinput", {}).get("workercount", 1))
    marker = request.node.get_closest_marker("timeout")
    assert marker.args[0] == 7 * workers
