"""Time the Triton Newton-Schulz kernel against muon_ref's torch-matmul kernel on one CUDA GPU.

    python benchmarks/triton_ns.py [--shapes 4096x4096,8x1024x1024] [--peak-tflops 989] [--reps 20]

For each shape: the median over --reps timed runs (CUDA events, after --warmup untimed runs) of
muon_dist.kernels.triton_ns.newton_schulz_triton and of muon_ref.newton_schulz (both bf16, same schedule),
their ratio, and each one's fraction of the bf16 peak. FLOPs are counted as the full products of the
reference (per matrix with m <= n after the transpose, per step: 2 m^2 n for X X^T, 2 m^3 for A A, 2 m^2 n for
B X), so the Triton kernel's triangle saving shows up as a higher fraction, not a smaller count.
On a machine without CUDA it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable

import torch

# NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100): H100 SXM BF16 Tensor Core
# 1,979 TFLOPS "with sparsity", specifications one half lower without sparsity: 989 dense
H100_SXM_DENSE_BF16_TFLOPS = 989.0
DEFAULT_SHAPES = "1024x1024,4096x4096,4096x11008,11008x4096,8x1024x1024,16x512x2048"


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """'4096x4096,8x1024x1024' -> [(4096, 4096), (8, 1024, 1024)]."""
    shapes = []
    for item in text.split(","):
        dims = item.lower().split("x")
        if len(dims) < 2 or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise argparse.ArgumentTypeError(f"a shape is [batch x] fan_out x fan_in, positive integers; got {item!r}")
        shapes.append(tuple(int(d) for d in dims))
    return shapes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes(DEFAULT_SHAPES),
                        help=f"comma-separated (default {DEFAULT_SHAPES})")
    parser.add_argument("--schedule", default="keller")
    parser.add_argument("--steps", type=int, default=None, help="default: the schedule's own")
    parser.add_argument("--peak-tflops", type=float, default=H100_SXM_DENSE_BF16_TFLOPS,
                        help="dense bf16 peak of the GPU in TFLOP/s (default: H100 SXM, 989)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--block-k", type=int, default=32)
    parser.add_argument("--num-warps", type=int, default=4)
    return parser.parse_args(argv)


def median_seconds(fn: Callable[[], object], reps: int, warmup: int) -> float:
    """Median wall time of fn() on the current CUDA stream, each run timed by its own pair of events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def reference_flops(shape: tuple[int, ...], num_steps: int) -> float:
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * num_steps * (4 * m * m * n + 2 * m**3)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/triton_ns.py: no CUDA device here, nothing to time (run it on a GPU node)")
        return 0
    from muon_dist.kernels.triton_ns import newton_schulz_triton
    from muon_ref import get_schedule, newton_schulz

    num_steps = len(get_schedule(args.schedule).steps_for(args.steps))
    tiles = dict(block=args.block, block_k=args.block_k, num_warps=args.num_warps)
    print(f"{torch.cuda.get_device_name()}, schedule {args.schedule} ({num_steps} steps), bf16, "
          f"median of {args.reps}, peak {args.peak_tflops:g} TFLOP/s, tiles {tiles}")
    print(f"{'shape':>18} {'torch ms':>10} {'triton ms':>10} {'torch/triton':>13} {'torch peak':>11} "
          f"{'triton peak':>12} {'max |diff|':>11}")
    for shape in args.shapes:
        G = torch.randn(shape, device="cuda")
        run = dict(schedule=args.schedule, steps=args.steps, dtype=torch.bfloat16)
        diff = (newton_schulz_triton(G, **run, **tiles).float() - newton_schulz(G, **run).float()).abs().max().item()
        t_ref = median_seconds(lambda: newton_schulz(G, **run), args.reps, args.warmup)
        t_tri = median_seconds(lambda: newton_schulz_triton(G, **run, **tiles), args.reps, args.warmup)
        flops = reference_flops(shape, num_steps)
        peak = args.peak_tflops * 1e12
        print(f"{'x'.join(map(str, shape)):>18} {t_ref * 1e3:10.3f} {t_tri * 1e3:10.3f} {t_ref / t_tri:13.2f} "
              f"{flops / t_ref / peak:11.1%} {flops / t_tri / peak:12.1%} {diff:11.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
