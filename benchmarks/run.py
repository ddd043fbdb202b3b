"""Benchmarks: DistributedMuon against the field's baselines on gloo ranks, the planner's load balance, memory.

    python -m benchmarks [--quick] [--world-sizes 1 2 4] [--sets dense tiny_moe scaled_moe] [--dion PATH]
                         [--rounds N] [--pipeline-depth N] [--ns-backend torch|triton|gram]
                         [--warmup 2] [--steps 10]
    python -m benchmarks stages [--dion PATH]   the step's time stage by stage (benchmarks/stages.py)
    python -m benchmarks stacking [options]     a set's Newton-Schulz per matrix or stacked (benchmarks/stacking.py)
    python -m benchmarks collectives [options]  gloo's all-gather as a ring and as an all-to-all (benchmarks/collectives.py)
    python -m benchmarks elementwise [--cases N]  which elementwise stages run on a shard as it is (benchmarks/elementwise.py)
    python -m benchmarks gpu [options]    one GPU: optimizer steps and NS kernels (benchmarks/gpu.py, its --help)
    python -m benchmarks sites [options]  what is alive at each rank's memory peak, by site (benchmarks/sites.py)
    python -m benchmarks one-rank [options]  one rank's step beside torch.optim.Muon's, contract by contract
                                             (benchmarks/one_rank.py)

1. Step time and bytes per rank, W ranks on gloo (muon_check.launch.RankPool), fp32 params sharded Shard(0)
   (torch.chunk boxes), preset "torch", for each parameter set's Muon matrices. Methods, all in one run on the
   same pool, steps interleaved (the order rotates every step) so that the machine's load hits all alike:
     distributed        DistributedMuon as it comes: global dispatch (LPT owners, ragged all-to-alls in up to 4
                        pipelined rounds), local experts
     batched            DistributedMuon(dispatch="batched"): same-shape batches of W (packed), AGRS for remainders
     padded_all_to_all  DistributedMuon(remainder="padded_all_to_all"): batched, remainders padded with zero
                        matrices (xtuner, Dion)
     full_tensor        (a) all-gather every direction, NS on every rank (LlamaFactory v2, muonium)
     gather_scatter     (c) gather to owner i mod W, NS, scatter (samsja muon_fsdp2)
   and the peers of benchmarks/peers.py, timed beside them (torch.optim.Muon on the sets of 2-D matrices only):
     torch_muon         torch.optim.Muon (at W = 1 on the whole tensors, compared bit for bit; at W > 1 on the
                        DTensors as they are)
     dion               dion.Muon, Polar Express off, given --dion PATH (a microsoft/dion checkout) or an
                        installed dion package; its own conventions, never compared
   A line per set and W prints the ratios of DistributedMuon's modes to the peers of the same run.
   Step time: a barrier, then opt.step(); per step the slowest rank's time; the median over the steps after
   warm-up. CPU: the process CPU time of each rank's step (time.process_time, all its threads), the mean over
   ranks, the median over the same steps: where W ranks share fewer cores the step time follows it. Bytes: this rank's sent bytes of the last step (DistributedMuon: its comm ledger; baselines:
   benchmarks.counting), the mean over ranks; DistributedMuon's plan-digest, non-finite-flag and failure-check all-gathers are
   listed apart as control bytes. Bound: muon_check.verify's lower bound per rank. Every method's params after
   all the steps are compared with muon_ref.Muon's on the full tensors, bit for bit.
2. Load balance of the planner on dense_7b and moe_30b_a3b for W = 8..1024 (benchmarks.balance_table).
3. Peak extra memory per rank during a step of each method: the median of 3 more steps (after one more,
   unmeasured, under the same profiler), the max over ranks (benchmarks.memory: measured with torch.profiler's
   memory events, each step after a garbage collection and with the cyclic collector off, after validating the
   method on known allocation patterns). The profiler sees the thread that runs it only: a method whose tensors
   are freed or allocated on a collective's worker thread reads otherwise from step to step (named under the
   table when its readings lie more than 1% apart). So beside it, the peak extra resident memory of a step, every
   thread's (Linux with glibc: benchmarks.memory.resident_peak_extra_bytes, on fresh ranks spawned with glibc's
   mmap threshold fixed, each method on fresh params, 2 unmeasured steps and the median of 3, max over ranks):
   the "resident peak" ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Protocol

import torch

import muon_ref
from muon_check.fixtures import box_of, distribute, same_bits, seeded
from muon_check.shapes import ParamSpec, tiny_moe, transformer
from muon_dist.geometry import chunk_bounds
from muon_dist.kernels import BACKENDS, direction_bytes
from muon_dist.paths import PATHS
from muon_ref.optim import group_config
from muon_ref.presets import preset_defaults

from . import balance_table, memory, peers

# compared with muon_ref bit for bit in every run; the peers (benchmarks.peers) are timed beside them
DISTRIBUTED_METHODS = (
    "distributed",
    "batched",
    "padded_all_to_all",
)  # DistributedMuon's, under --ns-backend
METHODS = (*DISTRIBUTED_METHODS, "full_tensor", "gather_scatter")
MEMORY_STEPS = 3


def scaled_moe() -> list[ParamSpec]:
    """tiny_moe's structure with sizes about 5x larger, so that an NS run is not negligible next to a collective:
    measured on an x86 CPU (torch 2.13.0) on one thread in bf16 (under load), NS of a 128 x 128 matrix took 6.4 ms and of 128 x 352 14.5 ms,
    against under 1 ms for tiny_moe's; still uneven (34 rows on 4 ranks)."""
    return transformer(
        layers=3,
        hidden=136,
        heads=4,
        kv_heads=1,
        head_dim=34,
        ffn=360,
        vocab=97,
        experts=4,
        expert_ffn=72,
        moe_every=2,
    )


def dense() -> list[ParamSpec]:
    """A dense transformer with d = 256 and ff = 1024, 4 layers: 28 Muon matrices (256 x 256 and 1024 x 256)."""
    return transformer(layers=4, hidden=256, heads=4, kv_heads=4, head_dim=64, ffn=1024, vocab=512)


def tiny_dense() -> list[ParamSpec]:
    """dense's structure at d = 32, ff = 64, 2 layers (the smoke test's set of 2-D matrices)."""
    return transformer(layers=2, hidden=32, heads=2, kv_heads=2, head_dim=16, ffn=64, vocab=64)


SETS = {"tiny_moe": tiny_moe, "scaled_moe": scaled_moe, "dense": dense, "tiny_dense": tiny_dense}


@dataclass(frozen=True)
class Bench:
    """One benchmark run on W ranks: a parameter set, warm-up and timed steps, the preset."""

    table: str
    world_size: int
    warmup: int
    steps: int
    preset: str = "torch"
    seed: int = 0
    dion: str | None = None  # a microsoft/dion checkout: time dion.Muon beside the others
    rounds: int | None = None  # DistributedMuon's rounds= (None: its default)
    pipeline_depth: int | None = None  # DistributedMuon's pipeline_depth= (None: its default)
    memory_budget: int | None = None  # DistributedMuon's memory_budget= (None: its default)
    ns_backend: str = "torch"  # DistributedMuon's ns_backend= (muon_dist.kernels.BACKENDS)

    @property
    def methods(self) -> tuple[str, ...]:
        """METHODS, and the peers: torch.optim.Muon on a set of 2-D matrices (it takes no 3-D stack), dion.Muon
        on every set given a checkout (a 3-D expert stack as a batch of matrices, its default flatten=False)."""
        two_d = all(len(s.shape) == 2 for s in muon_specs(self.table))
        return METHODS + (("torch_muon",) if two_d else ()) + (("dion",) if self.dion else ())

    def compared(self, method: str) -> bool:
        """Whether the method's result is compared with muon_ref's (benchmarks.peers: torch.optim.Muon at W = 1)."""
        return method in METHODS or (method == "torch_muon" and self.world_size == 1)

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps


def muon_specs(table: str) -> list[ParamSpec]:
    return [s for s in SETS[table]() if s.is_muon]


def initial(b: Bench) -> list[torch.Tensor]:
    return [seeded(s.shape, b.seed * 7919 + i) for i, s in enumerate(muon_specs(b.table))]


def gradients(b: Bench, step: int) -> list[torch.Tensor]:
    return [
        seeded(s.shape, b.seed * 104729 + 1000 * step + i + 1)
        for i, s in enumerate(muon_specs(b.table))
    ]


# ------------------------------------------------------------------------------------------------ ranks


def shard(full: torch.Tensor) -> torch.Tensor:
    """This rank's Shard(0) box of `full` as a DTensor on a 1-D mesh of the world (as FSDP2 holds it)."""
    return distribute(full, "S0", "fsdp")


class Method(Protocol):
    """What the benchmark needs of an optimizer: one step on the params' current grads."""

    def step(self) -> object: ...


def make(method: str, params: list[torch.Tensor], names: list[str], b: Bench) -> Method:
    from muon_dist.optim import DistributedMuon

    from . import peers
    from .baselines import FullTensorMuon, GatherScatterMuon
    from .counting import CountingCollectives

    preset = b.preset
    if method == "torch_muon":
        return peers.torch_muon(params, b.world_size)
    if method == "dion":
        return peers.dion_muon(peers.load_dion(b.dion), params)

    if method in DISTRIBUTED_METHODS:
        options = {
            "padded_all_to_all": {"remainder": "padded_all_to_all"},
            "batched": {"dispatch": "batched"},
        }
        return DistributedMuon(
            [{"params": params, "param_names": names}],
            preset=preset,
            ns_backend=b.ns_backend,
            rounds=b.rounds,
            pipeline_depth=b.pipeline_depth,
            # (a budget sets global dispatch's rounds: the batched methods take none)
            memory_budget=None if method in options else b.memory_budget,
            **options.get(method, {}),
        )
    cls = FullTensorMuon if method == "full_tensor" else GatherScatterMuon
    return cls(params, names, preset, CountingCollectives())


def step_bytes(opt: Method) -> tuple[int, int, int] | None:
    """(data bytes, control bytes, data collectives) of this rank in the optimizer's last step (None: a peer,
    not counted)."""
    if not hasattr(opt, "comm"):
        return None
    if hasattr(opt, "last_report"):
        ledger = opt.last_report.bytes_by_path
        data = sum(sent for path, (sent, _) in ledger.items() if path in PATHS)
        collectives = sum(1 for path, *_ in opt.comm.calls if path in PATHS)
        return data, sum(sent for _, (sent, _) in ledger.items()) - data, collectives
    return opt.comm.sent, 0, opt.comm.collectives


def set_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        p.grad = shard(g)


def rank_bench(b: Bench) -> dict:
    """Every method's steps, interleaved; per method: step times, bytes, final shards, peak extra memory."""
    import torch.distributed as dist

    names = [s.name for s in muon_specs(b.table)]
    methods = b.methods
    params = {m: [shard(t) for t in initial(b)] for m in methods}
    opts = {m: make(m, params[m], names, b) for m in methods}
    times: dict[str, list[float]] = {m: [] for m in methods}
    cpu: dict[str, list[float]] = {m: [] for m in methods}
    for step in range(b.total_steps):
        grads = gradients(b, step)
        for k in range(len(methods)):
            method = methods[(step + k) % len(methods)]
            set_grads(params[method], grads)
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            opts[method].step()
            times[method].append(time.perf_counter() - start)
            cpu[method].append(time.process_time() - start_cpu)
    out = {
        "times": times,
        "cpu": cpu,
        "bytes": {m: step_bytes(opts[m]) for m in methods},
        "shards": {m: [p.detach().to_local().clone() for p in params[m]] for m in methods},
        "paths": sorted({p for _, p in opts["distributed"].last_report.paths if p}),
    }
    out["peak_readings"] = {m: peak_readings(b, params[m], opts[m]) for m in methods}
    out["peak_bytes"] = {m: int(statistics.median(out["peak_readings"][m])) for m in methods}
    return out


RESIDENT_WARMUP = 2


def rank_resident(b: Bench) -> dict:
    """On a rank spawned with memory.RESIDENT_ENV: the resident method validated on its threaded pattern, then
    each method on fresh params, RESIDENT_WARMUP unmeasured steps and MEMORY_STEPS read
    (memory.resident_peak_extra_bytes: every thread's pages, which the profiler's reading is not)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    validated = memory.validate_resident()
    names = [s.name for s in muon_specs(b.table)]
    readings = {}
    for method in b.methods:
        params = [shard(t) for t in initial(b)]
        opt = make(method, params, names, b)

        def prepare(k: int, params: list[torch.Tensor] = params) -> None:
            set_grads(params, gradients(b, k))
            dist.barrier()

        readings[method] = memory.resident_peak_extra_bytes(
            opt.step, prepare, MEMORY_STEPS, RESIDENT_WARMUP
        )
        del opt, params
    return {"validated": validated, "readings": readings}


def resident_results(b: Bench, timeout: float) -> list[dict] | str:
    """rank_resident on W fresh ranks spawned with memory.RESIDENT_ENV, or why the platform has no such reading."""
    from muon_check.launch import RankPool

    with memory.resident_environment():
        why_not = memory.resident_unavailable()
        if why_not:
            return why_not
        pool = RankPool(b.world_size, start_method="spawn")
        try:
            return pool.run(rank_resident, b, timeout=timeout)
        finally:
            pool.close()


def peak_readings(b: Bench, params: list[torch.Tensor], opt: Method) -> list[int]:
    """A step's peak extra memory on this rank in each of MEMORY_STEPS more steps (benchmarks.memory); the
    benchmark takes their median. The profiler sees one thread's allocations: a method whose tensors are freed or
    allocated on another thread (a collective's worker) reads otherwise from step to step, which
    unsettled_peaks reports."""
    import torch.distributed as dist

    def prepare(k: int) -> None:
        set_grads(params, gradients(b, b.total_steps + k))
        dist.barrier()

    return memory.peak_extra_bytes(opt.step, prepare, MEMORY_STEPS)


# ----------------------------------------------------------------------------------------------- parent


def reference(b: Bench) -> list[torch.Tensor]:
    """muon_ref.Muon on the full tensors for all of the run's steps."""
    params = [torch.nn.Parameter(t) for t in initial(b)]
    opt = muon_ref.Muon(
        [{"params": params, "param_names": [s.name for s in muon_specs(b.table)]}], preset=b.preset
    )
    for step in range(b.total_steps):
        for p, g in zip(params, gradients(b, step)):
            p.grad = g
        opt.step()
    return [p.detach() for p in params]


def equals_reference(results: list[dict], method: str, want: list[torch.Tensor]) -> bool:
    """Every rank's shard of every param is bitwise its box of the reference."""
    W = len(results)
    return all(
        same_bits(got, box_of(full, "S0", "fsdp", rank, W))
        for rank, result in enumerate(results)
        for got, full in zip(result["shards"][method], want)
    )


NAN = float("nan")
PEER_COLUMNS = (
    ("step_ms", "step"),
    ("peak_bytes", "peak memory"),
    ("resident_peak_bytes", "resident peak"),
)

# bf16 updates (the "torch" preset's ns_dtype); a direction element's bytes: muon_dist.kernels.direction_bytes (bf16 for a
# preset whose kernel casts the fp32 direction to bf16 first, as "torch" does)
UPDATE_BYTES = 2


def holders(spec: ParamSpec, world_size: int) -> int:
    """How many ranks hold a piece of one matrix of the param: 1 for an [E, m, n] expert (dim 0 is the expert
    index, never split), else the ranks with a non-empty Shard(0) box."""
    if spec.num_experts:
        return 1
    return sum(1 for r in range(world_size) if chunk_bounds(spec.shape[0], world_size, r)[1] > 0)


def bound_per_rank(b: Bench) -> float:
    """muon_check.verify's lower bound: sum over matrices of (p - 1) / p * S * (b_direction + b_update) / W, with p
    the ranks holding a piece of the matrix and S its element count (proofs/paths.md#a2a)."""
    total = 0.0
    for spec in muon_specs(b.table):
        *experts, fan_out, fan_in = spec.shape
        p = holders(spec, b.world_size)
        total += (
            (experts[0] if experts else 1)
            * (p - 1)
            / p
            * fan_out
            * fan_in
            * (
                direction_bytes(group_config(preset_defaults(b.preset, {})), torch.float32)
                + UPDATE_BYTES
            )
            / b.world_size
        )
    return total


def traffic(results: list[dict], method: str) -> dict[str, float]:
    """The method's byte columns (NaN for a peer: its collectives are not counted)."""
    counted = [r["bytes"][method] for r in results]
    if any(c is None for c in counted):
        return dict.fromkeys(("sent_per_rank", "max_sent", "control_per_rank", "collectives"), NAN)
    return {
        "sent_per_rank": statistics.mean(c[0] for c in counted),
        "max_sent": max(c[0] for c in counted),
        "control_per_rank": statistics.mean(c[1] for c in counted),
        "collectives": max(c[2] for c in counted),
    }


def summarise(
    b: Bench,
    results: list[dict],
    want: list[torch.Tensor],
    resident: list[dict] | str | None = None,
) -> list[dict]:
    """One row per method; equal_muon_ref is None for a method not compared (Bench.compared). resident:
    resident_results' per-rank readings (the resident_peak_bytes column: the largest rank median; NaN without)."""
    rows = []
    for method in b.methods:
        timed = range(b.warmup, b.total_steps)
        slowest = [max(r["times"][method][s] for r in results) for s in timed]
        cpu = [statistics.mean(r["cpu"][method][s] for r in results) for s in timed]
        rows.append(
            {
                "table": b.table,
                "world_size": b.world_size,
                "method": method,
                "step_ms": 1e3 * statistics.median(slowest),
                "step_ms_min": 1e3 * min(slowest),
                "step_ms_max": 1e3 * max(slowest),
                "cpu_ms": 1e3 * statistics.median(cpu),
                **traffic(results, method),
                "bound_per_rank": bound_per_rank(b),
                "equal_muon_ref": equals_reference(results, method, want)
                if b.compared(method)
                else None,
                "peak_bytes": max(r["peak_bytes"][method] for r in results),
                "resident_peak_bytes": max(
                    statistics.median(r["readings"][method]) for r in resident
                )
                if isinstance(resident, list)
                else NAN,
                "peak_min_bytes": min(min(r["peak_readings"][method]) for r in results),
                "peak_max_bytes": max(max(r["peak_readings"][method]) for r in results),
            }
        )
    return rows


def verdict(equal: bool | None) -> str:
    return "not comp." if equal is None else "bitwise" if equal else "DIFFERS"


def print_resident(rows: list[dict], resident: list[dict] | str) -> None:
    """The resident peaks of a table's methods, or why there are none."""
    if isinstance(resident, str):
        print(f"resident peaks: {resident}")
        return
    validated = max(r["validated"] for r in resident)
    print(
        f"resident peak KiB, every thread's (fresh ranks spawned with glibc's mmap threshold at 64 KiB; median of "
        f"{MEMORY_STEPS} steps after {RESIDENT_WARMUP}, max over ranks; the method read "
        f"{validated / 1024:,.0f} KiB on a 6,144 KiB pattern, 2,048 on a second thread): "
        + ", ".join(f"{r['method']} {r['resident_peak_bytes'] / 1024:,.0f}" for r in rows)
    )


def print_steps(
    b: Bench, rows: list[dict], paths: list[str], resident: list[dict] | str | None = None
) -> None:
    base = rows[0]
    padded = next(r for r in rows if r["method"] == "padded_all_to_all")["peak_bytes"]
    print(
        f"\n{b.table}, W = {b.world_size}: {len(muon_specs(b.table))} Muon params; step: median of {b.steps} steps "
        f"after {b.warmup} warm-up (slowest rank per step); peak: extra memory during a step (median of "
        f"{MEMORY_STEPS} steps, max over ranks); cpu: the process CPU time of a rank's step, all its threads (mean "
        f"over ranks, median over the steps; where ranks share cores the step follows it); DistributedMuon's "
        f"paths: {', '.join(paths)}"
    )
    head = (
        f"{'method':<18} {'step ms':>8} {'[min, max]':>15} {'x dist':>6} {'cpu ms':>7} {'sent B/rank':>11} {'x dist':>6} "
        f"{'max B':>9} {'bound B':>9} {'control B':>9} {'colls':>5} {'peak KiB':>9} {'x padded':>8} {'= muon_ref':>10}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        spread = f"[{r['step_ms_min']:.1f}, {r['step_ms_max']:.1f}]"
        bytes_ratio = (
            r["sent_per_rank"] / base["sent_per_rank"] if base["sent_per_rank"] else float("nan")
        )
        print(
            f"{r['method']:<18} {r['step_ms']:>8.1f} {spread:>15} {r['step_ms'] / base['step_ms']:>6.2f} "
            f"{r['cpu_ms']:>7.1f} {r['sent_per_rank']:>11.0f} {bytes_ratio:>6.2f} {r['max_sent']:>9.0f} {r['bound_per_rank']:>9.0f} "
            f"{r['control_per_rank']:>9.0f} {r['collectives']:>5.0f} {r['peak_bytes'] / 1024:>9.1f} "
            f"{r['peak_bytes'] / padded:>8.2f} {verdict(r['equal_muon_ref']):>10}"
        )
    if resident is not None:
        print_resident(rows, resident)
    moved = unsettled_peaks(rows)
    if moved:
        print(
            f"peak readings more than {PEAK_SETTLED:.0%} apart over steps and ranks (a ratio with these is not "
            "settled): " + "; ".join(moved)
        )
    print_ratios(rows)


# peak readings of one method further apart than this (relative to the least) are reported as unsettled (a
# settled DistributedMuon step's readings differ by under 0.1 KiB on the benchmark's sets)
PEAK_SETTLED = 0.01


def unsettled_peaks(rows: list[dict]) -> list[str]:
    """'method min-max KiB' for each row whose peak readings (every rank, every measured step) lie more than
    PEAK_SETTLED apart."""
    return [
        f"{r['method']} {r['peak_min_bytes'] / 1024:,.0f}-{r['peak_max_bytes'] / 1024:,.0f} KiB"
        for r in rows
        if r["peak_max_bytes"] > (1 + PEAK_SETTLED) * r["peak_min_bytes"]
    ]


def print_ratios(rows: list[dict]) -> None:
    """DistributedMuon's modes against the peers of the same run: step time, and peak memory against
    torch.optim.Muon's."""
    by = {r["method"]: r for r in rows}
    parts = [
        f"{mine} / {peer} {what} {by[mine][key] / by[peer][key] if by[peer][key] else NAN:.2f}"
        for peer, pairs in (
            ("dion", (("step_ms", "step"), ("cpu_ms", "cpu"))),
            ("torch_muon", PEER_COLUMNS),
        )
        if peer in by
        for key, what in pairs
        for mine in ("distributed", "batched")
    ]
    if parts:
        print("ratios of this run: " + "; ".join(parts))


def load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def header(title: str) -> str:
    """The first line of a benchmark's output: date, torch, CPU and its capability, load."""
    return (
        f"{title}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
        f"{platform.machine()} CPU ({torch.backends.cpu.get_cpu_capability()}), {os.cpu_count()} cores, "
        f"gloo, 1 intra-op thread per rank; load average {load_average()} (other jobs share the cores: "
        f"step times are noisy, compare ratios within a run)"
    )


def validated() -> str:
    """The line that says the memory method read its known allocation patterns right (memory.validate)."""
    return (
        f"memory method validated on known allocation patterns (one after garbage): peak {memory.validate()} B "
        "of 6,000 B"
    )


def main(argv: list[str] | None = None) -> int:
    from muon_check.launch import RankPool

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke size: tiny_moe, W = 2, 1 + 2 steps, W <= 64"
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="DistributedMuon's rounds= for its methods (default: DistributedMuon's own)",
    )
    parser.add_argument(
        "--pipeline-depth",
        type=int,
        default=None,
        help="DistributedMuon's pipeline_depth= for its methods: batches in flight at once (default: "
        "DistributedMuon's own, 3)",
    )
    parser.add_argument(
        "--memory-budget",
        type=int,
        default=None,
        metavar="BYTES",
        help="DistributedMuon's memory_budget= for its global-dispatch method (distributed): bytes per rank for "
        "the communication buffers of the batches in flight (default: DistributedMuon's own)",
    )
    parser.add_argument(
        "--ns-backend",
        choices=sorted(BACKENDS),
        default="torch",
        help="DistributedMuon's ns_backend= for its methods (default torch, bitwise; another backend's results "
        "differ from muon_ref within its stated tolerance and are listed, not counted as failures)",
    )
    parser.add_argument(
        "--sets", nargs="+", choices=sorted(SETS), default=["dense", "tiny_moe", "scaled_moe"]
    )
    parser.add_argument(
        "--dion",
        metavar="PATH",
        default=peers.installed_dion(),
        help="a microsoft/dion checkout: time dion.Muon beside the others (default: an installed dion "
        "package, if any)",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", metavar="FILE", help="write every row as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.world_sizes, args.sets, args.warmup, args.steps = [2], ["tiny_moe"], 1, 2
    balance_sizes = [2**k for k in range(3, 7 if args.quick else 11)]
    torch.set_num_threads(1)
    start = time.perf_counter()
    print(header("muon_dist benchmarks"))
    print(validated())
    step_rows, failures = [], []
    for W in args.world_sizes:
        pool = RankPool(W)
        try:
            for table in args.sets:
                b = Bench(
                    table,
                    W,
                    args.warmup,
                    args.steps,
                    dion=args.dion,
                    rounds=args.rounds,
                    pipeline_depth=args.pipeline_depth,
                    memory_budget=args.memory_budget,
                    ns_backend=args.ns_backend,
                )
                results = pool.run(rank_bench, b, timeout=args.timeout)
                resident = resident_results(b, args.timeout)
                rows = summarise(b, results, reference(b), resident)
                print_steps(b, rows, results[0]["paths"], resident)
                differing = [
                    f"{table} W={W} {r['method']}" for r in rows if r["equal_muon_ref"] is False
                ]
                if BACKENDS[args.ns_backend]().bitwise:
                    failures += differing
                else:  # DistributedMuon's methods within the backend's tolerance, not bitwise by contract
                    failures += [d for d in differing if d.split()[-1] not in DISTRIBUTED_METHODS]
                step_rows += rows
        finally:
            pool.close()
    load_rows = balance_table.rows(balance_sizes)
    balance_table.print_rows(load_rows)
    print(
        f"\nwall time {time.perf_counter() - start:.1f} s; load average at the end {load_average()}; "
        f"results differing from muon_ref: {failures or 'none'}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": step_rows, "balance": load_rows}, f, indent=1)
    return 1 if failures else 0
