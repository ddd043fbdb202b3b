"""`pytest -m gpu` on any CUDA machine, one GPU is enough: W gloo ranks share the GPU (gloo carries CUDA tensors),
so every multi-rank path of muon_dist runs with CUDA kernels, bitwise against muon_ref on CUDA; and the
conformance check runs its candidates on CUDA. The same code runs on CPU tensors in `make test`
(tests/dist/test_verify.py, tests/dist/test_conformance_dist.py); only the device differs."""

from __future__ import annotations

import json

import pytest
import torch

from muon_check import conformance, verify
from muon_dist import PATHS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


# gloo ranks sharing the GPU; 8 for the ep mesh of 2 x 4, where experts split across a sub-group
WORLD_SIZES = ("1", "2", "3", "4", "8")


@pytest.mark.timeout(900)
def test_every_path_on_gloo_ranks_sharing_a_gpu_equals_muon_ref_on_cuda_bitwise(tmp_path):
    """`python -m muon_check.verify --device cuda` at W = 1, 2, 3, 4, 8: every row bitwise against muon_ref on CUDA,
    every path of muon_dist.PATHS and the five meshes taken, a resume at each W."""
    out = tmp_path / "verify_cuda.json"
    assert verify.main(["--device", "cuda", "--world-sizes", *WORLD_SIZES, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["violations"] == [] and all(r["bitwise"] for r in report["rows"])
    # every path of muon_dist runs (subgroup_all_gather needs the ep mesh of W = 8: 2 x 4)
    assert {r["path"] for r in report["rows"]} == set(PATHS)
    assert {r["mesh"] for r in report["rows"]} == {"fsdp", "hsdp", "ep", "ddp", "tp"}
    assert {r["world_size"] for r in report["rows"] if r["mode"] == "resume"} == {
        int(w) for w in WORLD_SIZES
    }


@pytest.mark.timeout(900)
def test_distributed_muon_conforms_on_cuda_under_the_conformance_check(tmp_path):
    out = tmp_path / "conformance_cuda.json"
    argv = [
        "--adapter",
        "muon_check.adapters.shipped:DistributedReference",
        "--device",
        "cuda",
        "--world-sizes",
        "1",
        "2",
        "3",
        "--steps",
        "2",
        "--json",
        str(out),
    ]
    assert conformance.main(argv) == 0
    (report,) = json.loads(out.read_text())["reports"]
    assert report["device"] == "cuda" and report["conforms"]
    assert {o["mode"] for o in report["outcomes"]} == {"single", "dtensor"}
