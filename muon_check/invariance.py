"""Invariance families: the same training gives the same params whatever the layout, the world size or the
gradient accumulation.

    python -m muon_check --invariance MODULE:SETUP [--world-sizes 1 2 4] [--steps 2]

A setup (audit.Setup) trains model.AuditModel for `steps` optimizer steps under each configuration (world size
W, its sharding, k micro-batches) on the probe loss, whose step gradient is G_s bit for bit in every
configuration (audit.py: W and k powers of two, fp32 params). A Muon orthogonalises G_s's momentum once per
optimizer step whatever the configuration, and the project's contract (bitwise to muon_ref on every layout)
makes the params bitwise equal to the reference configuration's (W = 1, one micro-batch) after every step:

    contract: P_s(config) == P_s(reference) bit for bit, for every param and step s   (setup.tolerance = 0)
              or max |P_s(config) - P_s(reference)| <= tolerance * max |P_s(reference)|  (a stated tolerance)

Configurations: for each sharding of setup.shardings (its own by default) every W > 1 of world_sizes with one
micro-batch, against the reference (world size; layout: fsdp2, hsdp, ddp); k micro-batches at W = 1 and at the
smallest such W, each against one batch at the same W and layout (gradient accumulation). A configuration that
differs names the invariance that breaks, the first step and the params that differ.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from .audit import Setup, probe_gradients
from .model import AuditModel


@dataclass(frozen=True)
class Config:
    world_size: int
    sharding: str | None
    micro_batches: int
    unreduced: bool = False

    def words(self) -> str:
        k = f", {self.micro_batches} micro-batches" if self.micro_batches > 1 else ""
        alone = "replicated, reduced by the optimizer" if self.unreduced else "one device per rank"
        return f"W = {self.world_size} ({self.sharding or alone}{k})"


def configurations(
    setup: Setup, world_sizes: tuple[int, ...], micro_batches: int
) -> tuple[Config, list[tuple[str, Config, Config]]]:
    """(the reference, [(the invariance, a configuration, the configuration it must equal)]): world sizes and
    layouts against the reference; k micro-batches against one batch at the same W and layout."""
    shardings = setup.shardings or (setup.sharding,)
    one = (
        "fsdp2" if setup.sharding == "hsdp" else setup.sharding
    )  # a mesh of one rank has no replicas
    u = bool(setup.unreduced and setup.sharding is None)
    reference = Config(1, one, 1, u)
    out: list[tuple[str, Config, Config]] = []
    if micro_batches > 1:
        out.append(("gradient accumulation", Config(1, one, micro_batches, u), reference))
    for sharding in shardings:
        sizes = [w for w in world_sizes if w > 1 and (sharding != "hsdp" or w % 2 == 0)]
        for w in sizes:
            what = "world size" if sharding == one else f"layout ({sharding})"
            out.append((what, Config(w, sharding, 1, u), reference))
        if sizes and micro_batches > 1:
            w = sizes[0]
            out.append(
                (
                    "gradient accumulation",
                    Config(w, sharding, micro_batches, u),
                    Config(w, sharding, 1, u),
                )
            )
    return reference, out


def train_rank(
    setup: Setup, config: Config, steps: int, seed: int
) -> list[dict[str, torch.Tensor]]:
    """One rank's training; the full params after each step (gathered from shards), on rank 0 only."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    setup = copy.copy(setup)
    setup.sharding, setup.micro_batches = config.sharding, config.micro_batches
    model = setup.shard(AuditModel(seed), config.world_size)
    built = setup.build(model)
    optimizers = list(built) if isinstance(built, (list, tuple)) else [built]
    W, k = config.world_size, config.micro_batches
    own = config.sharding or setup.unreduced
    history = []
    for step in range(1, steps + 1):
        _, parts = probe_gradients(step, W, k, seed)
        if own:
            probes = [parts[(rank, i)] for i in range(k)]
        else:
            probes = [
                {n: sum(parts[(r, i)][n] for r in range(W)) / W for n in parts[(0, 0)]}
                for i in range(k)
            ]
        setup.train_step(model, optimizers, probes)
        full = setup.full(model)
        history.append(full if rank == 0 else {})
    return history


def _difference(
    got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]], tolerance: float
) -> tuple[int, list[str], float] | None:
    """(first step that differs, the params that differ there, their largest relative difference) or None."""
    for s, (g, w) in enumerate(zip(got, want), start=1):
        names, worst = [], 0.0
        for name, ref in w.items():
            d = (g[name].double() - ref.double()).abs().max().item()
            scale = max(ref.double().abs().max().item(), 1e-30)
            if (d > tolerance * scale) if tolerance else not torch.equal(g[name], ref):
                names.append(name)
                worst = max(worst, d / scale)
        if names:
            return s, names, worst
    return None


def invariance(
    setup: Setup,
    world_sizes: tuple[int, ...] = (1, 2, 4),
    micro_batches: int = 2,
    steps: int = 2,
    seed: int = 0,
    timeout: float = 120.0,
) -> dict[str, Any]:
    """Every configuration against the reference; the report (and its verdict: invariant or which breaks)."""
    from .launch import RankFailure, RankPool

    reference, tested = configurations(setup, world_sizes, micro_batches)
    pools: dict[int, Any] = {}
    tolerance = float(getattr(setup, "tolerance", 0.0))

    done: dict[Config, list[dict[str, torch.Tensor]]] = {}

    def run(config: Config) -> list[dict[str, torch.Tensor]]:
        if config not in done:
            pool = pools.get(config.world_size)
            if pool is None:
                pool = pools[config.world_size] = RankPool(config.world_size, idle_s=10.0)
            done[config] = pool.run(train_rank, setup, config, steps, seed, timeout=timeout)[0]
        return done[config]

    rows = []
    try:
        for what, config, against in tested:
            rows.append(_compare(what, config, against, run, tolerance, RankFailure))
    finally:
        for pool in pools.values():
            pool.close()
    broken = sorted({r["invariance"] for r in rows if r["status"] == "differs"})
    unrun = sum(r["status"] == "could not run" for r in rows)
    if broken:
        verdict = "breaks: " + ", ".join(broken) + (f"; {unrun} could not run" if unrun else "")
    else:
        verdict = f"could not run {unrun} of {len(rows)}" if unrun else "invariant"
    return {
        "setup": setup.name,
        "reference": reference.words(),
        "steps": steps,
        "tolerance": tolerance,
        "rows": rows,
        "broken": broken,
        "could_not_run": unrun,
        "verdict": verdict,
    }


def _compare(
    what: str, config: Config, against: Config, run: Any, tolerance: float, failure: type
) -> dict[str, Any]:
    """One row: a configuration against its reference (bitwise, within the tolerance, differs, or could not run:
    a configuration that raised or hung is named, never a traceback)."""
    row = {
        "invariance": what,
        "config": config.words(),
        "against": against.words(),
        "status": "bitwise" if not tolerance else "within",
    }
    try:
        diff = _difference(run(config), run(against), tolerance)
    except failure as e:
        row.update(status="could not run", error=_failure_line(e))
        return row
    if diff:
        step, names, worst = diff
        row.update(status="differs", step=step, params=names, relative=worst)
    return row


def _failure_line(e: Any) -> str:
    """The first failing rank's error (its traceback's last line) and, where gloo refused a collective NCCL takes,
    that collective; or the ranks that hung."""
    from .adapters.diagnose import gloo_refusal

    if not e.messages:
        return f"hung (ranks {sorted(e.hung)})"
    rank, text = sorted(e.messages.items())[0]
    last = [line for line in text.strip().splitlines() if line.strip()][-1].strip()
    refused = gloo_refusal(text)
    return f"rank {rank}: {last}" + (
        f" (could not run on gloo: {refused}; NCCL takes it)" if refused else ""
    )


def print_invariance(rep: dict[str, Any], log=print) -> None:
    contract = "bit for bit" if not rep["tolerance"] else f"within {rep['tolerance']:g} (relative)"
    log(
        f"invariance of {rep['setup']}: {rep['steps']} steps against {rep['reference']}, {contract}"
    )
    for r in rep["rows"]:
        extra = ""
        if r["status"] == "differs":
            shown = ", ".join(r["params"][:4]) + (" ..." if len(r["params"]) > 4 else "")
            extra = f": from step {r['step']}, max relative {r['relative']:.2e}, in {shown}"
        elif r["status"] == "could not run":
            extra = f": {r['error']}"
        log(f"  {r['invariance']:<22} {r['config']} against {r['against']}: {r['status']}{extra}")
    log(f"verdict: {rep['verdict']}")
