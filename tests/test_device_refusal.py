"""A device the machine cannot run is refused in one line naming the flag, the device and the valid one, before any
rank starts: `verify --device cuda` and `--backend nccl`, `conformance --device cuda` (the planted suite too) and
RankPool.start, on a machine without CUDA (simulated by torch.cuda.is_available returning False, so the tests hold
on GPU nodes too). And `conformance --planted --device cuda` runs every case of the suite on that device."""

from __future__ import annotations

import pytest
import torch

from muon_check import conformance, launch, verify
from muon_check.adapters import controls


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def nothing_runs(monkeypatch):
    """A refusal must come before any rank starts or any case or run begins."""

    def ran(*args, **kwargs) -> None:
        raise AssertionError("ran before refusing the device")

    monkeypatch.setattr(launch.RankPool, "start", ran)
    monkeypatch.setattr(conformance, "check", ran)
    monkeypatch.setattr(conformance, "planted_suite", ran)
    monkeypatch.setattr(verify, "verify_world", ran)
    monkeypatch.setattr(verify, "torchrun_main", ran)


@pytest.mark.parametrize(
    "main, argv, flag",
    [
        (verify.main, ["--device", "cuda", "--world-sizes", "1"], "--device 'cuda'"),
        (verify.main, ["--backend", "nccl"], "--backend nccl needs CUDA: 'cuda'"),
        (conformance.main, ["--all", "--device", "cuda"], "--device 'cuda'"),
        (conformance.main, ["--planted", "--device", "cuda"], "--device 'cuda'"),
    ],
    ids=["verify", "verify-nccl", "conformance", "planted"],
)
def test_cuda_without_a_cuda_device_is_a_one_line_usage_error(
    no_cuda, nothing_runs, capsys, main, argv, flag
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: {flag} is not available here")
    assert "valid here: 'cpu'" in err and torch.__version__ in err
    assert "Traceback" not in captured.out + captured.err


def test_a_rank_pool_on_an_unavailable_device_starts_no_rank(no_cuda) -> None:
    pool = launch.RankPool(2, device="cuda")
    with pytest.raises(RuntimeError, match="RankPool device 'cuda' is not available here"):
        pool.start()
    assert pool.procs == [] and pool.conns == []


def test_the_devices_that_can_run_are_not_refused(monkeypatch) -> None:
    # the negative control of the refusals above: the same question answered None where the device can run
    assert launch.device_unavailable("cpu") is None
    assert launch.device_unavailable("tpu") == "'tpu' is not one of ('cpu', 'cuda')"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert launch.device_unavailable("cuda") is None


class _Checked(Exception):
    pass


@pytest.mark.parametrize("with_controls", [True, False], ids=["control", "planted"])
def test_the_planted_suite_runs_its_cases_on_the_device_it_is_given(
    monkeypatch, with_controls
) -> None:
    # the first case the suite checks: a correct control's, or (controls removed) a planted bug's
    seen: list[str] = []

    def check(*args, device: str = "cpu", **kwargs):
        seen.append(device)
        raise _Checked

    monkeypatch.setattr(conformance, "check", check)
    if not with_controls:
        monkeypatch.setattr(controls, "CONTROLS", ())
    with pytest.raises(_Checked):
        conformance.planted_suite(10.0, 1, log=lambda *_: None, device="cuda")
    assert seen == ["cuda"]
