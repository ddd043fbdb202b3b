"""What stacking a parameter set's same-shape matrices across params would buy Newton-Schulz on the CPU it runs on.

    python -m benchmarks stacking [--sets tiny_moe scaled_moe dense] [--warmup 3] [--reps 20]

Per set (the Muon matrices of benchmarks.run's sets; a 3-D expert stack counts as its matrices), two ways of
orthogonalising every matrix once under the "torch" preset's Newton-Schulz options (muon_ref.MuonConfig.ns_kwargs:
keller, 5 steps, bf16, step form "addmm"):
  loop     muon_ref.newton_schulz on each matrix alone: what DistributedMuon's bitwise backend runs wherever the
           reference backend's batched rule does not batch (muon_dist/kernels/reference.py), one call per matrix
  stacked  muon_dist.kernels.orthogonalize_many with the "batched" backend: the matrices stacked by shape,
           newton_schulz_batched once per shape (one bmm / baddbmm per product over the stack, as Dion's
           megabatches stack same-shape params); what DistributedMuon(ns_backend="batched") runs
Columns: matrices, shapes (the stacked calls), the median ms of each way over --reps timed runs after --warmup
untimed ones (one intra-op thread, wall clock), their ratio, and whether every stacked result has the loop's bits
(else the max |difference| and how many matrices differ). The stacked way is not a contract of any backend: where
its bits differ from the loop's, only a backend with a stated tolerance may run it (docs/benchmarks.md).

    python -m benchmarks stacking --per-shape [--sets ...] [--warmup 3] [--reps 20]

also prints, per set and shape, the loop's cost of one matrix beside the cost DistributedMuon's planner assigns it
(muon_dist.balance.ns_flops, 5 steps: LPT balances owners on it): matrices of the shape, MFLOP per matrix, the median
us of one newton_schulz call on one matrix of the shape (as above, per call), us per MFLOP, and the shape's share of
the set's FLOPs and of its loop time. Where the two shares part, the FLOP count misprices the shape on the CPU it runs on
(small matrices, whose calls cost more than their arithmetic: docs/benchmarks.md, "Local expert batches held
until a round's directions travel").
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import Tensor

from muon_ref import MuonConfig, matrix_layout, newton_schulz
from muon_ref.optim import group_config
from muon_ref.presets import preset_defaults

from .gpu import elapsed_s, spread
from .run import SETS, header, muon_specs

PRESET = "torch"


def matrices_of(table: str, seed: int = 0) -> list[Tensor]:
    """Every Muon matrix of the set, fp32 Gaussian (seeded), a 3-D stack as its matrices."""
    g = torch.Generator().manual_seed(seed)
    out: list[Tensor] = []
    for spec in muon_specs(table):
        *lead, m, n = spec.shape
        count = lead[0] if lead else 1
        out += [torch.randn(m, n, generator=g) for _ in range(count)]
    return out


def by_shape(matrices: list[Tensor]) -> dict[tuple[int, int], list[int]]:
    """The indices of the matrices of each shape, shapes in first-seen order."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, M in enumerate(matrices):
        groups.setdefault(tuple(M.shape), []).append(i)
    return groups


def loop(matrices: list[Tensor], cfg: MuonConfig) -> list[Tensor]:
    return [newton_schulz(M, **cfg.ns_kwargs()) for M in matrices]


def stacked(matrices: list[Tensor], cfg: MuonConfig) -> list[Tensor]:
    """Each shape's matrices in one stack kernel call of the "batched" backend (orthogonalize_many); results in
    input order."""
    from muon_dist.kernels import backend, orthogonalize_many

    return orthogonalize_many(
        backend("batched"), [(M, matrix_layout(tuple(M.shape)), cfg) for M in matrices]
    )


def median_ms(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """The median wall ms of fn() over `reps` calls after `warmup` untimed ones (benchmarks.gpu's clock on CPU)."""
    for _ in range(warmup):
        fn()
    return spread([elapsed_s(fn, torch.device("cpu")) for _ in range(reps)])["ms"]


def row(table: str, warmup: int, reps: int) -> dict:
    cfg = group_config(preset_defaults(PRESET, {}))
    matrices = matrices_of(table)
    want, got = loop(matrices, cfg), stacked(matrices, cfg)
    differ = [i for i, (a, b) in enumerate(zip(want, got)) if not torch.equal(a, b)]
    worst = max(
        ((want[i].double() - got[i].double()).abs().max().item() for i in differ), default=0.0
    )
    loop_ms = median_ms(lambda: loop(matrices, cfg), warmup, reps)
    stacked_ms = median_ms(lambda: stacked(matrices, cfg), warmup, reps)
    return {
        "set": table,
        "matrices": len(matrices),
        "shapes": len(by_shape(matrices)),
        "loop_ms": loop_ms,
        "stacked_ms": stacked_ms,
        "differing": len(differ),
        "max_abs_diff": worst,
    }


def shape_rows(table: str, warmup: int, reps: int) -> list[dict]:
    """Per shape of the set (first-seen order): matrices, ns_flops of one, the median us of one loop call on one of
    them, and the shape's shares of the set's FLOPs and of its loop time (count x per matrix over the sums)."""
    from muon_dist.balance import ns_flops

    cfg = group_config(preset_defaults(PRESET, {}))
    matrices = matrices_of(table)
    rows = []
    for (m, n), indices in by_shape(matrices).items():
        M = matrices[indices[0]]
        us = 1e3 * median_ms(lambda M=M: newton_schulz(M, **cfg.ns_kwargs()), warmup, reps)
        rows.append({"shape": (m, n), "count": len(indices), "flops": ns_flops(m, n), "us": us})
    total_flops = sum(r["count"] * r["flops"] for r in rows)
    total_us = sum(r["count"] * r["us"] for r in rows)
    for r in rows:
        r["flops_share"] = r["count"] * r["flops"] / total_flops
        r["time_share"] = r["count"] * r["us"] / total_us
    return rows


def print_shape_rows(table: str, rows: list[dict]) -> None:
    print(f"\n{table}: one matrix of each shape, the loop's call beside the planner's FLOP count")
    print(
        f"{'shape':>12} {'matrices':>8} {'MFLOP':>9} {'us':>9} {'us/MFLOP':>9} "
        f"{'FLOP share':>10} {'time share':>10}"
    )
    for r in rows:
        mflop = r["flops"] / 1e6
        print(
            f"{'x'.join(map(str, r['shape'])):>12} {r['count']:>8} {mflop:>9.2f} {r['us']:>9.1f} "
            f"{r['us'] / mflop:>9.2f} {r['flops_share']:>10.3f} {r['time_share']:>10.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks stacking",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--sets", nargs="+", choices=sorted(SETS), default=["tiny_moe", "scaled_moe", "dense"]
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--per-shape",
        action="store_true",
        help="also each shape's loop call beside the planner's FLOP count (shape_rows)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(header("Newton-Schulz of a set's matrices: one call per matrix, or stacked by shape"))
    print(
        f"{'set':<12} {'matrices':>8} {'shapes':>6} {'loop ms':>9} {'stacked ms':>10} {'ratio':>6}  bits"
    )
    for table in args.sets:
        r = row(table, args.warmup, args.reps)
        bits = (
            "the loop's"
            if not r["differing"]
            else f"{r['differing']} of {r['matrices']} differ, max |diff| {r['max_abs_diff']:.2g}"
        )
        print(
            f"{table:<12} {r['matrices']:>8} {r['shapes']:>6} {r['loop_ms']:>9.2f} {r['stacked_ms']:>10.2f} "
            f"{r['stacked_ms'] / r['loop_ms']:>6.2f}  {bits}"
        )
    if args.per_shape:
        for table in args.sets:
            print_shape_rows(table, shape_rows(table, args.warmup, args.reps))
    return 0
