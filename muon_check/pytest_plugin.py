"""A pytest plugin: keep "our Muon conforms to muon_ref under preset P" as a test in a project's own suite.

Named in a project's top-level conftest.py, `pytest_plugins = ["muon_check.pytest_plugin"]` (or `pytest -p
muon_check.pytest_plugin`). It is not registered as a pytest11 entry point on purpose: pytest rewrites the
asserts of every module of a distribution that provides one, which would change muon_ref's and muon_dist's own
assertions (their messages, and their modules' loaders) in every test run of a project that installs muon-ref. It
adds the `muon_check` fixture and the `--muon-device` option:

    def test_our_muon_conforms(muon_check):
        muon_check.assert_conforms(OurMuon, claim="keller", families=("tall", "square"), world_sizes=(1,))

    @pytest.mark.gpu
    def test_our_muon_conforms_on_cuda(muon_check):   # device "cuda" under the gpu marker
        muon_check.assert_conforms(OurMuon, claim="keller", world_sizes=(1,))

`muon_check.check(...)`, `.audit_setup(...)` and `.setup_invariance(...)` return the reports of
muon_check.api; `.assert_conforms(...)`, `.assert_audit_clean(...)` and `.assert_invariant(...)` fail the
test with the report's summary. The device is `--muon-device` (cpu or cuda) when given, else "cuda" for a test
marked `gpu` and "cpu" otherwise; a test on "cuda" without a CUDA device fails, naming the option (never skips).
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_addoption(parser: Any) -> None:
    parser.addoption(
        "--muon-device",
        choices=("cpu", "cuda"),
        default=None,
        help="device of the muon_check fixture's checks (default: cuda for tests marked gpu, else cpu)",
    )


def pytest_configure(config: Any) -> None:
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU (the muon_check fixture then runs on cuda)"
    )


class MuonCheck:
    """The fixture's value: the API's checks on the test's device, and their assertions."""

    def __init__(self, device: str) -> None:
        self.device = device

    def check(self, candidate: Any, claim: Any = None, **kwargs: Any) -> Any:
        from muon_check.api import check

        kwargs.setdefault("device", self.device)
        return check(candidate, claim, **kwargs)

    def assert_conforms(self, candidate: Any, claim: Any = None, **kwargs: Any) -> Any:
        return _passing(self.check(candidate, claim, **kwargs), "conforms")

    def audit_setup(self, setup: Any, **kwargs: Any) -> Any:
        from muon_check.api import audit_setup

        return audit_setup(setup, **kwargs)

    def assert_audit_clean(self, setup: Any, **kwargs: Any) -> Any:
        return _passing(self.audit_setup(setup, **kwargs), "clean")

    def setup_invariance(self, setup: Any, **kwargs: Any) -> Any:
        from muon_check.api import setup_invariance

        return setup_invariance(setup, **kwargs)

    def assert_invariant(self, setup: Any, **kwargs: Any) -> Any:
        return _passing(self.setup_invariance(setup, **kwargs), "clean")


def _passing(report: Any, verdict: str) -> Any:
    """The report, or the test failed with its summary where `report.<verdict>` is false."""
    if not getattr(report, verdict):
        pytest.fail(report.summary(), pytrace=False)
    return report


@pytest.fixture
def muon_check(request: Any) -> MuonCheck:
    device = request.config.getoption("--muon-device", default=None)
    if device is None:
        device = "cuda" if request.node.get_closest_marker("gpu") else "cpu"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.fail(
                "muon_check: device cuda, but torch.cuda.is_available() is False (run with --muon-device "
                "cpu, or on a GPU node)",
                pytrace=False,
            )
    return MuonCheck(device)
