"""Where DistributedMuon's step spends its time, stage by stage, beside Dion's step on the same params.

    python -m benchmarks stages [--dion PATH] [--world-sizes 1 2 4] [--warmup 2] [--steps 8]
                                [--sets dense] [--ns-backend torch] [--rounds N] [--per-rank]

Parameter sets of benchmarks.run (default `dense`: the 28 Muon matrices of a 4-layer transformer with d = 256
and ff = 1024), fp32, Shard(0) DTensors on a 1-D CPU mesh over gloo, one intra-op thread per rank, preset
"torch" (bf16 NS). Methods, steps interleaved in one pool: DistributedMuon with dispatch "batched" and "global"
(its default), with --ns-backend and --rounds as given (default: its own), and with --dion PATH (a
microsoft/dion checkout) dion.Muon (Polar Express off, bf16 NS) on the same DTensors. For dion.Muon the stages
are two: NS, the Newton-Schulz function its step calls (its `_newton_schulz_func`, timed the same way; a Dion
without that attribute shows its total alone), and host, the rest of its step. The line "NS alone / dion's step"
divides each DistributedMuon method's NS by dion.Muon's total: above 1, no step that runs that Newton-Schulz (the
bitwise backend's is muon_ref's, matrix by matrix where its batch is not bitwise) can be as fast as dion.Muon's.

Each stage's time is its exclusive wall time on a rank (time inside a nested stage counts for the nested
one), measured by wrapping the step's functions for the duration of the run (a wrapper's own cost lands in
the calling stage: 0.41 us per call of an empty function, min of 5 x 200,000 calls with timeit on the CPU of
docs/benchmarks.md); `host` is the step's time outside every stage
(configs, the plan's bookkeeping, the params' copies, the report). Per step the slowest rank's total; per
stage its mean over ranks; medians over the timed steps. With --per-rank, each DistributedMuon method's stages on
each rank apart (each cell the median over steps of that rank's time): where the ranks' Newton-Schulz differs, the
faster rank's wait shows in its collectives. Stages:
    collect       DistributedMuon._collect: validating the gradients, reading the layouts, the local shards
    plan          muon_dist.plan.plan and the write groups
    nonfinite     the non-finite flags of the gradients (without their collective)
    momentum      muon_ref's momentum_direction on the shards      apply   muon_ref's apply_update on the shards
    shard pad     run_stage's padding and tail handling around those two (elementwise.py)
    pack/unpack   the exchange's buffers, the joins of boxes into matrices and the cuts of updates into boxes
    NS            the backend's orthogonalize and its stack kernel (calls stacked across params)
    write         the new momentum buffers into the old ones' storage
    COLL[name]    each collective, by the name it is logged under (a path, or a check of the step): issuing it,
                  and waiting for it where it was issued without blocking (Pending.wait); time computing while
                  it runs is the computing stage's
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

STAGES = (
    "collect",
    "plan",
    "nonfinite",
    "momentum",
    "apply",
    "shard pad",
    "pack/unpack",
    "NS",
    "write",
)


class StageClock:
    """Exclusive wall time per stage: a stage's time minus the time of the stages nested in it."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []  # per open stage: [time of its nested stages]

    def timed(self, stage: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        """fn, timed under `stage` (or stage(*args, **kwargs): a name read from the call)."""

        def run(*args: Any, **kwargs: Any) -> Any:
            name = stage(*args, **kwargs) if callable(stage) else stage
            self._stack.append([0.0])
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                nested = self._stack.pop()[0]
                self.totals[name] += spent - nested
                if self._stack:
                    self._stack[-1][0] += spent

        return run

    def take(self) -> dict[str, float]:
        out, self.totals = dict(self.totals), defaultdict(float)
        return out


def _collective(op: str, path_at: int) -> Callable[..., str]:
    """The stage of a Comm collective: its op and the name its caller logs it under (its path: the positional
    argument at `path_at` after the tensor, or the keyword); control elements it carries are not told apart."""

    def name(self: Any, x: Any, *rest: Any, **kw: Any) -> str:
        return f"COLL {op}[{kw.get('path', rest[path_at - 1] if len(rest) >= path_at else '?')}]"

    return name


@contextmanager
def instrumented(clock: StageClock) -> Iterator[None]:
    """The step's functions wrapped by `clock` (restored on exit)."""
    from muon_dist import agreement, comm, elementwise, optim, step
    from muon_dist.paths import agrs, exchange

    targets = [
        (step, "plan", "plan"),
        (agreement, "write_groups", "plan"),
        (agreement, "local_flags", "nonfinite"),
        (agreement, "nonfinite", "nonfinite"),
        (optim.DistributedMuon, "_write_buffer", "write"),
        (optim.DistributedMuon, "_collect", "collect"),
        (elementwise, "momentum_direction", "momentum"),
        (elementwise, "momentum_buffer", "momentum"),
        (elementwise, "apply_update", "apply"),
        (elementwise, "run_stage", "shard pad"),
        (exchange, "pack", "pack/unpack"),
        (exchange, "unpack", "pack/unpack"),
        (exchange, "join", "pack/unpack"),
        (exchange, "cut", "pack/unpack"),
        (agrs, "join", "pack/unpack"),
        (agrs, "cut", "pack/unpack"),
        (comm.Comm, "all_to_all", _collective("all_to_all", 4)),
        (comm.Comm, "all_gather", _collective("all_gather", 2)),
        (comm.Comm, "reduce_scatter_sum", _collective("reduce_scatter", 2)),
        (comm.Pending, "wait", lambda self: f"COLL {self.op}[{self.path}]"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
    try:
        for owner, name, stage in targets:
            setattr(owner, name, clock.timed(stage, getattr(owner, name)))
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def timed_backend(opt: Any, clock: StageClock) -> None:
    """The optimizer's NS backend, its orthogonalize and its stack kernel timed as "NS"."""
    from muon_dist.kernels import with_kernels

    opt.backend = with_kernels(opt.backend, lambda kernel: clock.timed("NS", kernel))


def methods_of(b: Any, dion_path: str | None, clock: StageClock) -> tuple[dict, dict]:
    """({name: optimizer}, {name: its params}): DistributedMuon in both dispatch modes (NS timed by `clock`), and
    dion.Muon given a checkout, each on its own copy of the initial params."""
    from muon_dist.optim import DistributedMuon

    from .peers import dion_muon, load_dion
    from .run import initial, muon_specs, shard

    names = [s.name for s in muon_specs(b.table)]
    methods: dict[str, Any] = {}
    chosen = ("batched", "global") + (("dion",) if dion_path is not None else ())
    params = {m: [shard(t) for t in initial(b)] for m in chosen}
    for dispatch in ("batched", "global"):
        extra = {} if b.rounds is None else {"rounds": b.rounds}
        methods[dispatch] = DistributedMuon(
            [{"params": params[dispatch], "param_names": names}],
            preset=b.preset,
            dispatch=dispatch,
            ns_backend=b.ns_backend,
            **extra,
        )
        timed_backend(methods[dispatch], clock)
    if dion_path is not None:
        methods["dion"] = dion_muon(load_dion(dion_path), params["dion"])
        timed_dion(methods["dion"], clock)
    return methods, params


def timed_dion(opt: Any, clock: StageClock) -> bool:
    """dion.Muon's Newton-Schulz function (the `_newton_schulz_func` its step passes to its megabatch updates)
    timed as "NS"; False, and nothing wrapped, where the optimizer has no such callable."""
    ns = getattr(opt, "_newton_schulz_func", None)
    if not callable(ns):
        return False
    opt._newton_schulz_func = clock.timed("NS", ns)
    return True


def timed_step(opt: Any, params: list[torch.Tensor], grads: list, clock: StageClock) -> dict:
    """One step after a barrier: {"total": its time, stage: time} in seconds."""
    import torch.distributed as dist

    from .run import set_grads

    set_grads(params, grads)
    dist.barrier()
    clock.take()
    start = time.perf_counter()
    opt.step()
    total = time.perf_counter() - start
    return {"total": total, **clock.take()}


def rank_stages(
    dion_path: str | None,
    world_size: int,
    warmup: int,
    steps: int,
    table: str = "dense",
    ns_backend: str = "torch",
    rounds: int | None = None,
) -> dict:
    """Per method: per timed step, this rank's total and its stage times (ms); dion.Muon's total and NS."""
    from .run import Bench, gradients

    b = Bench(table, world_size, warmup, steps, rounds=rounds, ns_backend=ns_backend)
    clock = StageClock()
    methods, params = methods_of(b, dion_path, clock)
    order = list(methods)
    out: dict[str, list[dict[str, float]]] = {m: [] for m in order}
    with instrumented(clock):
        for step in range(b.total_steps):
            grads = gradients(b, step)
            for k in range(len(order)):
                method = order[(step + k) % len(order)]
                row = timed_step(methods[method], params[method], grads, clock)
                if step >= b.warmup:
                    out[method].append(row)
    return {m: [{k: 1e3 * v for k, v in row.items()} for row in rows] for m, rows in out.items()}


def host_of(row: dict[str, float], names: list[str]) -> float:
    """A step's time outside every stage: its total less the stages' (exclusive) times."""
    return row["total"] - sum(row.get(n, 0.0) for n in names)


def table(results: list[dict], method: str) -> dict[str, float]:
    """Per stage (host: the step outside every stage) the median over steps of its mean over ranks; total: the
    median over steps of the slowest rank's."""
    steps = range(len(results[0][method]))
    names = sorted({k for r in results for row in r[method] for k in row} - {"total"})
    for r in results:
        for row in r[method]:
            if names:
                row["host"] = host_of(row, names)
    row = {"total": statistics.median(max(r[method][s]["total"] for r in results) for s in steps)}
    for name in [*names, "host"] if names else []:
        row[name] = statistics.median(
            statistics.mean(r[method][s].get(name, 0.0) for r in results) for s in steps
        )
    return row


def rank_table(results: list[dict], method: str) -> list[dict[str, float]]:
    """Per rank, per stage (host: the rank's step outside every stage; total: its step), the median over steps of
    that rank's own time: the cells that `table` averages over ranks, each rank apart (a rank that waits on a
    slower one shows its wait in its collectives)."""
    names = sorted({k for r in results for row in r[method] for k in row} - {"total", "host"})
    out = []
    for r in results:
        rows = r[method]
        cells = {"total": statistics.median(row["total"] for row in rows)}
        for name in names:
            cells[name] = statistics.median(row.get(name, 0.0) for row in rows)
        if names:
            cells["host"] = statistics.median(host_of(row, names) for row in rows)
        out.append(cells)
    return out


def print_rank_tables(results: list[dict], table: str) -> None:
    """For each DistributedMuon method (not dion), its stages on each rank (rank_table)."""
    for method in results[0]:
        if method == "dion":
            continue
        ranks = rank_table(results, method)
        names = [s for s in STAGES if s in ranks[0]]
        names += sorted(k for k in ranks[0] if k.startswith("COLL")) + ["host"]
        print(f"\n{table}, W = {len(ranks)}, {method}: stage ms per rank (median over steps)")
        print(f"{'stage':<34}" + "".join(f"{'rank ' + str(r):>10}" for r in range(len(ranks))))
        for name in ["total", *names]:
            if name in ranks[0]:
                print(f"{name:<34}" + "".join(f"{cells[name]:>10.2f}" for cells in ranks))


def print_tables(world_size: int, rows: dict[str, dict[str, float]], table: str = "dense") -> None:
    names = [s for s in STAGES if any(s in r for r in rows.values())]
    names += sorted({k for r in rows.values() for k in r if k.startswith("COLL")}) + ["host"]
    methods = list(rows)
    print(
        f"\n{table}, W = {world_size}: stage ms (mean over ranks, median over steps); total: slowest rank"
    )
    print(f"{'stage':<34}" + "".join(f"{m:>10}" for m in methods))
    for name in ["total", *names]:
        cells = "".join(
            f"{rows[m][name]:>10.2f}" if name in rows[m] else f"{'':>10}" for m in methods
        )
        print(f"{name:<34}{cells}")
    if "dion" in rows:
        ratios = ", ".join(
            f"{m} / dion {rows[m]['total'] / rows['dion']['total']:.2f}" for m in methods[:-1]
        )
        print(f"ratios of totals: {ratios}")
        if "NS" in rows["dion"]:
            floors = ", ".join(
                f"{m} {rows[m]['NS'] / rows['dion']['total']:.2f}"
                for m in methods[:-1]
                if "NS" in rows[m]
            )
            print(f"NS alone / dion's step: {floors}")


def main(argv: list[str] | None = None) -> int:
    from muon_check.launch import RankPool
    from muon_dist.kernels import BACKENDS

    from .run import SETS, header

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dion", metavar="PATH", help="a microsoft/dion checkout: time dion.Muon")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sets", nargs="+", choices=sorted(SETS), default=["dense"])
    parser.add_argument("--ns-backend", choices=sorted(BACKENDS), default="torch")
    parser.add_argument("--rounds", type=int, default=None, help="DistributedMuon's rounds=")
    parser.add_argument(
        "--per-rank",
        action="store_true",
        help="also each DistributedMuon method's stages on each rank (medians over steps)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(header("muon_dist stage profile"))
    for W in args.world_sizes:
        pool = RankPool(W)
        try:
            for name in args.sets:
                results = pool.run(
                    rank_stages,
                    args.dion,
                    W,
                    args.warmup,
                    args.steps,
                    name,
                    args.ns_backend,
                    args.rounds,
                    timeout=600.0,
                )
                print_tables(W, {m: table(results, m) for m in results[0]}, name)
                if args.per_rank:
                    print_rank_tables(results, name)
        finally:
            pool.close()
    return 0
