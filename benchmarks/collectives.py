"""The latency of the step's collectives on gloo: an all-gather as a ring and as one all-to-all, and an all-to-all.

    python -m benchmarks collectives [--world-sizes 2 4] [--sizes 8 1024 65536] [--reps 200]

muon_dist.comm.TorchComm runs an all-gather on gloo as an all_to_all_single of its input repeated once per member
(TorchComm.gathers_by_all_to_all): the same bits and ledger, one exchange instead of the ring's W - 1 steps.
This measures both routes through TorchComm.all_gather on the world group of W gloo ranks
(muon_check.launch.RankPool, one intra-op thread each), beside a plain all_to_all of the same elements per peer,
for fp32 payloads of each size (elements per rank). Per call: a barrier, then the call; per route the median
over `reps` calls of the slowest rank's time, the routes interleaved call by call so that the machine's load
hits all alike. The step's control collectives (plan digests, failure flags) are 8 fp32 elements.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

ROUTES = ("all_gather ring", "all_gather by all_to_all", "all_to_all")


def rank_times(sizes: list[int], reps: int) -> dict[int, dict[str, list[float]]]:
    """{size: {route: [seconds per call]}} on this rank."""
    import torch.distributed as dist

    from muon_dist import TorchComm

    torch.set_num_threads(1)
    ring, direct = TorchComm(), TorchComm()
    group = ring.world_group()
    ring._gloo[group.handle] = (
        False  # the ring all-gather, as gloo's own all_gather_into_tensor runs it
    )
    out: dict[int, dict[str, list[float]]] = {}
    for n in sizes:
        x = torch.arange(n, dtype=torch.float32) + dist.get_rank()
        splits = [n] * group.size
        calls = {
            ROUTES[0]: lambda: ring.all_gather(x, group, "bench"),
            ROUTES[1]: lambda: direct.all_gather(x, group, "bench"),
            ROUTES[2]: lambda: direct.all_to_all(
                x.repeat(group.size), splits, splits, group, "bench"
            ),
        }
        assert torch.equal(calls[ROUTES[0]](), calls[ROUTES[1]]())
        times: dict[str, list[float]] = {r: [] for r in ROUTES}
        for rep in range(reps + 10):
            for k in range(len(ROUTES)):
                route = ROUTES[(rep + k) % len(ROUTES)]
                dist.barrier()
                start = time.perf_counter()
                calls[route]()
                if rep >= 10:  # warm-up
                    times[route].append(time.perf_counter() - start)
        out[n] = times
    return out


def main(argv: list[str] | None = None) -> int:
    from muon_check.launch import RankPool

    from .run import header

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 1024, 65536])
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args(argv)
    print(header("gloo collective latency"))
    print(f"\n{'W':>3} {'fp32 elements':>14}" + "".join(f"{r:>27}" for r in ROUTES) + "   (us)")
    for W in args.world_sizes:
        pool = RankPool(W)
        try:
            results = pool.run(rank_times, args.sizes, args.reps, timeout=600.0)
        finally:
            pool.close()
        for n in args.sizes:
            cells = [
                statistics.median(max(r[n][route][i] for r in results) for i in range(args.reps))
                for route in ROUTES
            ]
            print(f"{W:>3} {n:>14}" + "".join(f"{1e6 * c:>27.0f}" for c in cells))
    return 0
