"""`torchrun -m muon_check.verify` on gloo: the NCCL test's launcher and rank code, run on CPU."""

from __future__ import annotations

import pytest

from tests.launch_torchrun import torchrun_verify


@pytest.mark.timeout(300)
def test_verify_under_torchrun_on_gloo_passes_and_exercises_every_path(tmp_path):
    report = torchrun_verify(2, "gloo", tmp_path, "--presets", "torch", "--steps", "1")
    assert report["violations"] == [] and all(r["bitwise"] for r in report["rows"])
    assert {"all_to_all", "agrs", "padded_all_to_all", "replicated"} <= {
        r["path"] for r in report["rows"]
    }
