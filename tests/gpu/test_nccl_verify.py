"""`pytest -m gpu` on a multi-GPU node: every muon_dist path on NCCL, checked bitwise against muon_ref.

Launches `torchrun --nproc-per-node W -m muon_check.verify --backend nccl` for every world size from 2 to the
number of visible GPUs (the hsdp mesh adds the sub-mesh case at even W >= 4). The same launcher and rank code
run on gloo/CPU in tests/dist/test_torchrun.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.launch_torchrun import torchrun_verify

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 or more CUDA GPUs, found {GPUS}")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", range(2, max(GPUS, 2) + 1))
def test_every_path_on_nccl_equals_muon_ref_bitwise(world_size, tmp_path):
    report = torchrun_verify(world_size, "nccl", tmp_path)
    assert report["violations"] == [] and all(r["bitwise"] for r in report["rows"])
    assert {"all_to_all", "agrs", "padded_all_to_all", "replicated"} <= {
        r["path"] for r in report["rows"]
    }
