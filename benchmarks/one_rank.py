"""One rank's step against torch.optim.Muon's, contract by contract: what each of DistributedMuon's guarantees
costs where no collective runs.

    python -m benchmarks one-rank [--sets dense] [--warmup 2] [--steps 20]

On one process (a gloo group of one, one intra-op thread), preset "torch", fp32 params of a parameter set of
benchmarks.run (default `dense`, the 28 matrices of a 4-layer transformer with d = 256 and ff = 1024), fresh
gradients every step (drawn before the timed region, a copy per method), each method on its own params. Methods,
the order rotating every step:
    torch_muon   torch.optim.Muon(nesterov=True) on the plain tensors (benchmarks.peers.torch_muon at W = 1)
    held         muon_ref's stages param by param on plain tensors (muon_ref.functional, the same ops as
                 torch.optim.Muon under preset "torch"): the new buffer and the direction out of place, the
                 direction cast to the kernel's input dtype, the kernel, then the new buffer copied into the
                 old one and the param written in place. The new buffer is held through the kernel: what writing
                 nothing until the kernel has succeeded needs, with no recomputation
    checked      held, after one pass over every gradient for non-finite values first (muon_dist.agreement's
                 sums, which nonfinite="raise" needs before anything is written)
    recomputed   checked, with the new buffer dropped after the direction and computed again in place after the
                 kernel (DistributedMuon's write stage: no new buffer held through the kernel)
    distributed  DistributedMuon as it comes, on Shard(0) DTensors of the group of one (benchmarks.run's method)
Per method: the median and the min of its step time over the steps after warm-up, their ratios to torch_muon's,
and whether its params after all the steps equal torch_muon's bit for bit (each method computes
torch.optim.Muon's bits, so any difference is a bug of the method). The steps of different methods are
interleaved, so the machine's load hits all alike; compare ratios within a run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

import muon_ref
from muon_check.fixtures import same_bits
from muon_dist.agreement import _nonfinite_flags
from muon_ref.functional import apply_update, momentum_buffer, momentum_direction, orthogonalize
from muon_ref.newton_schulz import input_cast
from muon_ref.optim import follow_torch_keys, group_config

from .peers import hyperparameters
from .run import SETS, Bench, gradients, header, initial, muon_specs, shard

METHODS = ("torch_muon", "held", "checked", "recomputed", "distributed")


class Staged:
    """muon_ref's stages param by param on plain tensors, in one of the orders of the module docstring
    (`check`: the non-finite pass first; `recompute`: the new buffer computed again after the kernel)."""

    def __init__(self, params: list[torch.Tensor], names: list[str], check: bool, recompute: bool):
        self.params, self.check, self.recompute = params, check, recompute
        self.bufs = [torch.zeros_like(p) for p in params]
        ref = muon_ref.Muon([{"params": params, "param_names": names}], preset="torch")
        group = ref.param_groups[0]
        self.cfg = group_config(follow_torch_keys(ref, group))
        self.layouts = [ref.layout_of(p, group, n) for p, n in zip(params, names)]
        self.cast = input_cast(torch.float32, self.cfg.ns_dtype, self.cfg.normalize_before_cast)

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        cfg = self.cfg
        if self.check and bool(_nonfinite_flags(grads, grads[0].device).any()):
            raise ValueError("a non-finite gradient")
        for p, g, buf, layout in zip(self.params, grads, self.bufs, self.layouts):
            new_buf, direction = momentum_direction(g, buf, cfg)
            if self.recompute:
                del new_buf
            if self.cast is not None:
                direction = direction.to(self.cast)
            update = orthogonalize(direction, layout, cfg)
            del direction
            if self.recompute:
                momentum_buffer(g, buf, cfg, out=buf)
            else:
                buf.copy_(new_buf)
                del new_buf
            apply_update(p, update, layout, cfg, out=p)


def _group_of_one() -> None:
    """A gloo group of one and its 1-D mesh (DistributedMuon's DTensors), once per process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="one_rank_"), "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))


def run(b: Bench) -> dict[str, dict]:
    """Every method's step times (seconds, after warm-up) and final params, steps interleaved."""
    from muon_dist.optim import DistributedMuon

    torch.set_num_threads(1)
    _group_of_one()
    names = [s.name for s in muon_specs(b.table)]
    plain = {m: [t.clone() for t in initial(b)] for m in METHODS if m != "distributed"}
    dtensors = [shard(t) for t in initial(b)]
    torch_muon = torch.optim.Muon(plain["torch_muon"], nesterov=True, **hyperparameters())
    distributed = DistributedMuon([{"params": dtensors, "param_names": names}], preset="torch")
    staged = {
        "held": Staged(plain["held"], names, check=False, recompute=False),
        "checked": Staged(plain["checked"], names, check=True, recompute=False),
        "recomputed": Staged(plain["recomputed"], names, check=True, recompute=True),
    }

    def stepper(method: str, grads: list[torch.Tensor]) -> Callable[[], object]:
        if method == "torch_muon":
            for p, g in zip(plain[method], grads):
                p.grad = g
            return torch_muon.step
        if method == "distributed":
            for p, g in zip(dtensors, grads):
                p.grad = shard(g)
            return distributed.step
        return lambda: staged[method].step(grads)

    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for step in range(b.total_steps):
        fresh = gradients(b, step)
        for k in range(len(METHODS)):
            method = METHODS[(step + k) % len(METHODS)]
            go = stepper(method, [g.clone() for g in fresh])
            start = time.perf_counter()
            go()
            times[method].append(time.perf_counter() - start)
        for p in plain["torch_muon"]:
            p.grad = None
    finals = {m: plain[m] for m in plain} | {"distributed": [p.to_local() for p in dtensors]}
    return {
        m: {"times": times[m][b.warmup :], "params": [t.detach().clone() for t in finals[m]]}
        for m in METHODS
    }


def rows(results: dict[str, dict]) -> list[dict]:
    """Per method: median and min step ms, their ratios to torch_muon's, bitwise torch_muon's params."""
    base = results["torch_muon"]
    base_median, base_min = statistics.median(base["times"]), min(base["times"])
    out = []
    for method, r in results.items():
        median, least = statistics.median(r["times"]), min(r["times"])
        same = all(same_bits(a, b) for a, b in zip(r["params"], base["params"]))
        out.append(
            {
                "method": method,
                "median_ms": median * 1e3,
                "min_ms": least * 1e3,
                "median_ratio": median / base_median,
                "min_ratio": least / base_min,
                "bitwise": same,
            }
        )
    return out


def print_rows(table: list[dict], b: Bench) -> None:
    print(
        f"\n{b.table}, one rank: step ms over {b.steps} steps after {b.warmup} warm-up (methods interleaved); "
        "x torch: the ratio to torch_muon's; = torch_muon: its params after the run, bit for bit"
    )
    print(f"{'method':<13}{'median ms':>11}{'x torch':>9}{'min ms':>9}{'x torch':>9}  = torch_muon")
    print("-" * 64)
    for r in table:
        print(
            f"{r['method']:<13}{r['median_ms']:>11.1f}{r['median_ratio']:>9.3f}{r['min_ms']:>9.1f}"
            f"{r['min_ratio']:>9.3f}  {'bitwise' if r['bitwise'] else 'DIFFERS'}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks one-rank", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--sets", nargs="+", default=["dense"], choices=sorted(SETS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.steps < 1:
        parser.error(f"--warmup must be >= 0 and --steps >= 1, got {args.warmup} and {args.steps}")
    print(header("muon_dist one-rank contracts"))
    differs = False
    for table in args.sets:
        if any(len(s.shape) != 2 for s in muon_specs(table)):
            parser.error(
                f"--sets {table}: torch.optim.Muon takes 2-D params only; valid: dense, tiny_dense"
            )
        b = Bench(table=table, world_size=1, warmup=args.warmup, steps=args.steps)
        table_rows = rows(run(b))
        print_rows(table_rows, b)
        differs = differs or not all(r["bitwise"] for r in table_rows)
    return 1 if differs else 0
