"""Hypothesis profiles (HYPOTHESIS_PROFILE=dev | ci | thorough, and mutation for tests/mutation; ci is the default)
and shared fixtures."""

from __future__ import annotations

import os
from types import ModuleType

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

_COMMON = dict(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile("dev", max_examples=10, **_COMMON)
settings.register_profile(
    "ci", max_examples=40, derandomize=True, database=None, print_blob=True, **_COMMON
)
settings.register_profile("thorough", max_examples=500, print_blob=True, **_COMMON)
# tests/mutation/run.py: ci's examples, not shrunk (a mutant is killed by any failing example; shrinking one only
# makes its report shorter, and it can take longer than the whole test)
settings.register_profile(
    "mutation", parent=settings.get_profile("ci"), phases=(Phase.explicit, Phase.generate)
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Two cores: intra-op threads only add scheduling noise to these small matrices.
torch.set_num_threads(1)


def examples(fraction: float) -> int:
    """A per-test example count relative to the active profile (at least 1)."""
    return max(1, int(settings().max_examples * fraction))


def require(module: str, distribution: str, extra: str = "dev") -> ModuleType:
    """An optional package, imported; or a skip that names it: an environment condition (GPU nodes run the node's
    torch without reinstalling the extras), never a stand-in for a feature."""
    return pytest.importorskip(
        module, reason=f"{distribution} is not installed (pip install -e .[{extra}])"
    )


def quiet(*_: object) -> None:
    """A log that prints nothing (conformance.check's `log`)."""


def run_conformance(args: list[str]) -> tuple[int, str, str]:
    """`python -m muon_check ARGS` in this process: (exit status, stdout, stderr)."""
    import contextlib
    import io

    from muon_check.conformance import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), err.getvalue()


def pytest_configure(config: pytest.Config) -> None:
    """The muon_check fixture (muon_check/pytest_plugin.py), as a project's top-level conftest.py names it
    with `pytest_plugins` (this conftest is not the rootdir's, where that name is not read); and the check that a
    whole run of tests/dist took every path (tests/paths_exercised.py), and the failure log (tests/failure_log.py)."""
    import importlib

    plugin = importlib.import_module("muon_check.pytest_plugin")
    if not config.pluginmanager.is_registered(
        plugin
    ):  # named already (-p, or an older install's entry point)
        config.pluginmanager.register(plugin, "muon_check.pytest_plugin")
    for name in ("tests.paths_exercised", "tests.failure_log"):  # failure_log: $MUON_TEST_FAILURES
        module = importlib.import_module(name)
        if not config.pluginmanager.is_registered(module):
            config.pluginmanager.register(module, name)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test` runs TEST_JOBS workers on the same cores), each test's timeout (its marker's,
    or the ini's) is multiplied by the number of workers: a timeout here stops a hang, and a test that shares the
    cores with N - 1 others gets about 1/N of them. One process: the timeouts as written."""
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    if workers <= 1:
        return
    default = float(config.getoption("timeout", None) or config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        kwargs = dict(marker.kwargs) if marker is not None else {}
        seconds = (
            marker.args[0] if marker is not None and marker.args else kwargs.pop("timeout", default)
        )
        kwargs.pop("timeout", None)
        if seconds:
            # first among the item's own markers, so that it is the closest one pytest-timeout reads
            item.add_marker(pytest.mark.timeout(float(seconds) * workers, **kwargs), append=False)
