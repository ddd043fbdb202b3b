"""The kernel table of benchmarks/gpu.py under this file's old command (muon_dist/kernels/README.md):

    python benchmarks/triton_ns.py [--shapes 4096x4096,8x1024x1024] [--peak-tflops 989] [--reps 20] ...
    == python -m benchmarks gpu --parts kernels [the same options]

Every Newton-Schulz kernel (muon_ref's, torch.optim's, each muon_dist.kernels backend, the Triton kernel at
other tiles with --triton-tiles) per shape: median ms, fraction of the bf16 peak, max |diff| from muon_ref.
On a machine without CUDA it says so and exits 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

# run as a script, this file's folder is first on sys.path: put the repository root there for `benchmarks`
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import gpu  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return gpu.main(["--parts", "kernels", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
