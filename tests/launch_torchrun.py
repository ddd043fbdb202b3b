"""Run `python -m muon_check.verify` under torchrun as a test: the launcher shared by the gloo/CPU test and the
NCCL/GPU test, so that on a CPU machine everything but the NCCL backend itself is exercised."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def torchrun_verify(
    world_size: int, backend: str, tmp_path: Path, *extra: str, timeout: float = 540
) -> dict:
    """Exit code 0 and the JSON report of `torchrun --nproc-per-node W -m muon_check.verify --backend B`."""
    out = tmp_path / f"verify_{backend}_{world_size}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world_size}",
        "-m",
        "muon_check.verify",
        "--backend",
        backend,
        "--json",
        str(out),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())
