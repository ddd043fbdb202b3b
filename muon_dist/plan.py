"""plan(): a pure function of every parameter's layout -> a frozen Plan, identical on every rank.

Params with the same layout (all but the name), the same param group, kernel output dtype and direction dtype
form a run; a run on a sharded layout is cut, in param-group order, into full batches of W (the shard group's
size) that take the all-to-all path, and a remainder batch of R < W that takes the remainder path (AGRS, or the
padded all-to-all). Consecutive full batches of a run are packed into one all_to_all batch of k W params (member
j owns params j, j + W, ...), k the most that keeps it within 1/rounds of the step's elements (round_count,
at least one batch; none under force_path): the same owners, bits and bytes as batches of W, in fewer
collectives. In a shard group of one, a run's params are packed (any sharded path, experts too) up to the step's
largest param's elements (at least PACK_MIN_ELEMENTS): no collective to save there, but same-shape params then
share a stack kernel call. Replicated runs are cut into batches of at most W. Each path's module gives the
owners. The digest of the plan is compared across ranks before the first data collective.

Params with separate blocks (split_sizes, num_heads) take the "blocks" path when sharded: each block goes to the
member that holds most of it. Expert stacks (a shared layout of several blocks: 3-D [E, m, n], or fused [E * m, n] with num_experts) are planned
from where the boxes fall on the blocks, never from mesh names: if every member holds whole blocks, "local"; else
if every component of members that share a block holds exactly that one block, "subgroup_all_gather"; else the
all-to-all family over the whole shard group (proofs/paths.md#expert-fallback). E % ep != 0 needs no special
case: the boxes say which case it is.

dispatch="global" (Options.dispatch) then merges every batch of a path that allows it (Path.global_dispatch: the
all-to-all family) into one "global_all_to_all" batch per (shard groups, direction dtype, update dtype), each
param owned by the member that muon_dist.balance.lpt gives it (cost: ns_flops of its blocks; ties to the lowest
param index and rank), cut into rounds (round_count of its elements, and more where the batches in flight would
hold more than Options.memory_budget: _within_budget; muon_dist.balance.rounds: each owner gets about 1/rounds of
its load in each), one global_all_to_all batch per round. Expert paths, replicated batches and
groups of one stay as they are, placed between the rounds (interleave), so that a write group can end with a
round that carries its failure check (muon_dist/agreement.py).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from muon_ref import MatrixLayout

from .balance import lpt, ns_flops, rounds
from .batch import Batch
from .geometry import Box, Geometry, blocks_in, parse_placement
from .layout import ParamLayout
from .paths import PATHS
from .paths.exchange import exchange_bytes

REMAINDER_PATHS: tuple[str, ...] = tuple(name for name, path in PATHS.items() if path.remainder)
# DistributedMuon's default (Options.rounds None): global dispatch in up to this many rounds (docs/benchmarks.md: the
# dense set at W = 2 and 4 with 1, 2, 4 and 8 rounds), each of at least ROUND_MIN_ELEMENTS elements: a round's
# all-to-alls cost a latency whatever they carry, and below about that size one round overlaps less than a second
# round's latency costs (docs/benchmarks.md, "Rounds by size": the expert sets ran faster in one round than in
# four at W = 2 and 4; the dense set keeps four, and its memory).
ROUNDS = 4
# DistributedMuon's default (Options.pipeline_depth): batches whose Steps are in flight at once in the step
# (muon_dist.runtime.staggered): one issuing its directions, one running its kernels, one receiving its updates
PIPELINE_DEPTH = 3
ROUND_MIN_ELEMENTS = 1 << 18
# DistributedMuon's default memory budget (Options.memory_budget None), per shard group and dtype pair: pipeline_depth
# rounds of at most 4/3 of the floor round each, the round in which every member orthogonalises one largest matrix
# (floor_round). On the dense benchmark set that cuts the four rounds by size into seven at W = 2, where the peak
# fell to about two thirds at the same step, and leaves them at W = 4, where more rounds cost step time on 2 cores;
# on a large model at a small W it bounds rounds that by size are a quarter of the step each (docs/benchmarks.md,
# "A memory budget for the rounds").
BUDGET_FLOOR_ROUNDS = (4, 3)
# in a shard group of one, a batch may hold this many elements even where every param is smaller (a few hundred
# KiB at most): small params then share one stack kernel call, whose per-call cost dominates their Newton-Schulz
PACK_MIN_ELEMENTS = 1 << 16


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class Options:
    """remainder: the path of a remainder batch. force_path: every sharded batch takes this path, full or not
    (so only the paths that take any batch size). dispatch: "batched" (batches of W same-layout params, packed)
    or "global" (one LPT-balanced batch per shard group and dtype pair, in rounds). rounds: the step's
    all-to-all traffic goes in about this many rounds, pipelined (module docstring); None (the default): as many
    as round_count gives for its elements. pipeline_depth: how many batches' Steps are in flight at once
    (muon_dist.runtime.staggered); part of the plan's digest, since another depth issues the collectives in
    another order. memory_budget: with rounds None and global dispatch, bytes per rank that the communication
    buffers of the batches in flight may hold (pipeline_depth times the most a rank sends and receives in one
    round: round_buffers, buffer_bytes); rounds are added until the step keeps within it, down to one param per
    owner and round, and from there fewer rounds are in flight (the plan's options carry that depth, at least
    one); None (the default, which never lowers the depth): per shard group and dtype pair, pipeline_depth times
    BUDGET_FLOOR_ROUNDS (4/3) of floor_round, with no round under ROUND_MIN_ELEMENTS elements."""

    remainder: str = "agrs"
    force_path: str | None = None
    dispatch: str = "batched"
    rounds: int | None = None
    pipeline_depth: int = PIPELINE_DEPTH
    memory_budget: int | None = None

    def __post_init__(self) -> None:
        if self.remainder not in REMAINDER_PATHS:
            raise ValueError(f"remainder must be one of {REMAINDER_PATHS}, got {self.remainder!r}")
        if self.force_path is not None and self.force_path not in REMAINDER_PATHS:
            raise ValueError(
                f"force_path must be None or one of {REMAINDER_PATHS} (the paths that take any batch "
                f"size; all_to_all is the default for full batches), got {self.force_path!r}"
            )
        if self.dispatch not in ("batched", "global"):
            raise ValueError(f"dispatch must be 'batched' or 'global', got {self.dispatch!r}")
        if self.rounds is not None and not _positive_int(self.rounds):
            raise ValueError(f"rounds must be None or an int >= 1, got {self.rounds!r}")
        if not _positive_int(self.pipeline_depth):
            raise ValueError(
                f"pipeline_depth must be None or an int >= 1 (1: one batch at a time), got {self.pipeline_depth!r}"
            )
        if self.memory_budget is not None:
            if not _positive_int(self.memory_budget):
                raise ValueError(
                    f"memory_budget must be None or an int >= 1 (bytes per rank), got {self.memory_budget!r}"
                )
            if self.rounds is not None or self.dispatch != "global":
                raise ValueError(
                    f"memory_budget sets the rounds of dispatch='global'; give it with rounds=None and "
                    f"dispatch='global', got rounds={self.rounds!r}, dispatch={self.dispatch!r}"
                )
        if self.dispatch == "global" and self.force_path is not None:
            raise ValueError(
                f"dispatch='global' chooses the path of every sharded batch; force_path must be None, "
                f"got {self.force_path!r}"
            )


@dataclass(frozen=True)
class Entry:
    """One parameter as the plan sees it: its layout, param group, kernel output dtype, whether it steps, and the
    dtype its direction travels in (None: the param's; a narrower one where the kernel reads its input only
    through a cast to it: muon_dist.kernels.send_dtype)."""

    layout: ParamLayout
    group_index: int
    update_dtype: str
    active: bool
    direction_dtype: str | None = None

    def key(self) -> tuple:
        return (self.layout.shape_key(), self.group_index, self.update_dtype, self.direction_dtype)

    @property
    def sent_dtype(self) -> str:
        return self.direction_dtype or self.layout.dtype


@dataclass(frozen=True)
class Plan:
    """Invariants: every active param is in exactly one batch and inactive params are in none; every batch meets
    its path's invariants (the path module's check)."""

    entries: tuple[Entry, ...]
    options: Options
    batches: tuple[Batch, ...]

    def __post_init__(self) -> None:
        planned = sorted(i for b in self.batches for i in b.params)
        assert planned == [i for i, e in enumerate(self.entries) if e.active], planned
        for batch in self.batches:
            PATHS[batch.path].check(batch)

    def path_of(self) -> tuple[str | None, ...]:
        """Per param, in param-group order: the path it takes (None when it does not step)."""
        paths: list[str | None] = [None] * len(self.entries)
        for batch in self.batches:
            for i in batch.params:
                paths[i] = batch.path
        return tuple(paths)

    def digest(self) -> bytes:
        """sha256 of the plan (all of it is rank-independent; computed once per plan)."""
        return self._digest

    @functools.cached_property
    def _digest(self) -> bytes:
        canon = (
            tuple(
                (e.layout, e.group_index, e.update_dtype, e.active, e.direction_dtype)
                for e in self.entries
            ),
            self.options,
            tuple(
                (b.path, b.params, b.owners, b.direction_dtype, b.update_dtype)
                for b in self.batches
            ),
        )
        return hashlib.sha256(repr(canon).encode()).digest()


def is_expert_stack(layout: ParamLayout) -> bool:
    """A 3-D [E, m, n] stack or a fused [E * m, n] bundle (num_experts), sharded along its expert dim only."""
    stack = (len(layout.global_shape) == 3 and not layout.flatten) or layout.num_experts is not None
    return stack and {parse_placement(p)[1] for p in layout.placements} <= {None, 0}


def expert_path(layout: ParamLayout) -> str | None:
    """ "local" or "subgroup_all_gather" for an expert stack whose boxes allow it; None for the all-to-all family."""
    if not is_expert_stack(layout):
        return None
    geometry = layout.geometry
    shared = [c for c in geometry.components if len(c) > 1]
    if not shared:
        return "local"
    # A component that touches one block holds exactly that block: the boxes and the blocks both tile the tensor,
    # and every holder of a block's piece is in the block's component (Geometry.components).
    one_block = all(len(geometry.blocks_of(c)) == 1 for c in shared)
    return "subgroup_all_gather" if one_block else None


def _batch_path(entry: Entry, num_params: int, options: Options) -> str:
    geometry = entry.layout.geometry
    if not geometry.sharded:
        return "replicated"
    if options.force_path is not None:
        return options.force_path
    full = num_params % geometry.group_size == 0
    return expert_path(entry.layout) or ("all_to_all" if full else options.remainder)


def round_count(options: Options, elements: float) -> int:
    """How many rounds traffic of `elements` elements goes in: Options.rounds where given; else ROUNDS, fewer
    where a round would hold under ROUND_MIN_ELEMENTS (at least one)."""
    if options.rounds is not None:
        return options.rounds
    return max(1, min(ROUNDS, int(elements // ROUND_MIN_ELEMENTS)))


def _packed(entry: Entry, group_size: int, cap: float, largest: int) -> int:
    """How many full batches of this layout's params one batch takes. In a shard group of W > 1, the all-to-all
    family only: as many as keep the batch within `cap` elements (1/rounds of the step's), at least one (other
    paths keep batches of W). In a group of one, where no collective is saved, any sharded path: as many as keep
    the batch within the step's largest param (`largest` elements) or PACK_MIN_ELEMENTS, whichever is more, at
    least one, so that same-shape params share one stack kernel call (muon_dist/kernels.orthogonalize_many) while
    the step's peak stays about its largest param's."""
    if not entry.layout.geometry.sharded or entry.layout.matrices.separate:
        return 1
    if group_size == 1:
        return max(1, max(largest, PACK_MIN_ELEMENTS) // math.prod(entry.layout.global_shape))
    if expert_path(entry.layout) is not None:
        return 1
    return max(1, int(cap // (group_size * math.prod(entry.layout.global_shape))))


@functools.lru_cache(maxsize=16)
def plan(entries: tuple[Entry, ...], options: Options) -> Plan:
    """The plan of one step: runs of same-key active params in order, cut into batches of the group size (a run
    of sharded params with separate blocks is one "blocks" batch: its units are blocks, not params). A pure
    function of its arguments, cached: a step whose layouts, groups and gradients are as before reuses its plan."""
    runs: dict[tuple, list[int]] = {}
    for i, entry in enumerate(entries):
        if entry.active:
            runs.setdefault(entry.key(), []).append(i)
    batches = []
    sizes = [math.prod(e.layout.global_shape) for e in entries if e.active]
    cap, largest = sum(sizes) / round_count(options, sum(sizes)), max(sizes, default=0)
    for members in runs.values():
        first = entries[members[0]]
        geometry = first.layout.geometry
        if geometry.sharded and first.layout.matrices.separate and options.force_path is None:
            batches.append(
                Batch(
                    "blocks",
                    tuple(members),
                    (geometry,) * len(members),
                    (),
                    first.sent_dtype,
                    first.update_dtype,
                )
            )
            continue
        W = geometry.group_size
        full = len(members) - len(members) % W
        # same-layout full batches packed into one all_to_all batch (never under force_path: its batches take W)
        per = W * (_packed(first, W, cap, largest) if options.force_path is None else 1)
        starts = [*range(0, full, per), *([full] if full < len(members) else [])]
        for start, end in zip(starts, [*starts[1:], len(members)]):
            chunk = tuple(members[start:end])
            path = _batch_path(first, len(chunk), options)
            batches.append(
                Batch(
                    path,
                    chunk,
                    (geometry,) * len(chunk),
                    PATHS[path].owners(len(chunk), geometry.group_size),
                    first.sent_dtype if PATHS[path].moves_directions else first.layout.dtype,
                    first.update_dtype,
                )
            )
    if options.dispatch == "global":
        batches, depth = _global(entries, batches, options)
        if depth < options.pipeline_depth:
            options = dataclasses.replace(options, pipeline_depth=depth)
    return Plan(tuple(entries), options, tuple(batches))


def _global(
    entries: tuple[Entry, ...], batches: list[Batch], options: Options
) -> tuple[list[Batch], int]:
    """The batches of the paths that allow it merged per (shard groups, direction dtype, update dtype), params in
    param-group order, owners by LPT on each param's Newton-Schulz FLOPs, then cut into `count` rounds (round_count
    of the merged batch's elements, with rounds None more where the memory budget needs them: _within_budget)
    (balance.rounds: each round gives each owner about 1/count of its load; empty rounds dropped). The other
    batches go between the rounds (interleave): so a write group can end with a round that carries its failure
    flag (agreement.write_groups), and their local work runs while a round's all-to-all flies. With the pipeline's
    depth: Options.pipeline_depth, or fewer where an explicit memory budget is still exceeded with one param per
    owner and round (as many rounds in flight as fit, at least one)."""
    kept, merged, global_batches, depth = [], {}, [], options.pipeline_depth
    for batch in batches:
        if not PATHS[batch.path].global_dispatch or batch.group_size == 1:
            kept.append(batch)  # (a group of one moves nothing: its batches stay one param each)
            continue
        key = (batch.geometries[0].groups, batch.direction_dtype, batch.update_dtype)
        merged.setdefault(key, []).extend(batch.params)
    for (_, direction_dtype, update_dtype), params in merged.items():
        params.sort()
        costs = [
            sum(ns_flops(b.fan_out, b.fan_in) for b in entries[i].layout.matrices.blocks)
            for i in params
        ]
        geometries = tuple(entries[i].layout.geometry for i in params)
        owners = lpt(costs, geometries[0].group_size)
        elements = sum(math.prod(g.global_shape) for g in geometries)
        count = round_count(options, elements)
        round_of = rounds(costs, owners, count)
        if options.rounds is None:
            # no round with two params of one owner; under the default budget none under ROUND_MIN_ELEMENTS
            limit = max(owners.count(o) for o in set(owners))
            if options.memory_budget is None:
                limit = min(limit, max(count, int(elements // ROUND_MIN_ELEMENTS)))
            per_element = itemsize(direction_dtype) + itemsize(update_dtype)
            budget = options.memory_budget
            if budget is None:
                times, over = BUDGET_FLOOR_ROUNDS
                budget = (
                    options.pipeline_depth * times * floor_round(geometries, per_element) // over
                )
            count, round_of, most = _within_budget(
                geometries,
                owners,
                costs,
                (count, limit),
                round_of,
                per_element,
                options.pipeline_depth,
                budget,
            )
            if options.memory_budget is not None and options.pipeline_depth * most > budget:
                depth = min(
                    depth, max(1, budget // most)
                )  # at the floor and still over: fewer in flight
        for r in range(count):
            members = [k for k, rr in enumerate(round_of) if rr == r]
            if members:
                global_batches.append(
                    Batch(
                        "global_all_to_all",
                        tuple(params[k] for k in members),
                        tuple(geometries[k] for k in members),
                        tuple(owners[k] for k in members),
                        direction_dtype,
                        update_dtype,
                    )
                )
    return interleave(kept, global_batches), depth


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype by its name ("torch.bfloat16": 2)."""
    return getattr(torch, dtype.removeprefix("torch.")).itemsize


def round_buffers(
    geometries: Sequence[Geometry], owners: Sequence[int], per_element: int
) -> list[int]:
    """The bytes each member of a global_all_to_all batch (`geometries`, `owners`) sends and receives, both
    exchanges together: the paths' own traffic formula (paths.exchange.exchange_bytes, sent + received: an owner,
    the elements of its params that it lacks, each way; another member, its boxes of them, each way), at
    `per_element` bytes per element (the direction's itemsize plus the update's, counted here on the direction's
    side): the model of the batch's communication buffers on each rank."""
    together = {"both": per_element, "none": 0}
    return [
        sum(exchange_bytes(geometries, owners, member, together, "both", "none") or (0, 0))
        for member in range(geometries[0].group_size)
    ]


def floor_round(geometries: Sequence[Geometry], per_element: int) -> int:
    """The bytes a member sends and receives in a round in which every member of the shard group orthogonalises one
    of the largest matrices (of `geometries`): an owner's lacking part of it each way, and its box of each other
    member's, 2 (W - 1) / W of the matrix at `per_element` bytes an element (the direction's and the update's
    itemsize together): the least a round holding the largest matrix moves where every member owns one."""
    W = geometries[0].group_size
    largest = max(math.prod(g.global_shape) for g in geometries)
    return 2 * (W - 1) * largest * per_element // W


def _within_budget(
    geometries: Sequence[Geometry],
    owners: list[int],
    costs: list[int],
    counts: tuple[int, int],
    round_of: list[int],
    per_element: int,
    depth: int,
    budget: int,
) -> tuple[int, list[int], int]:
    """The fewest rounds from `counts` = (count, limit), at most limit, whose buffers stay within the budget:
    `depth` (the batches in flight) times the most any member moves in one round (round_buffers) at most `budget`
    bytes (else `limit` rounds). With the round of each param (balance.rounds; `round_of`: count's) and that
    most any member moves in one round."""
    count, limit = counts
    while True:
        most = max(
            max(
                round_buffers(
                    [g for g, r in zip(geometries, round_of) if r == j],
                    [o for o, r in zip(owners, round_of) if r == j],
                    per_element,
                )
            )
            for j in set(round_of)
        )
        if count >= limit or depth * most <= budget:
            return count, round_of, most
        count += 1
        round_of = rounds(costs, owners, count)


def buffer_bytes(plan: Plan, rank: int, itemsizes: Mapping[str, int]) -> int:
    """A model of this rank's communication buffers at the step's peak: min(pipeline_depth, batches) times the
    most it sends and receives in one batch (each path's expected_bytes, both exchanges). An upper bound of what
    the batches in flight allocate for their collectives; what each holds at once depends on the pipeline's order
    (docs/benchmarks.md, "A memory budget for the rounds")."""
    most = 0
    for batch in plan.batches:
        moved = PATHS[batch.path].expected_bytes(batch, batch.geometries[0].member(rank), itemsizes)
        if moved is not None:
            most = max(most, sum(moved))
    return min(plan.options.pipeline_depth, len(plan.batches)) * most


def interleave(others: list[Batch], global_batches: list[Batch]) -> list[Batch]:
    """`others` in order, cut into one run of about equal length per global batch, each run right before its
    global batch (with none: `others` as they are)."""
    if not global_batches:
        return others
    runs: list[list[Batch]] = [[] for _ in global_batches]
    for i, batch in enumerate(others):
        runs[i * len(global_batches) // len(others)].append(batch)
    return [b for run, last in zip(runs, global_batches) for b in (*run, last)]


def expected_bytes(
    plan: Plan, rank: int, itemsizes: Mapping[str, int]
) -> dict[str, tuple[int, int]]:
    """This rank's bytes (sent, received) by path, from each path's formula; a path whose batches call no
    collective on this rank has no entry (as in the comm's ledger)."""
    totals: dict[str, list[int]] = {}
    for batch in plan.batches:
        moved = PATHS[batch.path].expected_bytes(batch, batch.geometries[0].member(rank), itemsizes)
        if moved is not None:
            acc = totals.setdefault(batch.path, [0, 0])
            acc[0] += moved[0]
            acc[1] += moved[1]
    return {k: (v[0], v[1]) for k, v in totals.items()}


def expected_collectives(plan: Plan, rank: int) -> dict[str, int]:
    """This rank's data collectives in a step of the plan, by path: each batch's Path.collectives where the rank
    calls any (its expected_bytes is not None), as the comm's calls log them (a failure flag that rides along is
    no collective of its own); the step's control collectives (agreement.CHECKS) are not counted."""
    totals: dict[str, int] = {}
    any_size = defaultdict(lambda: 1)  # whether a batch moves bytes here, not how many
    for batch in plan.batches:
        path = PATHS[batch.path]
        if path.expected_bytes(batch, batch.geometries[0].member(rank), any_size) is not None:
            totals[batch.path] = totals.get(batch.path, 0) + path.collectives
    return totals


def expected_flops(plan: Plan, rank: int, steps: int = 5) -> int:
    """This rank's Newton-Schulz FLOPs in a step of the plan, from each path's kernel calls (Path.work): for every
    call, balance.ns_flops of every whole block of the param inside the call's box (a padding matrix counts as
    a matrix of its batch's first param). The cost model of balance.py, `steps` steps per matrix."""
    total = 0
    for batch in plan.batches:
        member = batch.geometries[0].member(rank)
        for k, box in PATHS[batch.path].work(batch, member):
            if box.numel:  # an empty box: no kernel call (muon_dist.step.kernel_for)
                total += _box_flops(plan.entries[batch.params[k]].layout.matrices, box, steps)
    return total


@functools.lru_cache(maxsize=65536)
def _box_flops(matrices: MatrixLayout, box: Box, steps: int) -> int:
    """balance.ns_flops of the whole blocks of `matrices` inside `box` (cached: a pure function)."""
    return sum(ns_flops(b.fan_out, b.fan_in, steps) for b in blocks_in(matrices, box).blocks)
