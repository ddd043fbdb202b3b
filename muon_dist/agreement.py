"""The step's agreement protocol: what every rank learns from every other rank, so that a disagreement or a
failure is an error on every rank, never a hang.

  1. plan_digest: all-gather the digest of the step's plan (a pure function of every param's layout,
     muon_dist/plan.py) tagged with whether this rank holds a non-finite gradient, or the digest of this rank's
     local error; if any differs, every rank raises ValueError after a second all-gather that names the ranks
     (agree, disagree: one collective per step when all agree);
  2. nonfinite_check, only when a rank holds a non-finite gradient: all-gather every rank's non-finite flags; a
     param with a non-finite gradient on any rank raises ValueError on every rank (nonfinite="raise") or does
     not step on any rank ("skip") (nonfinite);
  3. failure_check, after each write group's batches (write_groups): whether any rank's local work raised
     (recorded by guarded, which answers the failed call with zeros so the rank keeps joining the remaining
     collectives). Then every rank raises RuntimeError and that group and the later ones are not written
     (agree_no_failure). Where the group's last batch runs over the whole world on a path that carries a flag
     (Path.carries_flag), its last collective carries each rank's flag, at no collective's cost; else one
     all-gather of 32-byte digests over the world, at most WRITE_GROUPS per step (one when atomic).
Every decision is a function of what all ranks gathered, so every rank takes it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
from torch import Tensor

from muon_ref import MuonConfig

from .batch import Batch
from .comm import Comm
from .geometry import Box
from .plan import Entry, Plan

# the step's control collectives, each logged under its own name (every other name in the ledger is a path's)
CHECKS: tuple[str, ...] = ("plan_digest", "nonfinite_check", "failure_check")
# a step writes in at most this many groups (each after its own failure check), unless atomic: the new momentum
# buffers and updates held at once are about 1/WRITE_GROUPS of the step's, not all of them; but a group that ends
# with a check of its own holds at least WRITE_GROUP_MIN_ELEMENTS elements (1 MiB of fp32 updates): below that, the
# check's collective costs more than the memory it saves (docs/benchmarks.md, "Rounds by size")
WRITE_GROUPS = 16
WRITE_GROUP_MIN_ELEMENTS = 1 << 18

Failures = list[tuple[str, Exception]]


def _error_digest(error: str) -> bytes:
    return hashlib.sha256(b"error:" + error.encode()).digest()


def agree(comm: Comm, step_plan: Plan, error: str | None, nonfinite_here: bool) -> bool:
    """Step 1 with step 2's question, in one all-gather of 32 bytes per rank: the plan's digest tagged with
    whether this rank holds a non-finite gradient piece (or its local error's digest). Returns whether any rank
    does; a digest that is neither tag of this rank's plan (a local error, another plan) takes every rank to
    disagree(), which raises ValueError."""
    tagged = {
        here: hashlib.sha256(tag + step_plan.digest()).digest()
        for here, tag in ((False, b"finite:"), (True, b"nonfinite:"))
    }
    digests = comm.check_agreement(
        _error_digest(error) if error else tagged[nonfinite_here], "plan_digest"
    )
    if any(d not in tagged.values() for d in digests):
        disagree(comm, step_plan, error)
    return tagged[True] in digests


def disagree(comm: Comm, step_plan: Plan, error: str | None) -> NoReturn:
    """ValueError on every rank, after a second all-gather of the untagged digests (or the local errors'), which
    every rank reaches together: if two ranks' plans differ, every rank's differs from one of them, and a local
    error's digest is no plan's. The message names the ranks whose digest differs from rank 0's."""
    digests = comm.check_agreement(
        _error_digest(error) if error else step_plan.digest(), "plan_digest"
    )
    if error:
        raise ValueError(error)
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    mine = [
        (e.layout.name, e.layout.global_shape, e.layout.placements, e.layout.dtype, e.active)
        for e in step_plan.entries
    ]
    raise ValueError(
        f"DistributedMuon: ranks {differ} disagree with rank 0 on the step's plan (param shapes, "
        f"dtypes, placements, meshes, param groups, which params have gradients, or a local "
        f"error on that rank); rank {comm.rank} sees (name, shape, placements, dtype, has grad): "
        f"{mine}"
    )


def _flag_units(entry: Entry, rank: int) -> list[Box | None]:
    """The parts of a param whose finiteness is flagged apart, as this rank's boxes: one per block of a separate
    layout (its blocks step, and are skipped, as params of their own), else the whole box. None: no piece here."""
    geometry = entry.layout.geometry
    box = geometry.boxes[geometry.member(rank)]
    if not entry.layout.matrices.separate:
        return [Box((0,) * len(box.shape), box.shape)]
    return [
        part.within(box) if (part := box.intersect(b)) else None
        for b in entry.layout.matrices.blocks
    ]


def _nonfinite_flags(pieces: Sequence[Tensor | None], device: torch.device) -> Tensor:
    """uint8 per piece: 1 where it holds a NaN or an infinity (0 for None or an empty piece), exactly. First one
    sum per piece (in float32 at least): a NaN or an infinity anywhere makes the sum a NaN or an infinity, so a
    finite sum clears its piece, in one pass that reads the gradient once and writes nothing. Only a piece whose
    sum is not finite (a non-finite element, or finite elements whose sum overflows) is read again by aminmax:
    its min and max are both finite iff every element is (aminmax propagates NaN; an infinity is its min or
    max)."""
    present = [i for i, x in enumerate(pieces) if x is not None and x.numel()]
    local = torch.zeros(len(pieces), dtype=torch.uint8, device=device)
    if not present:
        return local
    sums = torch.stack([_sum(pieces[i]) for i in present])
    suspect = sums.isfinite().logical_not()
    # one device-to-host copy (prepare's own check of the flags follows it anyway)
    if not bool(suspect.any()):
        return local
    again = [present[k] for k in suspect.nonzero().flatten().tolist()]
    extremes = torch.stack([torch.stack(torch.aminmax(pieces[i])) for i in again])
    local[again] = extremes.isfinite().all(dim=1).logical_not().to(device, torch.uint8)
    return local


def _sum(piece: Tensor) -> Tensor:
    """The sum of a piece's elements in float32, or in its own dtype where that is wider (float64)."""
    wide = piece.dtype == torch.float64
    return piece.sum() if wide else piece.sum(dtype=torch.float32)


def local_flags(comm: Comm, entries: Sequence[Entry], grads: Sequence[Tensor | None]) -> Tensor:
    """This rank's non-finite flag of every flag unit (_flag_units) of every param's local gradient, in order."""
    units = [_flag_units(e, comm.rank) for e in entries]
    return _nonfinite_flags(
        [
            grad[part.index] if grad is not None and part is not None else None
            for grad, parts in zip(grads, units)
            for part in parts
        ],
        comm.device,
    )


def nonfinite(
    comm: Comm,
    entries: Sequence[Entry],
    flags: Tensor,
    configs: Sequence[MuonConfig],
) -> tuple[set[int], dict[int, tuple[int, ...]]]:
    """Step 2, when agree() found a non-finite gradient piece on some rank: the params whose gradient is
    non-finite on any rank (one small all-gather of every rank's `flags` over the world, one device-to-host
    copy): (params skipped whole, {param: its skipped blocks} for separate layouts with some finite blocks, whose
    other blocks step as muon_ref steps them); ValueError naming the first such param whose group says
    nonfinite="raise"."""
    units = [_flag_units(e, comm.rank) for e in entries]
    gathered = (
        comm.all_gather(flags, comm.world_group(), "nonfinite_check")
        .cpu()
        .reshape(comm.world_size, -1)
    )
    bad = gathered.amax(dim=0).tolist()
    skip, partial, start = set(), {}, 0
    for i, parts in enumerate(units):
        blocks = tuple(b for b, flag in enumerate(bad[start : start + len(parts)]) if flag)
        start += len(parts)
        if not blocks:
            continue
        if configs[i].nonfinite == "raise":
            layout = entries[i].layout
            raise ValueError(
                f"{layout.name} of shape {layout.global_shape} has a non-finite gradient (NaN or Inf)"
            )
        if len(blocks) == len(parts) or not entries[i].layout.matrices.separate:
            skip.add(i)
        else:
            partial[i] = blocks
    return skip, partial


def guarded(
    failures: Failures,
    what: str,
    fn: Callable[..., Any],
    fallback: Callable[..., Any],
) -> Callable[..., Any]:
    """fn, except that an exception is recorded in `failures` and answered with fallback(*args) (zeros): the rank
    keeps taking part in the step's remaining collectives instead of leaving its peers blocked in them, and
    step 3 then raises on every rank before anything is written."""

    def run(*args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - re-raised by agree_no_failure, with its rank
            failures.append((what, e))
            return fallback(*args)

    return run


def agree_no_failure(
    comm: Comm,
    failures: Failures,
    written: int,
    failed: list[int] | None = None,
) -> None:
    """Step 3: after a write group's last data collective, before it writes: if the local work of any rank failed,
    every rank raises (promptly: no rank waits on a collective its peer never joins). `failed`: the failed ranks
    as the group's last collective carried them (FailureFlag, a world-wide collective), else None: a digest
    all-gather over the world finds them. Every rank decides from the same list (its own flag as sent, never a
    failure recorded since: that one belongs to a later group, whose check carries it). `written`: the batches
    of the plan that earlier write groups wrote on every rank."""
    if failed is None:
        ok = hashlib.sha256(b"step ok").digest()
        digests = comm.check_agreement(
            hashlib.sha256(b"step failed").digest() if failures else ok, "failure_check"
        )
        failed = [r for r, d in enumerate(digests) if d != ok]
    state = (
        "no param or momentum buffer was written on any rank"
        if not written
        else f"the first {written} batches of the step's plan were written on every rank, no other param or buffer"
    )
    if (
        comm.rank in failed
    ):  # a failure recorded after this rank's flag was sent waits for a later check
        what, e = failures[0]
        raise RuntimeError(
            f"DistributedMuon: rank {comm.rank} failed mid-step in {what} ({type(e).__name__}: {e}); "
            f"failed ranks {failed}; {state}"
        ) from e
    if failed:
        raise RuntimeError(
            f"DistributedMuon: ranks {failed} failed mid-step (their own errors name the cause); "
            f"{state}"
        )


def write_groups(
    step_plan: Plan, atomic: bool, free: Sequence[bool] | None = None
) -> list[tuple[Batch, ...]]:
    """The plan's batches in order, cut into write groups: the whole step when `atomic`; else a group closes after
    a batch whose failure check is free (`free[b]` for batch b: its path carries the flag over the whole world)
    or once its params' elements reach 1/WRITE_GROUPS of the step's (at least WRITE_GROUP_MIN_ELEMENTS), unless
    the next batch's check is free: then that batch closes it, and its check carries the group's (so at most
    WRITE_GROUPS groups end with a check of their own, and a group holds at most two batches more than that
    share). Global sizes and the plan's batches, never a rank's box: every rank must cut the same groups, or their
    failure checks would not match (a collective mismatch)."""
    if atomic:  # one group, or none in a step where no param has a gradient
        return [step_plan.batches] if step_plan.batches else []
    sizes = [
        sum(math.prod(g.global_shape) for g in batch.geometries) for batch in step_plan.batches
    ]
    free = free if free is not None else [False] * len(sizes)
    share = max(sum(sizes) / WRITE_GROUPS, WRITE_GROUP_MIN_ELEMENTS)
    groups, current, held = [], [], 0
    for b, (batch, size, cheap) in enumerate(zip(step_plan.batches, sizes, free)):
        current.append(batch)
        held += size
        carried = b + 1 < len(free) and free[b + 1]  # the next batch's check can carry this group's
        if cheap or (held >= share and not carried):
            groups.append(tuple(current))
            current, held = [], 0
    return groups + ([tuple(current)] if current else [])
