"""A pytest plugin (tests/conftest.py registers it): with $MUON_TEST_FAILURES naming a file, each failed test's report is
appended to it as the failure happens, not at the session's end, so a run stopped by its time limit (a GPU node's
lease, tests/gpu/run_all.py) still says what failed and why. Under pytest-xdist the controller writes (a worker's
report reaches it too), the workers do not (told by their config, not by the environment, which a pytest started
inside a worker inherits)."""

from __future__ import annotations

import os

FAILURES_ENV = "MUON_TEST_FAILURES"


_WORKER = False  # this process is a pytest-xdist worker (its config has workerinput)


def pytest_configure(config) -> None:
    global _WORKER
    _WORKER = hasattr(config, "workerinput")


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get(FAILURES_ENV)
    if not path or not report.failed or _WORKER:
        return
    with open(path, "a") as f:
        f.write(f"=== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
