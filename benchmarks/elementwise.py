"""Which elementwise stages run on a shard as it is, and the bits that gives (muon_dist/elementwise.py,
"Position-free stages").

    python -m benchmarks elementwise [--cases N]

For every preset of muon_ref and param dtype float32, float64, bfloat16: position_free's verdict for the step's
three stages (momentum_direction, momentum_buffer, apply_update, the update in the preset's Newton-Schulz dtype),
then over N random matrices (2-300 x 1-300, seeded) cut by rows into two shards, the elements whose bits differ
between the whole call and the unpadded call on each shard. Exits 1 if a stage taken as position-free differed
anywhere (muon_dist.elementwise.measure); a stage not taken may differ (it runs padded).
"""

from __future__ import annotations

import argparse

import torch

from muon_dist.elementwise import measure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks elementwise",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--cases", type=int, default=40, help="random matrices per preset and dtype (default 40)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(
        f"elementwise stages on unpadded row shards, CPU ({torch.backends.cpu.get_cpu_capability()}), torch "
        f"{torch.__version__}, one thread; differing: elements of the shards' calls whose bits differ from the "
        f"whole call's (momentum_direction's two outputs counted together)"
    )
    violations = measure(args.cases)
    print(f"stages taken as position-free that differed: {violations}")
    return 1 if violations else 0
