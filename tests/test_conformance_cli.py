"""`python -m muon_check` on single-device adapters: muon_ref behind the adapter conforms (exit 0);
a Muon with the wrong momentum style fails (exit 1) and is diagnosed as a convention, with the option named."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
import torch

import muon_ref
from muon_check import conformance
from muon_check.adapters import Adapter, ImportPath, load_adapter
from muon_check.adapters.cases import Case, in_family, smaller
from muon_check.adapters.shipped import Reference
from tests.conftest import require

FAST = ["--families", "tall", "square", "row", "experts3d", "--shrink-budget", "10"]


class SumMomentum(Adapter):
    """Claims the torch preset, but keeps Moonlight's momentum: M = mu*M + G, Nesterov G + mu*M."""

    name, preset = "sum-momentum", "torch"

    def build(self, params: list[torch.Tensor], **hp: Any) -> torch.optim.Optimizer:
        return muon_ref.Muon(
            params, preset="torch", momentum_style="sum", nesterov_form="add_alpha", **hp
        )


@pytest.mark.timeout(60)
def test_reference_behind_the_adapter_conforms_and_exits_zero(tmp_path) -> None:
    out = tmp_path / "report.json"
    assert (
        conformance.main(
            ["--adapter", "muon_check.adapters.shipped:Reference", *FAST, "--json", str(out)]
        )
        == 0
    )
    payload = json.loads(out.read_text())
    (report,) = payload["reports"]
    origin = payload["provenance"]
    assert payload["partial"] is False and report["partial"] is False
    assert origin["torch"] == torch.__version__ and origin["project"].startswith("muon-ref ")
    assert origin["cpu_capability"] and "--json" in origin["command"] and origin["seed"] == 0
    assert report["verdict"] == "conforms" and report["seed"] == 0
    assert report["conforms"] and report["diagnosis"].startswith("conforms")
    assert {o["family"] for o in report["outcomes"]} == {"tall", "square", "row", "experts3d"}
    assert all(o["status"] == "bitwise" and o["max_diff"] == 0 for o in report["outcomes"])


@pytest.mark.timeout(60)
def test_wrong_momentum_style_is_diagnosed_as_that_convention(tmp_path) -> None:
    out = tmp_path / "report.json"
    code = conformance.main(
        ["--adapter", f"{__name__}:SumMomentum", *FAST, "--dtypes", "float32", "--json", str(out)]
    )
    (report,) = json.loads(out.read_text())["reports"]
    assert code == 1 and not report["conforms"] and report["verdict"] == "departs"
    assert report["diagnosis"] == (
        "convention: matches claimed preset 'torch' with momentum_style='sum', "
        "nesterov_form='add_alpha'"
    ), report["diagnosis"]
    first = report["outcomes"][0]
    assert first["status"] == "differs" and first["first_step"] == 1 and first["max_diff"] > 0
    # shrunk to one step (the departure shows at step 1), keeping the failure kind
    assert all(
        s["status"] == "differs" and s["to"].endswith(" 1 steps")
        for s in report["minimal_failing_cases"]
    )


@pytest.mark.timeout(30)
def test_an_optimizer_class_by_import_path_is_wrapped_with_its_claim() -> None:
    require("muon", "muon-optimizer")
    adapter = load_adapter("muon:SingleDeviceMuon", preset="keller", hp_names={"nesterov": None})
    assert isinstance(adapter, ImportPath) and adapter.preset == "keller"
    assert adapter.hyperparameters == {"lr", "weight_decay", "momentum"}
    assert isinstance(load_adapter("muon_check.adapters.shipped:Reference"), Reference)
    with pytest.raises(ValueError, match="'nosuchmodule.x:y:z:w'"):
        load_adapter("nosuchmodule.x:y:z:w")
    assert conformance.main(["--adapter", "muon_check.adapters:NoSuchAdapter"]) == 2


@pytest.mark.timeout(10)
def test_shrinking_moves_stay_inside_the_family() -> None:
    case = Case("uneven", "dtensor", 4, ((7, 7),) * 4, steps=3)
    moves = smaller(case)
    assert moves and all(in_family(c) and c != case for c in moves)
    assert all(c.shapes[0][0] % 4 != 0 for c in moves)


@pytest.mark.timeout(60)
def test_a_local_checkout_by_import_path_conforms(tmp_path) -> None:
    """CHECKOUT_DIR:MODULE:CLASS: the checkout goes on sys.path (in the ranks too); the claim comes from flags."""
    (tmp_path / "my_muon.py").write_text(
        "import muon_ref\n\n"
        "class Muon(muon_ref.Muon):\n"
        "    def __init__(self, params, lr, weight_decay, momentum, nesterov):\n"
        "        super().__init__(params, preset='moonlight', lr=lr, weight_decay=weight_decay, momentum=momentum,\n"
        "                         nesterov=nesterov)\n"
    )
    argv = [
        "--adapter",
        f"{tmp_path}:my_muon:Muon",
        "--preset",
        "moonlight",
        "--families",
        "tall",
        "wide",
    ]
    assert conformance.main(argv) == 0


@pytest.mark.timeout(30)
def test_the_planted_suite_runs_alone_and_refuses_other_adapters() -> None:
    assert (
        conformance.main(["--planted", "--adapter", "muon_check.adapters.shipped:Reference"]) == 2
    )


def test_an_adapter_module_in_the_current_directory_imports_as_under_python_m(
    tmp_path, monkeypatch
):
    # the console scripts start without the current directory on sys.path (python -m puts it first)
    from muon_check.adapters import load_adapter

    (tmp_path / "my_cwd_adapters.py").write_text(
        "import torch\n\nclass MyMuon(torch.optim.SGD):\n    pass\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_cwd_adapters", raising=False)
    adapter = load_adapter("my_cwd_adapters:MyMuon")
    assert adapter.name == "MyMuon" and sys.path[0] == str(tmp_path)


@pytest.mark.parametrize(
    "argv, names, valid",
    [
        (["--all", "--families", "tal"], "--families tal unknown; valid: ", "tall"),
        (["--all", "--preset", "kellr"], "--preset 'kellr' is unknown; valid: ", "keller"),
    ],
)
def test_an_unknown_name_is_a_usage_error_listing_the_valid_ones(
    argv, names, valid, capsys
) -> None:
    """Nothing vacuous: a misspelt family or preset exits 2 with one line naming it and the valid names,
    before any case runs. Negative control: a known family passes the same validation."""
    assert conformance.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and names in err and valid in err.split("valid: ")[1]
    args = conformance._parser().parse_args(["--all", "--families", "tall"])
    assert conformance._unknown_names(args) is None


def test_help_lists_presets_and_families(capsys) -> None:
    """--help names every preset and family a user may pass (the names the usage errors accept)."""
    with pytest.raises(SystemExit):
        conformance.main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in muon_ref.PRESETS) and "experts_fused" in out


def test_a_family_no_chosen_adapter_supports_is_a_usage_error(capsys) -> None:
    """A known family that selects no case of the chosen adapters exits 2 (an empty run never
    "conforms"); the error lists the families those adapters support."""
    argv = ["--adapter", "muon_check.adapters.shipped:Reference", "--families", "straddle"]
    assert conformance.main(argv) == 2
    assert "selects no case" in capsys.readouterr().err


@pytest.mark.timeout(90)
def test_several_adapters_print_the_planned_cases_and_the_progress(tmp_path, capsys) -> None:
    reference = "muon_check.adapters.shipped:Reference"
    argv = ["--adapter", reference, "--adapter", reference, "--families", "tall", "row"]
    assert conformance.main([*argv, "--json", str(tmp_path / "r.json")]) == 0
    printed = capsys.readouterr().out
    reports = json.loads((tmp_path / "r.json").read_text())["reports"]
    per_adapter = [len(r["outcomes"]) for r in reports]
    assert len(per_adapter) == 2 and per_adapter[0] == per_adapter[1] > 0
    total = sum(per_adapter)
    assert f"2 adapters, {total} cases" in printed
    assert f": {per_adapter[0]} cases" in printed  # each adapter's count before it runs
    assert f"[{per_adapter[0]}/{total} cases in " in printed and " s left at this pace]" in printed


@pytest.mark.parametrize("changes, said", [("", False), (" M muon_ref/config.py", True)])
def test_the_provenance_says_when_the_checkout_has_uncommitted_changes(monkeypatch, changes, said):
    """A cited commit must be the code that ran: changes the commit does not hold are said beside it."""
    import subprocess

    def fake(argv, **_):
        out = "abc1234" if "rev-parse" in argv else changes
        return subprocess.CompletedProcess(argv, 0, stdout=out + "\n", stderr="")

    monkeypatch.setattr(subprocess, "run", fake)
    commit = conformance.provenance([])["commit"]
    assert commit == ("abc1234 with uncommitted changes" if said else "abc1234")
