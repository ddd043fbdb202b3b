"""What is alive at a step's memory peak, and who allocated it: each method's peak by allocation site.

    python -m benchmarks sites [--sets dense] [--world-sizes 1 2 4] [--methods distributed]
                               [--rounds N] [--pipeline-depth N] [--dion PATH] [--warmup 2] [--top 10]

The parameter sets, shards and methods of benchmarks.run (fp32 params, Shard(0) DTensors on a 1-D CPU mesh over
gloo, one intra-op thread per rank, preset "torch"), each method on fresh params on W ranks. After --warmup
unmeasured steps, one more unmeasured step and one measured step run under the profiler with Python stacks
(benchmarks.memory.peak_sites): the measured step's peak extra memory, read as benchmarks.run's peak column
reads it, and the blocks alive at that moment, grouped by the site that allocated them: the innermost op and the
three innermost Python functions around it outside torch's machinery (memory.site_label). The blocks from before
the step that it had freed by its peak count as one negative line, so the lines of a rank sum to its peak.
Printed per set, W and method: every rank's peak, and the sites of the rank with the largest, the largest first
(--top of them; the rest summed on one line), in KiB (a block under 0.1 KiB in bytes).

The profiler's view: the thread that runs the step only. A block that a collective's worker thread allocates
or frees is not seen (benchmarks.run lists the methods whose readings this moves, and reads every thread's
resident memory beside it). A method's peak moves with the timing of its asynchronous collectives from step to
step (benchmarks.run's unsettled readings): this is one step's.
"""

from __future__ import annotations

import argparse
import time

import torch

from . import memory, peers
from .run import (
    METHODS,
    SETS,
    Bench,
    gradients,
    header,
    initial,
    make,
    muon_specs,
    set_grads,
    shard,
    validated,
)


def rank_sites(b: Bench, methods: tuple[str, ...]) -> dict[str, tuple[int, dict[str, int]]]:
    """On each rank, per method (fresh params, b.warmup unmeasured steps): memory.peak_sites of its step."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    names = [s.name for s in muon_specs(b.table)]
    out = {}
    for method in methods:
        params = [shard(t) for t in initial(b)]
        opt = make(method, params, names, b)
        for step in range(b.warmup):
            set_grads(params, gradients(b, step))
            opt.step()

        def prepare(k: int, params: list[torch.Tensor] = params) -> None:
            set_grads(params, gradients(b, b.warmup + k))
            dist.barrier()

        out[method] = memory.peak_sites(opt.step, prepare)
        del opt, params
    return out


def lines(peak: int, sites: dict[str, int], top: int) -> list[tuple[str, int]]:
    """The sites of one reading with any bytes, the largest first: `top` of them, then the rest summed as one line,
    then the UNSEEN and EARLIER lines; the lines sum to `peak`."""
    apart = (memory.UNSEEN, memory.EARLIER)
    ranked = sorted(
        ((n, v) for n, v in sites.items() if n not in apart and v), key=lambda kv: (-kv[1], kv[0])
    )
    out = ranked[:top]
    rest = ranked[top:]
    if rest:
        out.append((f"({len(rest)} more sites)", sum(v for _, v in rest)))
    out += [(n, sites[n]) for n in apart if sites.get(n)]
    assert sum(v for _, v in out) == peak, (peak, sites)
    return out


def print_sites(
    b: Bench, method: str, readings: list[tuple[int, dict[str, int]]], top: int
) -> None:
    peaks = [p for p, _ in readings]
    worst = max(range(len(peaks)), key=lambda r: (peaks[r], -r))
    print(
        f"\n{b.table}, W = {b.world_size}, {method}: peak KiB per rank "
        f"{', '.join(f'{p / 1024:,.1f}' for p in peaks)}; alive at rank {worst}'s peak, by site:"
    )
    for name, size in lines(*readings[worst], top):
        print(f"  {_amount(size)}  {name}")


def _amount(size: int) -> str:
    """KiB to one decimal; a block under 0.1 KiB in bytes (a flag element), so that no line reads 0.0."""
    return f"{size:8,} B  " if abs(size) < 103 else f"{size / 1024:10,.1f}"


def main(argv: list[str] | None = None) -> int:
    from muon_check.launch import RankPool

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sets", nargs="+", choices=sorted(SETS), default=["dense"])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=[*METHODS, "torch_muon", "dion"],
        default=["distributed"],
        help="benchmarks.run's methods (torch_muon: a set of 2-D matrices only; dion: needs --dion)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="DistributedMuon's rounds=")
    parser.add_argument(
        "--pipeline-depth", type=int, default=None, help="DistributedMuon's pipeline_depth="
    )
    parser.add_argument(
        "--memory-budget",
        type=int,
        default=None,
        help="DistributedMuon's memory_budget= (distributed)",
    )
    parser.add_argument("--dion", metavar="PATH", default=peers.installed_dion())
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=10, help="sites listed per reading")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    if "dion" in args.methods and not args.dion:
        parser.error("--methods dion needs --dion PATH (a microsoft/dion checkout)")
    start = time.perf_counter()
    print(header("muon_dist memory by site"))
    print(validated())
    for W in args.world_sizes:
        pool = RankPool(W)
        try:
            for table in args.sets:
                b = Bench(
                    table,
                    W,
                    args.warmup,
                    0,
                    dion=args.dion,
                    rounds=args.rounds,
                    pipeline_depth=args.pipeline_depth,
                    memory_budget=args.memory_budget,
                )
                methods = tuple(m for m in args.methods if m in b.methods)
                skipped = [m for m in args.methods if m not in methods]
                if skipped:
                    print(f"\n{table}, W = {W}: {', '.join(skipped)} not run on this set")
                results = pool.run(rank_sites, b, methods, timeout=args.timeout)
                for method in methods:
                    print_sites(b, method, [r[method] for r in results], args.top)
        finally:
            pool.close()
    print(f"\nwall time {time.perf_counter() - start:.1f} s")
    return 0
