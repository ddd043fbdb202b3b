"""Who orthogonalises what: the Newton-Schulz cost of a matrix, and three ways to assign matrices to ranks.

Cost (FLOPs of one NS run on an (m, n) matrix, transposed so that m <= n, k steps; one multiply-add = 2):
    A = X X^T: 2 m^2 n;   A A: 2 m^3;   B X: 2 m^2 n        =>   k (4 m^2 n + 2 m^3)
Assignments, each returning the rank of every unit:
    round_robin:  param i -> rank i mod W, in model order (KellerJordan's distributed Muon)
    per_shape:    params grouped by (shape, kind) in model order, cut into batches of W; member k of a batch
                  -> rank k, so a remainder of R < W lands on ranks 0..R-1 (Dion, xtuner)
    lpt:          every matrix (each expert separately) sorted by cost, largest first, to the least loaded
                  rank (Graham's longest-processing-time rule: max load <= 4/3 of the optimum)
Imbalance = max over ranks of the assigned cost / mean over ranks (1.0 is perfect). No assignment of
whole units beats bound = max(largest unit, mean) / mean, reported beside the rules.
"""

from __future__ import annotations

import heapq
from collections import defaultdict

from .shapes import ParamSpec


def ns_flops(fan_out: int, fan_in: int, steps: int = 5) -> int:
    m, n = min(fan_out, fan_in), max(fan_out, fan_in)
    return steps * (4 * m * m * n + 2 * m**3)


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


def lpt(costs: list[int], world_size: int) -> list[int]:
    """Largest cost first, each to the currently least loaded rank (ties: the lowest rank)."""
    heap = [(0, r) for r in range(world_size)]
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(heap)
        owner[i] = rank
        heapq.heappush(heap, (load + costs[i], rank))
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


def compare(specs: list[ParamSpec], world_size: int, steps: int = 5) -> dict[str, float]:
    """Imbalance of each rule for the Muon params of `specs` on `world_size` ranks."""
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
