"""`python -m muon_check` on distributed adapters over gloo: DistributedMuon behind the adapter
conforms (exit 0); two deliberately broken distributed Muons fail with the family that triggers them named:
NS on shards padded to a multiple of W (Dion's transpose on a padded shape: uneven shards only), and a
remainder batch that is never updated (remainder batches only)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

import muon_ref
from muon_check import conformance
from muon_check.adapters.shipped import DistributedReference
from muon_dist import DistributedMuon
from muon_dist.kernels import Backend

DIST_FAST = [
    "--world-sizes",
    "2",
    "--dtypes",
    "float32",
    "--families",
    "even",
    "uneven",
    "empty",
    "remainder",
    "--shrink-budget",
    "15",
]


def padded_newton_schulz(
    full: torch.Tensor, layout: muon_ref.MatrixLayout, cfg: muon_ref.MuonConfig
) -> torch.Tensor:
    """Like Dion: rows padded with zeros to a multiple of W and kept inside NS, so the transpose is decided on
    the padded shape."""
    W = dist.get_world_size()
    pad = full.new_zeros(math.ceil(full.shape[0] / W) * W - full.shape[0], *full.shape[1:])
    return muon_ref.newton_schulz(torch.cat([full, pad]), **cfg.ns_kwargs())[: full.shape[0]]


class PaddedNewtonSchulz(DistributedMuon):
    """DistributedMuon with the padded kernel as its backend."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.backend = Backend("torch", padded_newton_schulz, bitwise=False)


class PaddedAdapter(DistributedReference):
    name = "padded-ns"

    def build(self, params: list[torch.Tensor], **hp: Any) -> torch.optim.Optimizer:
        return PaddedNewtonSchulz(params, preset=self.preset, **hp)


class DroppedRemainder(DistributedReference):
    """Steps only the params of full batches of W; the ones beyond the last full batch are never updated."""

    name = "dropped-remainder"

    def build(self, params: list[torch.Tensor], **hp: Any) -> torch.optim.Optimizer:
        W = dist.get_world_size()
        return DistributedMuon(params[: len(params) // W * W], preset=self.preset, **hp)


def _report(tmp_path, adapter: str, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    code = conformance.main(["--adapter", adapter, *DIST_FAST, *extra, "--json", str(out)])
    (report,) = json.loads(out.read_text())["reports"]
    return code, report


@pytest.mark.timeout(90)
def test_distributed_muon_behind_the_adapter_conforms_on_gloo(tmp_path) -> None:
    code, report = _report(
        tmp_path, "muon_check.adapters.shipped:DistributedReference", "--world-sizes", "1", "2"
    )
    assert code == 0 and report["conforms"], report["diagnosis"]
    assert {
        (o["family"], o["world_size"]) for o in report["outcomes"] if o["mode"] == "dtensor"
    } >= {("even", 1), ("even", 2), ("uneven", 2), ("empty", 2), ("remainder", 2)}


@pytest.mark.timeout(90)
def test_ns_on_padded_shards_is_a_bug_of_uneven_shards_only(tmp_path) -> None:
    code, report = _report(tmp_path, f"{__name__}:PaddedAdapter")
    assert code == 1
    assert report["diagnosis"].startswith(
        "bug: orthogonalised direction departs on uneven (1/1: W=2)"
    )
    departed = {o["family"] for o in report["outcomes"] if o["status"] != "bitwise"}
    assert departed == {"uneven"}, report["outcomes"]
    (small,) = report["minimal_failing_cases"]
    assert (
        small["status"] == "differs" and small["to"].startswith("uneven") and "W=2" in small["to"]
    )


@pytest.mark.timeout(90)
def test_a_dropped_remainder_is_a_bug_of_remainder_batches_only(tmp_path) -> None:
    code, report = _report(tmp_path, f"{__name__}:DroppedRemainder")
    assert code == 1
    assert report["diagnosis"].startswith(
        "bug: application departs on remainder (1/1: W=2) (step 1, param 2: the param is left as it is"
    )
    departed = {o["family"] for o in report["outcomes"] if o["status"] != "bitwise"}
    assert departed == {"remainder"}, report["outcomes"]
    first = next(o for o in report["outcomes"] if o["family"] == "remainder")
    assert first["first_step"] == 1 and first["grows"], first
