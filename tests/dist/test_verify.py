"""`python -m muon_check.verify` (what `make verify` runs): a smoke run passes, and a broken path fails it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from muon_check import verify


@pytest.mark.timeout(240)
def test_verify_passes_on_two_world_sizes_and_exercises_every_remainder_path(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert verify.main(["--world-sizes", "1", "2", "--steps", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["violations"] == []
    assert {
        "all_to_all",
        "agrs",
        "padded_all_to_all",
        "replicated",
        "local",
        "global_all_to_all",
    } <= {r["path"] for r in report["rows"]}
    assert all(r["bitwise"] for r in report["rows"])
    assert {r["world_size"] for r in report["rows"] if r["mode"] == "resume"} == {
        1,
        2,
    }  # across a checkpoint
    # the even all-to-all moves exactly the lower bound
    a2a = [
        r
        for r in report["rows"]
        if r["path"] == "all_to_all" and r["world_size"] == 2 and r["mesh"] == "fsdp"
    ]
    assert a2a and all(r["bytes_per_rank"] == pytest.approx(r["bound_per_rank"]) for r in a2a)


def _dropping(comm, group, batch, directions, kernels):
    return [torch.zeros_like(d, dtype=batch.update_torch_dtype) for d in directions]


@pytest.mark.timeout(240)
def test_verify_exits_non_zero_when_a_path_drops_its_updates(monkeypatch, capsys):
    from muon_dist.paths import PATHS

    broken = dataclasses.replace(PATHS["agrs"], run=_dropping)
    monkeypatch.setitem(PATHS, "agrs", broken)  # the forked ranks inherit the broken path
    assert verify.main(["--world-sizes", "2", "--steps", "1"]) == 1
    assert "contract violations: 0" not in capsys.readouterr().out


def _reload_without_momentum(run, params, opt, device, checkpoint_dir):
    """A resume that restores the params but not the optimizer state (the momentum restarts from zero)."""
    from muon_dist import DistributedMuon

    fulls = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in params]
    fresh = [verify._distribute(full.clone(), run, device) for full in fulls]
    return fresh, DistributedMuon(verify.param_groups(run.mesh, fresh), preset=run.preset)


@pytest.mark.timeout(240)
def test_verify_exits_non_zero_when_a_resume_loses_the_momentum(monkeypatch, capsys):
    monkeypatch.setattr(
        verify, "_save_and_reload", _reload_without_momentum
    )  # inherited by the forked ranks
    assert verify.main(["--world-sizes", "2", "--steps", "2", "--presets", "torch"]) == 1
    out = capsys.readouterr().out
    assert "contract violations: 0" not in out and "mode='resume'" in out
