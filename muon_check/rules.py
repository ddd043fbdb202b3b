"""Three ways to assign Muon matrices to ranks, compared by their Newton-Schulz load (the benchmark's table).

Assignments, each returning the rank of every unit:
    round_robin:  param i -> rank i mod W, in model order (KellerJordan's distributed Muon)
    per_shape:    params grouped by (shape, kind) in model order, cut into batches of W; member k of a batch
                  -> rank k, so a remainder of R < W lands on ranks 0..R-1 (Dion, xtuner)
    lpt:          every matrix (each expert separately) by muon_dist.balance.lpt
Imbalance = max over ranks of the assigned cost / mean over ranks (1.0 is perfect), with the cost of
muon_dist.balance.ns_flops. No assignment of whole units beats bound = max(largest unit, mean) / mean.
"""

from __future__ import annotations

from collections import defaultdict

from muon_dist.balance import lpt, ns_flops

from .shapes import ParamSpec


def param_flops(spec: ParamSpec, steps: int = 5) -> int:
    """Cost of a whole parameter: one matrix, or E expert matrices."""
    *experts, fan_out, fan_in = spec.shape
    return (experts[0] if experts else 1) * ns_flops(fan_out, fan_in, steps)


def round_robin(costs: list[int], world_size: int) -> list[int]:
    return [i % world_size for i in range(len(costs))]


def per_shape(specs: list[ParamSpec], world_size: int) -> list[int]:
    runs: dict[tuple, list[int]] = defaultdict(list)
    for i, spec in enumerate(specs):
        runs[(spec.shape, spec.kind)].append(i)
    owner = [0] * len(specs)
    for members in runs.values():
        for j, i in enumerate(members):
            owner[i] = j % world_size
    return owner


def imbalance(costs: list[int], owner: list[int], world_size: int) -> float:
    loads = [0] * world_size
    for cost, rank in zip(costs, owner):
        loads[rank] += cost
    mean = sum(loads) / world_size
    return max(loads) / mean if mean else 1.0


def expert_matrices(specs: list[ParamSpec], steps: int = 5) -> list[int]:
    """The cost of every Muon matrix, experts split into their E matrices (the units of `lpt`)."""
    costs = []
    for spec in specs:
        if spec.is_muon:
            *experts, fan_out, fan_in = spec.shape
            costs += [ns_flops(fan_out, fan_in, steps)] * (experts[0] if experts else 1)
    return costs


def imbalance_by_rule(specs: list[ParamSpec], world_size: int, steps: int = 5) -> dict[str, float]:
    """Imbalance of each rule for the Muon params of `specs` on `world_size` ranks, and the bound."""
    muon = [s for s in specs if s.is_muon]
    costs = [param_flops(s, steps) for s in muon]
    matrices = expert_matrices(muon, steps)
    mean = sum(matrices) / world_size
    return {
        "bound": max(max(matrices), mean) / mean,
        "round_robin": imbalance(costs, round_robin(costs, world_size), world_size),
        "per_shape": imbalance(costs, per_shape(muon, world_size), world_size),
        "lpt": imbalance(matrices, lpt(matrices, world_size), world_size),
    }
