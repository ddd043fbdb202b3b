"""Who orthogonalises what: the Newton-Schulz cost of a matrix, and the longest-processing-time assignment.

Cost (FLOPs of one NS run on an (m, n) matrix, transposed so that m <= n, k steps; one multiply-add = 2):
    A = X X^T: 2 m^2 n;   A A: 2 m^3;   B X: 2 m^2 n        =>   k (4 m^2 n + 2 m^3)
lpt: every unit sorted by cost, largest first, to the least loaded rank (Graham's longest-processing-time rule:
max load <= 4/3 of the optimum). The planner's global dispatch uses it; muon_check/rules.py compares it
with the field's other rules. rounds: the global batch cut into rounds that keep that balance.
"""

from __future__ import annotations

import heapq


def ns_flops(fan_out: int, fan_in: int, steps: int = 5) -> int:
    m, n = min(fan_out, fan_in), max(fan_out, fan_in)
    return steps * (4 * m * m * n + 2 * m**3)


def lpt(costs: list[int], world_size: int) -> list[int]:
    """The owner of every unit: largest cost first, each to the currently least loaded rank (ties: lowest rank)."""
    heap = [(0, r) for r in range(world_size)]
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(heap)
        owner[i] = rank
        heapq.heappush(heap, (load + costs[i], rank))
    return owner


def rounds(costs: list[int], owner: list[int], count: int) -> list[int]:
    """The round (0 .. count - 1) of every unit: each rank's units, largest cost first (ties: in their order), each
    to the rank's least loaded round so far (ties: the lowest), lpt again with rounds for ranks. So every round
    gives each rank about 1/count of its load (within its largest unit), the rounds together keep lpt's balance,
    ranks that lpt gave the same costs get the same load in every round, and a rank's largest units go to
    different rounds: at a round's all-to-all no rank waits for another's larger unit (a cut of each rank's units
    in param order could put a large matrix in one rank's round and small ones in another's), and no round
    gathers every rank's largest matrices (cut largest first, the first round would: the most bytes at once)."""
    loads: dict[int, list[int]] = {}
    out = [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        mine = loads.setdefault(owner[k], [0] * count)
        out[k] = min(range(count), key=lambda j: (mine[j], j))
        mine[out[k]] += costs[k]
    return out
