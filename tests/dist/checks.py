"""Parent-side checks shared by the distributed tests: run a Case on a pool and assert bitwise equality,
the paths taken, and the byte counts."""

from __future__ import annotations

import math

import torch

from muon_check.fixtures import axis_codes, bits, box_of, mesh_shape, same_bits
from muon_dist.agreement import CHECKS

from .conftest import get_pool, record_paths
from .workers import Case, distributed_steps, reference_steps


def group_size(case: Case, world_size: int, placement: str = "S0") -> int:
    """The shard group's size: the product of the sizes of the mesh axes that shard (all when none does)."""
    shape, _ = mesh_shape(case.mesh, world_size)
    codes = axis_codes(placement, case.mesh, world_size)
    sharding = [n for n, code in zip(shape, codes) if code != "R"]
    return math.prod(sharding) if sharding else world_size


def expected_paths(case: Case, world_size: int) -> list[str]:
    """The planner's rule, restated: same-layout params in order, batches of W; a full batch of a sharded
    layout takes all_to_all, a remainder the remainder path; plain and Replicate params take replicated."""
    opts = dict(case.options)
    if "dispatch" not in opts:  # DistributedMuon's default (muon_dist.optim.resolve_options)
        batched = "remainder" in opts or "force_path" in opts
        opts["dispatch"] = "batched" if batched else "global"
    runs: dict[tuple, list[int]] = {}
    for i, key in enumerate(
        zip(case.shapes, case.placements, case.groups or (0,) * len(case.shapes))
    ):
        runs.setdefault(key, []).append(i)
    paths = [""] * len(case.shapes)
    overrides = dict(case.overrides)
    separate = overrides.get("split_sizes") is not None or overrides.get("num_heads") is not None
    for (shape, placement, _), members in runs.items():
        W = group_size(case, world_size, "R" if placement == "plain" else placement)
        if separate and placement not in ("plain", "R") and not opts.get("force_path"):
            for i in members:  # a run of separate blocks is one batch: its units are blocks
                paths[i] = "blocks"
            continue
        for start in range(0, len(members), W):
            chunk = members[start : start + W]
            if placement in ("plain", "R"):
                path = "replicated"
            else:
                path = (
                    opts.get("force_path")
                    or expert_path(case, shape, placement, world_size)
                    or ("all_to_all" if len(chunk) == W else opts.get("remainder", "agrs"))
                )
            if (
                opts.get("dispatch") == "global"
                and path in ("all_to_all", "agrs", "padded_all_to_all")
                and W > 1
            ):
                path = "global_all_to_all"
            for i in chunk:
                paths[i] = path
    return paths


def expert_path(case: Case, shape: tuple[int, ...], placement: str, world_size: int) -> str | None:
    """The expert rule restated on the members' torch.chunk boxes of the row indices: an expert stack sharded on
    dim 0 is "local" when no expert has rows on two members, "subgroup_all_gather" when any two members that
    hold rows of a common expert hold nothing else, and None (the all-to-all family) otherwise."""
    overrides = dict(case.overrides)
    if (
        placement != "S0"
        or overrides.get("flatten")
        or (len(shape) == 2 and overrides.get("num_experts") is None)
    ):
        return None
    unit = 1 if len(shape) == 3 else shape[0] // overrides["num_experts"]
    rows = torch.arange(shape[0])
    held = [
        set((box_of(rows, "S0", case.mesh, j, world_size) // unit).tolist())
        for j in range(group_size(case, world_size))
    ]
    sharing = [
        a | b for i, a in enumerate(held) for b in held[i + 1 :] if a & b
    ]  # pairs that hold a common expert
    if not sharing:
        return "local"
    return "subgroup_all_gather" if all(len(experts) == 1 for experts in sharing) else None


def run_case(world_size: int, case: Case, timeout: float = 120.0) -> list[dict]:
    """Run on every rank; assert params and buffers equal muon_ref bitwise, paths and bytes as planned."""
    results = run_unchecked(world_size, case, timeout)
    want_paths = expected_paths(case, world_size)
    for rank, r in enumerate(results):
        assert not r["differing"], (
            f"rank {rank}: params differ from muon_ref: {r['differing']} ({case})"
        )
        assert r["buffers_equal"], f"rank {rank}: momentum buffers differ from muon_ref ({case})"
        assert [p for _, p in r["paths"]] == want_paths, (rank, r["paths"], want_paths)
        moved = {k: v for k, v in r["bytes"].items() if k not in CHECKS}
        assert moved == r["expected"], (rank, moved, r["expected"])
        assert r["flops"] == r["expected_flops"], (
            f"rank {rank}: NS FLOPs {r['flops']} != plan {r['expected_flops']}"
        )
        got = data_collectives(r["calls"])
        assert got == r["expected_collectives"], (
            f"rank {rank}: data collectives {got} != plan {r['expected_collectives']}"
        )
    return results


def data_collectives(calls: list[tuple[str, str]]) -> dict[str, int]:
    """The data collectives of a step's logged calls, by path: the control collectives (CHECKS) and the flags
    that ride along ("carried") left out."""
    counts: dict[str, int] = {}
    for path, op in calls:
        if path not in CHECKS and op != "carried":
            counts[path] = counts.get(path, 0) + 1
    return counts


def run_unchecked(world_size: int, case: Case, timeout: float = 120.0) -> list[dict]:
    """The ranks' results, each with `differing` ({param index: number of elements unlike muon_ref's}) and
    `buffers_equal`; the reference runs in the parent while the ranks work."""
    pool = get_pool(world_size)
    pool.submit(distributed_steps, case)
    try:
        ref_params, ref_bufs = reference_steps(case)
    except BaseException:
        pool.kill()  # its answers to this call would be read by the next one
        raise
    results = pool.collect(timeout)
    record_paths(results)
    for rank, r in enumerate(results):
        boxes = [
            box_of(t, pl, case.mesh, rank, world_size) for t, pl in zip(ref_params, case.placements)
        ]
        r["differing"] = {
            i: int((bits(got) != bits(want)).sum())
            for i, (got, want) in enumerate(zip(r["params"], boxes))
            if not same_bits(got, want)
        }
        bufs = [
            box_of(t, pl, case.mesh, rank, world_size) for t, pl in zip(ref_bufs, case.placements)
        ]
        r["buffers_equal"] = all(same_bits(a, b) for a, b in zip(r["buffers"], bufs))
    return results


def timeout_for(seconds: float) -> float:
    """A Hypothesis test's timeout: `seconds` under the ci profile (40 examples), scaled with the active count."""
    from hypothesis import settings

    return seconds * max(1.0, settings().max_examples / 40)
