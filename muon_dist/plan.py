"""plan(): a pure function of every parameter's layout -> a frozen Plan, identical on every rank.

Params with the same layout, the same param group and the same kernel output dtype form a run; a run on a
sharded layout is cut, in param-group order, into batches of W (the shard group's size) that take the
all-to-all path, and a remainder batch of R < W that takes the remainder path (AGRS, or the padded
all-to-all). Replicated runs are cut into batches of at most W. Member k of the group orthogonalises param
k of its batch. The digest of the plan is compared across ranks before the first data collective.

Expert stacks sharded on their expert dim (3-D [E, m, n], or fused [E * m, n] with num_experts; on a 1-D
FSDP mesh or an (ep, fsdp) mesh with (Shard(0), Shard(0))) are planned from where the boxes fall, never from
mesh names: if every member holds whole experts, "local" (E_local % fsdp == 0, and every 3-D stack); else if
the members that share an expert hold exactly that one expert, "subgroup_all_gather" (fsdp % E_local == 0
with the expert's rows divisible by fsdp / E_local); else the all-to-all family over the whole shard group
(proofs/paths.md#expert-fallback). E % ep != 0 needs no special case: the boxes say which case it is.

dispatch="global" (Options.dispatch) then merges every batch of the all-to-all family (all_to_all, agrs,
padded_all_to_all) into one "global_all_to_all" batch per (shard group, direction dtype, update dtype), each
param owned by the member that muon_dist.balance.lpt gives it (cost: ns_flops of its matrices times their
number; ties to the lowest param index and rank). Expert paths and replicated batches stay as they are.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal

from .balance import lpt, ns_flops
from .layout import ParamLayout

PATHS: tuple[str, ...] = ("all_to_all", "agrs", "padded_all_to_all", "replicated", "local", "subgroup_all_gather",
                          "global_all_to_all")
A2A_FAMILY = ("all_to_all", "agrs", "padded_all_to_all")
RemainderPath = Literal["agrs", "padded_all_to_all"]


@dataclass(frozen=True)
class Options:
    """remainder: the path of a remainder batch. force_path: every sharded batch takes this path, full or not
    (so only the paths that take any batch size: "agrs" or "padded_all_to_all"). dispatch: "batched" (batches of
    W same-layout params) or "global" (one LPT-balanced batch per shard group and dtype pair)."""

    remainder: RemainderPath = "agrs"
    force_path: str | None = None
    dispatch: Literal["batched", "global"] = "batched"

    def __post_init__(self) -> None:
        if self.remainder not in ("agrs", "padded_all_to_all"):
            raise ValueError(f"remainder must be 'agrs' or 'padded_all_to_all', got {self.remainder!r}")
        if self.force_path not in (None, "agrs", "padded_all_to_all"):
            raise ValueError(f"force_path must be None, 'agrs' or 'padded_all_to_all' (all_to_all takes only full "
                             f"batches: it is the default for them), got {self.force_path!r}")
        if self.dispatch not in ("batched", "global"):
            raise ValueError(f"dispatch must be 'batched' or 'global', got {self.dispatch!r}")
        if self.dispatch == "global" and self.force_path is not None:
            raise ValueError(f"dispatch='global' chooses the path of every sharded batch; force_path must be None, "
                             f"got {self.force_path!r}")


@dataclass(frozen=True)
class Entry:
    """One parameter as the plan sees it: its layout, param group, kernel output dtype, and whether it steps."""

    layout: ParamLayout
    group_index: int
    update_dtype: str
    active: bool

    def key(self) -> tuple:
        return (self.layout.signature()[1:], self.group_index, self.update_dtype)

    def canonical(self) -> tuple:
        return (self.layout.signature(), self.group_index, self.update_dtype, self.active)


@dataclass(frozen=True)
class Batch:
    """Invariants: 1 <= len(params) <= group_size (any number on global_all_to_all); num_padding ==
    group_size - len(params) on the padded path, 0 elsewhere; all_to_all batches are full (len(params) ==
    group_size); owners (global_all_to_all only, else empty): the owning member of each param."""

    path: str
    params: tuple[int, ...]
    group_size: int
    num_padding: int
    owners: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        is_global = self.path == "global_all_to_all"
        assert self.path in PATHS and 1 <= len(self.params) and (is_global or len(self.params) <= self.group_size), self
        assert len(self.owners) == (len(self.params) if is_global else 0), self
        assert all(0 <= o < self.group_size for o in self.owners), self
        assert self.path != "all_to_all" or len(self.params) == self.group_size, self
        want = self.group_size - len(self.params) if self.path == "padded_all_to_all" else 0
        assert self.num_padding == want, self


@dataclass(frozen=True)
class Plan:
    """Invariants: every active param is in exactly one batch; inactive params are in none."""

    entries: tuple[Entry, ...]
    options: Options
    batches: tuple[Batch, ...]

    def __post_init__(self) -> None:
        planned = sorted(i for b in self.batches for i in b.params)
        assert planned == [i for i, e in enumerate(self.entries) if e.active], planned

    def path_of(self) -> tuple[str | None, ...]:
        """Per param, in param-group order: the path it takes (None when it does not step)."""
        paths: list[str | None] = [None] * len(self.entries)
        for batch in self.batches:
            for i in batch.params:
                paths[i] = batch.path
        return tuple(paths)

    def digest(self) -> bytes:
        """sha256 of the rank-independent content (never this rank's shard box)."""
        canon = (tuple(e.canonical() for e in self.entries), self.options, self.batches)
        return hashlib.sha256(repr(canon).encode()).digest()


def expert_path(layout: ParamLayout) -> str | None:
    """"local" or "subgroup_all_gather" for an expert stack whose boxes allow it; None for the all-to-all family."""
    if layout.expert_rows is None:
        return None
    components = layout.expert_components()
    if all(len(c) == 1 for c in components):
        return "local"
    unions = [sum(layout.box(j)[1][0] for j in c) for c in components if len(c) > 1]
    return "subgroup_all_gather" if all(u == layout.expert_rows for u in unions) else None


def _batch_path(layout: ParamLayout, num_params: int, group_size: int, options: Options) -> str:
    if layout.shard_dim is None:
        return "replicated"
    if options.force_path is not None:
        return options.force_path
    return expert_path(layout) or ("all_to_all" if num_params == group_size else options.remainder)


def plan(entries: tuple[Entry, ...], options: Options) -> Plan:
    """The plan of one step: runs of same-key active params in order, cut into batches of the group size."""
    runs: dict[tuple, list[int]] = {}
    for i, entry in enumerate(entries):
        if entry.active:
            runs.setdefault(entry.key(), []).append(i)
    batches = []
    for members in runs.values():
        layout = entries[members[0]].layout
        size = len(layout.group_ranks())
        for start in range(0, len(members), size):
            chunk = tuple(members[start:start + size])
            path = _batch_path(layout, len(chunk), size, options)
            padding = size - len(chunk) if path == "padded_all_to_all" else 0
            batches.append(Batch(path, chunk, size, padding))
    if options.dispatch == "global":
        batches = _global(entries, batches)
    return Plan(tuple(entries), options, tuple(batches))


def _global(entries: tuple[Entry, ...], batches: list[Batch]) -> list[Batch]:
    """The all-to-all family's batches merged per (shard group, direction dtype, update dtype), after the other
    batches, params in param-group order, owners by LPT on each param's Newton-Schulz FLOPs."""
    kept, merged = [], {}
    for batch in batches:
        if batch.path not in A2A_FAMILY:
            kept.append(batch)
            continue
        layout = entries[batch.params[0]].layout
        key = (layout.all_groups(), layout.dtype, entries[batch.params[0]].update_dtype)
        merged.setdefault(key, []).extend(batch.params)
    for (groups, *_), params in merged.items():
        params.sort()
        costs = [m.num_matrices * ns_flops(m.fan_out, m.fan_in) for m in (entries[i].layout.matrices for i in params)]
        W = len(groups[0])
        kept.append(Batch("global_all_to_all", tuple(params), W, 0, tuple(lpt(costs, W))))
    return kept


def expected_bytes(plan: Plan, itemsizes: dict[str, int]) -> dict[str, tuple[int, int]]:
    """This rank's bytes (sent, received) by path, from the formulas of each path's docstring."""
    totals: dict[str, list[int]] = {}
    for batch in plan.batches:
        if batch.path == "global_all_to_all":
            sent, received = _global_bytes(plan, batch, itemsizes)
            acc = totals.setdefault(batch.path, [0, 0])
            acc[0] += sent
            acc[1] += received
            continue
        entry = plan.entries[batch.params[0]]
        layout, W = entry.layout, batch.group_size
        sizes = [math.prod(layout.box(j)[1]) for j in range(W)]
        grad_b, upd_b = itemsizes[layout.dtype], itemsizes[entry.update_dtype]
        member = layout.group_ranks().index(layout.rank)
        if batch.path in ("local", "subgroup_all_gather"):
            component = next(c for c in layout.expert_components() if member in c)
            if len(component) == 1:
                continue  # no collective on this rank
            sizes, member = [sizes[j] for j in component], component.index(member)
        sent, received = _path_bytes(batch, sizes, member, grad_b, upd_b, math.prod(layout.global_shape))
        acc = totals.setdefault(batch.path, [0, 0])
        acc[0] += sent
        acc[1] += received
    return {k: (v[0], v[1]) for k, v in totals.items()}


def _path_bytes(batch: Batch, sizes: list[int], me: int, grad_b: int, upd_b: int, numel: int) -> tuple[int, int]:
    """all_to_all / padded: my shard of each other owner's matrix out, the others' shards of mine in, and back.
    agrs: all-gather of R shards padded to max(sizes), reduce-scatter of the same. replicated: all-gather.
    subgroup_all_gather (sizes: the boxes of my component only, EP-local): all-gather of R boxes padded to
    max(sizes), directions only."""
    W, R = batch.group_size, len(batch.params)
    if batch.path in ("all_to_all", "padded_all_to_all"):
        mine_out = (W - 1) * sizes[me]
        others_in = sum(sizes) - sizes[me]
        return mine_out * grad_b + others_in * upd_b, others_in * grad_b + mine_out * upd_b
    if batch.path == "agrs":
        moved = (W - 1) * R * max(sizes)
        return moved * (grad_b + upd_b), moved * (grad_b + upd_b)
    if batch.path == "subgroup_all_gather":
        moved = (len(sizes) - 1) * R * max(sizes) * grad_b
        return moved, moved
    moved = (W - 1) * numel * upd_b
    return moved, moved


def _global_bytes(plan: Plan, batch: Batch, itemsizes: dict[str, int]) -> tuple[int, int]:
    """global_all_to_all: a param I do not own: my box out, its update's box back; a param I own: every other
    member's box in, and back out. Per param, over all ranks: its size minus the owner's box, each way."""
    sent = received = 0
    for i, owner in zip(batch.params, batch.owners):
        entry = plan.entries[i]
        layout = entry.layout
        grad_b, upd_b = itemsizes[layout.dtype], itemsizes[entry.update_dtype]
        me = layout.group_ranks().index(layout.rank)
        box = math.prod(layout.box(me)[1])
        lacking = math.prod(layout.global_shape) - box
        if owner == me:
            sent, received = sent + lacking * upd_b, received + lacking * grad_b
        else:
            sent, received = sent + box * grad_b, received + box * upd_b
    return sent, received
