"""The check in users' own CI: the Python API (muon_check/api.py), the pytest plugin's `muon_check` fixture
(muon_check/pytest_plugin.py) and the command line's --audit and --invariance modes: bad input is a one-line
error naming the parameter; a candidate that departs from its claim fails the assertion with its diagnosis; the
plugin, named in a project's conftest, never skips a CUDA test on a machine without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from muon_check import api
from muon_check.adapters.shipped import TorchMuon
from tests.conftest import run_conformance

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(device="tpu"), "device must be one of"),
        (dict(world_sizes=(0,)), "world_sizes must be positive ints"),
        (dict(families=("tall", "nope")), "families ['nope'] are unknown"),
        (dict(dtypes=("float16",)), "dtypes ['float16'] are unknown"),
        (dict(distributed="zero3"), "distributed must be None"),
        (dict(claim="no-such-preset"), "claim preset 'no-such-preset' is unknown"),
        (dict(claim=3), "claim must be a preset name"),
        (dict(families=("even",)), "select no case of torch.optim.Muon"),
    ],
)
def test_bad_arguments_are_one_line_errors_naming_the_parameter(kwargs, named) -> None:
    """Each bad argument is refused before any rank starts, in one line naming it and the valid values."""
    claim = kwargs.pop("claim", None)
    with pytest.raises(ValueError) as e:
        api.check(TorchMuon, claim, **kwargs)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_a_candidate_that_is_not_an_optimizer_is_refused() -> None:
    """A candidate that is no optimizer class, adapter or spec string is a usage error, not a crash later."""
    with pytest.raises(ValueError, match="candidate must be an optimizer class"):
        api.check(42)


def test_a_conforming_candidate_passes_and_a_wrong_claim_fails_with_its_diagnosis() -> None:
    """torch.optim.Muon (an optimizer class, by import path) conforms to preset torch; claimed as keller (another
    learning-rate scale and momentum form) it departs, and assert_conforms says where."""
    good = api.check(
        torch.optim.Muon, "torch", families=("tall",), world_sizes=(1,), dtypes=("float32",)
    )
    good.assert_conforms()
    assert good.conforms and json.loads(good.json())["verdict"] == "conforms"
    bad = api.check(
        TorchMuon(), "keller", families=("tall",), world_sizes=(1,), dtypes=("float32",)
    )
    assert not bad.conforms and bad.verdict != "conforms"
    with pytest.raises(AssertionError) as e:
        bad.assert_conforms()
    text = str(e.value)
    assert "diagnosis:" in text and "tall W=1 float32: differs" in text, text


def test_a_setup_report_asserts_its_findings() -> None:
    """audit_setup: a clean setup passes assert_clean; a planted routing bug fails it with the finding's words."""
    clean = api.audit_setup("muon_check.adapters.setups:MuonWithAdamWSingle", world_size=1)
    clean.assert_clean()
    flat = api.audit_setup("muon_check.adapters.planted_setups:FlatParamRouting", world_size=2)
    with pytest.raises(AssertionError, match=r"finding \[silent fallback\]"):
        flat.assert_clean()
    with pytest.raises(ValueError, match="must be a muon_check.audit.Setup"):
        api.audit_setup(3)


@pytest.mark.parametrize(
    "argv, code, said",
    [
        (["--audit", "nocolon"], 2, "must be MODULE:NAME"),
        (
            ["--audit", "muon_check.adapters.shipped:TorchMuon"],
            2,
            "not a muon_check.audit.Setup",
        ),
        (["--audit", "no_such_module_x:Setup"], 3, "could not import the setup"),
        (["--audit", "a:b", "--invariance", "a:b"], 2, "each run alone"),
        (["--invariance", "a:b", "--micro-batches", "0"], 2, "--micro-batches must be >= 1, got 0"),
    ],
)
def test_the_setup_modes_refuse_bad_input_in_one_line(argv, code, said) -> None:
    """--audit / --invariance usage errors: exit 2 (3 for an import failure) with one line on stderr."""
    got, out, err = run_conformance(argv)
    assert got == code and said in err and err.count("\n") == 1, (got, out, err)


@pytest.mark.timeout(180)
def test_the_setup_modes_exit_by_their_findings() -> None:
    """--audit: 0 without a finding, 1 with; --invariance: 0 invariant, 1 when one breaks (named)."""
    code, out, _ = run_conformance(
        ["--audit", "muon_check.adapters.setups:MuonWithAdamWSingle", "--world-sizes", "1"]
    )
    assert code == 0 and "no finding" in out, out
    code, out, _ = run_conformance(
        [
            "--audit",
            "muon_check.adapters.planted_setups:GatedSplitAsQKV",
            "--world-sizes",
            "2",
        ]
    )
    assert code == 1 and "finding [wrong blocks] layers.1.attn.wgqkv.weight" in out, out
    code, out, _ = run_conformance(
        [
            "--invariance",
            "muon_check.adapters.planted_setups:NSPerMicroBatch",
            "--world-sizes",
            "1",
        ]
    )
    assert code == 1 and "verdict: breaks: gradient accumulation" in out, out


REWRITE_TEST = textwrap.dedent(
    """

    def test_the_package_is_not_rewritten():
        import importlib.util
        spec = importlib.util.find_spec("muon_dist.plan")
        assert type(spec.loader).__name__ != "AssertionRewritingHook"
    """
)
PLUGIN_TESTS = textwrap.dedent(
    """
    import pytest

    def test_cpu_by_default(muon_check):
        assert muon_check.device == "cpu"

    @pytest.mark.gpu
    def test_cuda_under_the_gpu_marker(muon_check):
        assert muon_check.device == "cuda"
    """
)


@pytest.mark.timeout(120)
def test_the_plugin_named_in_a_projects_conftest_gives_the_fixture_and_fails_cuda_without_a_gpu(
    tmp_path,
) -> None:
    """A project outside this repository names the plugin in its conftest.py: the fixture is there; on a machine
    without CUDA a gpu test that asks for the device fails naming --muon-device, never skips; and muon_dist's own
    asserts are not rewritten by pytest (the plugin is no entry point of the distribution)."""
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["muon_check.pytest_plugin"]\n')
    (tmp_path / "test_plugin_use.py").write_text(PLUGIN_TESTS + REWRITE_TEST)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=110,
    )
    out = run.stdout + run.stderr
    if torch.cuda.is_available():
        assert run.returncode == 0, out
    else:
        assert run.returncode == 1 and "2 passed, 1 error" in out, out
        assert "PytestUnknownMarkWarning" not in out, out  # the plugin registers the gpu marker
        assert "muon_check: device cuda, but torch.cuda.is_available() is False" in out, out
