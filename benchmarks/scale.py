"""The planner at scale, from the plan alone (no ranks started): per-rank Newton-Schulz FLOPs, traffic, padding,
buffers and collectives of DistributedMuon's dispatch modes beside the schemes of xtuner, Dion and FSDP-Canzona,
for the parameter shapes of real models at W = 8 to 1024.

    python -m benchmarks scale [--models NAME ...] [--world-sizes 8 16 ... 1024] [--json PATH]
    python -m benchmarks scale --check [--world-sizes 2 4]   DistributedMuon's figures against gloo ranks

Setting, every scheme alike: a model's Muon matrices (muon_check.shapes: q/k/v/o, router, the MLP or the expert
stacks [E, m, n]; embeddings and head go to AdamW) as fp32 params sharded Shard(0) over a 1-D mesh of W ranks
(torch.chunk boxes, as FSDP2 makes them), directions and updates moved in bf16 (2 bytes each way: preset "torch"),
each matrix costed by muon_dist.balance.ns_flops (5 steps). A stack's dim 0 is its expert index, so every rank's
box holds whole experts.

Schemes:
  distributed  DistributedMuon as it comes (dispatch="global", rounds by size, 4 on these models, and more where
               the default memory budget needs them): its own plan (muon_dist.plan.plan), the figures from each
               path's record (muon_dist.expected_bytes, expected_flops, expected_collectives, buffer_bytes)
  batched      DistributedMuon(dispatch="batched")
  xtuner       xtuner's Muon with remainder_strategy="pad_all2all", not its default "agrs" (the padded batches of
               W the comparison is about; AGRS remainders are the batched row's scheme) (InternLM/xtuner PR 1716 at b934f462,
               xtuner/v1/optim/muon.py: muon_update_batch_async, _all_to_all_orthogonalize): same-shape params in
               batches of W, member k orthogonalises param k, a remainder padded with zero matrices to W; shards
               padded to ceil(rows / W) rows; one all_to_all_single each way per batch. Experts as its fused
               [E m, n] params (muon.py:668-690): E % W == 0, each rank its own experts, no exchange; W % E == 0
               with fewer such params than W, one all-gather per param in each expert's sub-group of W / E ranks,
               every member of which runs the expert; else the batches above
  dion         dion.Muon (microsoft/dion at 0a059a4, dion/megabatch_base.py, megabatch_orthogonalize_async): all
               same-shape params (a stack is one) in one batch, padded with zero matrices to a multiple of W, rank
               r orthogonalising the r-th run of N' / W; shards padded to ceil(rows / W); one all_to_all each way
               per shape
  canzona      FSDP-Canzona (liangyuwang/FSDP-Canzona at 13a92059, load_balanced_fsdp_executor.py) with its
               defaults, balance "global" and cost "numel": params (a stack is one) largest first, grown into
               micro-groups while the mean and the largest LPT rank load stay under max_numel_per_slot (400 Mi
               elements), each partitioned over the ranks by LPT; per micro-group a fused all_to_all each way and
               one of one-byte skip flags (counted); shards as torch.chunk cuts them (its code assumes even ones)
Every scheme's elements count 2 bytes here (DistributedMuon's bf16 directions and updates); a scheme that moves
its momentum or gradient in fp32 moves up to twice these bytes.
Figures, per step:
  flops max/mean  the busiest rank's NS FLOPs over the mean (1.00: balanced; zero matrices count as work)
  TF max          the busiest rank's NS FLOPs, in TFLOP
  GB/rank max     the most bytes a rank sends (directions out and updates back; collectives of control excluded)
  x bound         the mean bytes per rank over the lower bound per rank: per matrix of S elements whose largest
                  piece holds p, (S - p)(2 + 2) / W (muon_check.verify.lower_bound_per_rank's bound; a stack's
                  experts lie whole on a rank each: nothing to move)
  pad %           padding moved (zero matrices, padded rows) over all elements moved
  buf GB          the busiest rank's send and receive buffers of its largest batch (DistributedMuon: times the
                  batches in flight, min(3, batches): muon_dist.buffer_bytes, the model its memory budget
                  bounds): a model of its extra peak for communication, not measured
  colls           collectives per step on every rank (DistributedMuon: with its plan-digest and failure-check
                  all-gathers)
The peers' rows are predictions from reading the code cited, made before any run and never run at these W.
--check runs DistributedMuon on gloo ranks at the given W on benchmarks.run's tiny_moe, scaled_moe and dense sets
and asserts that each rank's bytes sent, NS FLOPs (counted at its backend) and collectives equal its plan's
figures here; the other schemes are models of the code cited, not run, and buf GB is not measured.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from muon_check.fixtures import count_kernel_flops, distribute, seeded
from muon_check.rules import param_flops
from muon_check.shapes import ParamSpec, dense_70b, moe_30b_a3b, moe_235b_a22b
from muon_dist import (
    DistributedMuon,
    Entry,
    Options,
    ParamLayout,
    buffer_bytes,
    expected_bytes,
    expected_collectives,
    expected_flops,
    plan,
)
from muon_dist.agreement import CHECKS, write_groups
from muon_dist.balance import lpt, ns_flops
from muon_dist.batch import Batch
from muon_dist.geometry import chunk_bounds
from muon_dist.paths import PATHS

MODELS = {"qwen3_30b_a3b": moe_30b_a3b, "qwen3_235b_a22b": moe_235b_a22b, "llama3_70b": dense_70b}
WORLD_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
SCHEMES = ("distributed", "batched", "xtuner", "dion", "canzona")
BYTES = 2  # per element moved, each way (bf16 directions and updates)
ITEMSIZES = {"torch.float32": 4, "torch.bfloat16": 2}
CANZONA_SLOT = (
    400 * 1024 * 1024
)  # max_numel_per_slot's default (FSDP_CANZONA_FUSE_SPACE_MB = 400, times 2^20)


@dataclass
class Tally:
    """One scheme's figures on one model at one W: per rank FLOPs, bytes sent and largest-batch buffers; padding
    elements and all elements moved; collectives per rank (the most any rank calls)."""

    W: int
    flops: list[int] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)
    buffer: list[int] = field(default_factory=list)
    padded: int = 0
    moved: int = 0
    collectives: int = 0
    rank_collectives: list[int] = field(default_factory=list)  # DistributedMuon's, rank by rank

    def __post_init__(self) -> None:
        self.flops, self.sent, self.buffer = [0] * self.W, [0] * self.W, [0] * self.W


def lower_bound(specs: list[ParamSpec], W: int) -> float:
    """Bytes per rank no scheme beats (module docstring): per matrix, the elements its largest piece lacks, each
    way. A stack's experts lie whole on one rank each (dim 0 is the expert index): nothing to move."""
    total = 0
    for spec in specs:
        if len(spec.shape) == 2:
            rows, cols = spec.shape
            total += (rows - chunk_bounds(rows, W, 0)[1]) * cols * 2 * BYTES
    return total / W


def row_size(spec: ParamSpec) -> int:
    return math.prod(spec.shape[1:])


def entries_of(specs: list[ParamSpec], W: int) -> tuple[Entry, ...]:
    """DistributedMuon's entries for the specs as fp32 Shard(0) params of a 1-D mesh of W, bf16 on the wire."""
    return tuple(
        Entry(
            ParamLayout(s.name, s.shape, "torch.float32", tuple(range(W)), ("S0",), ("fsdp",)),
            0,
            "torch.bfloat16",
            True,
            "torch.bfloat16",
        )
        for s in specs
    )


def distributed(specs: list[ParamSpec], W: int, options: Options) -> Tally:
    """DistributedMuon's plan, with the figures of its paths' records."""
    step_plan, tally = plan(entries_of(specs, W), options), Tally(W)
    batches = step_plan.batches
    free = [W == 1 or (PATHS[b.path].carries_flag and b.group_size == W) for b in batches]
    ends = {id(g[-1]) for g in write_groups(step_plan, False, free)}
    checks = sum(1 for b, f in zip(batches, free) if id(b) in ends and not f)
    per_rank_colls = [
        1 + checks
    ] * W  # the plan digest; the failure checks no data collective carries
    for batch in batches:
        tally.padded += _padding(batch)
    for rank in range(W):
        per_rank_colls[rank] += sum(expected_collectives(step_plan, rank).values())
        tally.flops[rank] = expected_flops(step_plan, rank)
        tally.sent[rank] = sum(s for s, _ in expected_bytes(step_plan, rank, ITEMSIZES).values())
        tally.buffer[rank] = buffer_bytes(step_plan, rank, ITEMSIZES)
    tally.moved = sum(tally.sent) // BYTES
    tally.rank_collectives, tally.collectives = per_rank_colls, max(per_rank_colls)
    return tally


def _padding(batch: Batch) -> int:
    """Elements of padding a batch moves over all ranks: padded_all_to_all's zero matrices, and the boxes that
    agrs and subgroup_all_gather pad to the largest box of their collective."""
    g, R = batch.geometries[0], len(batch.params)
    sizes, total = g.sizes, sum(g.sizes)
    if batch.path == "padded_all_to_all":
        return len(g.groups) * sum(2 * (total - sizes[o]) for o in range(R, batch.group_size))
    if batch.path == "agrs":
        return len(g.groups) * 2 * (batch.group_size - 1) * R * sum(max(sizes) - x for x in sizes)
    if batch.path == "subgroup_all_gather":
        comps = [c for c in g.components if len(c) > 1]
        width = {c: max(sizes[j] for j in c) for c in comps}
        return len(g.groups) * sum(
            (len(c) - 1) * R * (width[c] - sizes[j]) for c in comps for j in c
        )
    return 0


def _owner_batch(
    tally: Tally, batch: list[ParamSpec | None], spec: ParamSpec, owners: list[int]
) -> None:
    """A batch of same-shape params (None: a zero matrix) exchanged with shards padded to ceil(rows / W) rows:
    every rank sends its padded shard of each param owned by another rank and gets the updates back; owner
    owners[k] orthogonalises param k (a zero matrix costs as a real one)."""
    W, rows = tally.W, spec.shape[0]
    shard = math.ceil(rows / W) * row_size(spec)
    per_pair = defaultdict(int)  # elements rank j sends to owner o, each way
    for k, o in enumerate(owners):
        tally.flops[o] += param_flops(spec)
        per_pair[o] += shard
        if batch[k] is None:
            tally.padded += 2 * (W - 1) * shard
        else:
            true = [chunk_bounds(rows, W, r)[1] * row_size(spec) for r in range(W)]
            tally.padded += 2 * ((W - 1) * shard - (sum(true) - true[o]))
    for r in range(W):
        out = sum(n for o, n in per_pair.items() if o != r)  # my shards of others' params
        back = (W - 1) * per_pair.get(r, 0)  # the updates of my params, to every other rank
        tally.sent[r] += (out + back) * BYTES
        tally.buffer[r] = max(tally.buffer[r], 2 * (out + back) * BYTES)
    tally.moved += 2 * (W - 1) * sum(per_pair.values())
    tally.collectives += 2


def by_shape(specs: list[ParamSpec]) -> dict[tuple, list[ParamSpec]]:
    groups: dict[tuple, list[ParamSpec]] = defaultdict(list)
    for s in specs:
        groups[(s.shape, s.kind)].append(s)
    return groups


def xtuner(specs: list[ParamSpec], W: int) -> Tally:
    """xtuner's pad_all2all (module docstring): batches of W same-shape params, member k owns param k; expert
    stacks by its expert rule (muon.py:668-690): E % W == 0, each rank its own experts; W % E == 0 with fewer
    such params than W, each expert all-gathered in its sub-group of W / E ranks, each of which runs it."""
    tally = Tally(W)
    for group in by_shape(specs).values():
        E = group[0].shape[0] if len(group[0].shape) == 3 else 1
        if E > 1 and (E % W == 0 or (W % E == 0 and len(group) < W)):
            _xtuner_experts(tally, group, E)
            continue
        for start in range(0, len(group), W):
            real = group[start : start + W]
            batch = real + [None] * (W - len(real))
            _owner_batch(tally, batch, real[0], list(range(W)))
    return tally


def _xtuner_experts(tally: Tally, group: list[ParamSpec], E: int) -> None:
    """xtuner's expert stacks without exchange (E % W == 0) or by sub-group all-gather (W % E == 0)."""
    W, expert = tally.W, ns_flops(*group[0].shape[1:])
    for _ in group:
        if E % W == 0:
            for r in range(W):
                tally.flops[r] += E // W * expert
            continue
        k, elements = W // E, math.prod(group[0].shape[1:])
        piece = math.ceil(elements / k)  # (rows of one expert cut over its k ranks; even here)
        for r in range(W):
            tally.flops[r] += expert
            tally.sent[r] += (k - 1) * piece * BYTES
            tally.buffer[r] = max(tally.buffer[r], 2 * (k - 1) * piece * BYTES)
        tally.moved += W * (k - 1) * piece
        tally.collectives += 1


def dion(specs: list[ParamSpec], W: int) -> Tally:
    """dion's megabatch (module docstring): one batch per shape, padded to a multiple of W, rank-major owners."""
    tally = Tally(W)
    for group in by_shape(specs).values():
        total = math.ceil(len(group) / W) * W
        batch = group + [None] * (total - len(group))
        _owner_batch(tally, batch, group[0], [k // (total // W) for k in range(total)])
    return tally


def canzona(specs: list[ParamSpec], W: int) -> Tally:
    """FSDP-Canzona's global balance (module docstring) with its default cost, numel: micro-groups of params
    partitioned over the ranks by LPT, each a fused all_to_all each way and one of flags."""
    tally = Tally(W)
    items = sorted(((math.prod(s.shape), i) for i, s in enumerate(specs)), reverse=True)
    groups, current = [], []
    for item in items:
        candidate = current + [item]
        loads = _loads([c for c, _ in candidate], W)
        if current and (
            sum(c for c, _ in candidate) / W > CANZONA_SLOT or max(loads) > CANZONA_SLOT
        ):
            groups.append(current)
            current = [item]
        else:
            current = candidate
    groups += [current] if current else []
    for group in groups:
        owners = lpt([c for c, _ in group], W)
        out, back = [0] * W, [0] * W
        for (_, i), o in zip(group, owners):
            spec = specs[i]
            tally.flops[o] += param_flops(spec)
            shards = [chunk_bounds(spec.shape[0], W, r)[1] * row_size(spec) for r in range(W)]
            for r in range(W):
                if r != o:
                    out[r] += shards[r]
                    back[o] += shards[r]
        for r in range(W):
            tally.sent[r] += (out[r] + back[r]) * BYTES + (len(group) if back[r] else 0)
            tally.buffer[r] = max(tally.buffer[r], 2 * (out[r] + back[r]) * BYTES)
        tally.moved += 2 * sum(out)
        tally.collectives += 3
    return tally


def _loads(costs: list[int], W: int) -> list[int]:
    loads = [0] * W
    for cost, rank in zip(costs, lpt(costs, W)):
        loads[rank] += cost
    return loads


def tally_of(scheme: str, specs: list[ParamSpec], W: int) -> Tally:
    if scheme == "distributed":
        return distributed(specs, W, Options(dispatch="global"))  # DistributedMuon's default
    if scheme == "batched":
        return distributed(specs, W, Options(dispatch="batched"))
    return {"xtuner": xtuner, "dion": dion, "canzona": canzona}[scheme](specs, W)


def row(model: str, scheme: str, specs: list[ParamSpec], W: int) -> dict:
    t = tally_of(scheme, specs, W)
    mean_flops = sum(t.flops) / W
    bound = lower_bound(specs, W)
    return {
        "model": model,
        "scheme": scheme,
        "world_size": W,
        "flops_max_over_mean": max(t.flops) / mean_flops if mean_flops else 1.0,
        "tflops_max": max(t.flops) / 1e12,
        "gb_sent_max": max(t.sent) / 1e9,
        "over_bound": (sum(t.sent) / W) / bound if bound else float("nan"),
        "padding_percent": 100 * t.padded / t.moved if t.moved else 0.0,
        "buffer_gb_max": max(t.buffer) / 1e9,
        "collectives": t.collectives,
    }


COLUMNS = (  # (key, title, width, format)
    ("flops_max_over_mean", "flops max/mean", 15, ".2f"),
    ("tflops_max", "TF max", 9, ".1f"),
    ("gb_sent_max", "GB/rank max", 12, ".3f"),
    ("over_bound", "x bound", 9, ".2f"),
    ("padding_percent", "pad %", 7, ".1f"),
    ("buffer_gb_max", "buf GB", 8, ".2f"),
    ("collectives", "colls", 7, "d"),
)


def print_rows(rows: list[dict]) -> None:
    for model in dict.fromkeys(r["model"] for r in rows):
        print(f"\n{model}: per step, per rank (module docstring)")
        head = f"{'W':>5} {'scheme':<12}" + "".join(f"{t:>{w}}" for _, t, w, _ in COLUMNS)
        print(head)
        print("-" * len(head))
        for r in (r for r in rows if r["model"] == model):
            cells = "".join(f"{r[k]:>{w}{f}}" for k, _, w, f in COLUMNS)
            print(f"{r['world_size']:>5} {r['scheme']:<12}{cells}")


# ------------------------------------------------------------------------------------------------ --check


def rank_step(specs: list[ParamSpec]) -> dict:
    """One DistributedMuon step (its defaults, preset "torch") on fp32 Shard(0) DTensors of the specs: this rank's
    bytes sent by path (control collectives apart), NS FLOPs of its kernel calls and number of collectives."""
    torch.set_num_threads(1)
    params = [distribute(seeded(s.shape, i), "S0", "fsdp") for i, s in enumerate(specs)]
    opt = DistributedMuon(params, preset="torch")
    count = count_kernel_flops(opt)
    for i, (p, s) in enumerate(zip(params, specs)):
        p.grad = distribute(seeded(s.shape, 1000 + i), "S0", "fsdp")
    opt.step()
    ledger = opt.last_report.bytes_by_path
    return {
        "sent": sum(v[0] for k, v in ledger.items() if k not in CHECKS),
        "flops": count[0],
        "collectives": sum(
            1 for _, op, _, _ in opt.comm.calls if op != "carried"
        ),  # flags ride along
    }


def check(world_sizes: list[int]) -> list[str]:
    """DistributedMuon's plan figures against gloo ranks (benchmarks.run's sets): the differences, none when equal."""
    from muon_check.launch import RankPool

    from .run import SETS

    problems = []
    for W in world_sizes:
        pool = RankPool(W)
        try:
            for name in ("tiny_moe", "scaled_moe", "dense"):
                specs = [s for s in SETS[name]() if s.is_muon]
                measured = pool.run(rank_step, specs, timeout=300)
                model = distributed(specs, W, Options(dispatch="global"))
                for rank, got in enumerate(measured):
                    want = {
                        "sent": model.sent[rank],
                        "flops": model.flops[rank],
                        "collectives": model.rank_collectives[rank],
                    }
                    for key in want:
                        mark = "equal" if got[key] == want[key] else "DIFFERS"
                        print(
                            f"{name:<11} W={W} rank {rank} {key:<12} measured {got[key]:>14,} plan {want[key]:>14,} {mark}"
                        )
                        if got[key] != want[key]:
                            problems.append(
                                f"{name} W={W} rank {rank} {key}: {got[key]} != {want[key]}"
                            )
        finally:
            pool.close()
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--world-sizes", nargs="+", type=int, default=None)
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    parser.add_argument(
        "--check", action="store_true", help="DistributedMuon's figures against gloo ranks"
    )
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.check:
        problems = check(args.world_sizes or [2, 4])
        print(
            f"\nplan against ranks: {len(problems)} differences {problems or ''}({time.perf_counter() - start:.1f} s)"
        )
        return 1 if problems else 0
    rows = [
        row(model, scheme, [s for s in MODELS[model]() if s.is_muon], W)
        for model in args.models
        for W in args.world_sizes or WORLD_SIZES
        for scheme in args.schemes
    ]
    print_rows(rows)
    print(
        f"\n{len(rows)} rows from the plans alone, no ranks started ({time.perf_counter() - start:.1f} s)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
