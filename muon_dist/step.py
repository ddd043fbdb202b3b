"""One distributed Muon step, as a function of this rank's local shards (DistributedMuon is a thin optimizer over
it, as muon_ref.Muon is over muon_ref.functional).

    step_plan = prepare(comm, entries, inputs, configs, options, error)
    for index, new_param, new_buf in execute(comm, step_plan, inputs, configs, backend, group_for,
                                             out_params=...): ...

Protocol, the same on every rank (so a disagreement is an error on every rank, never a hang):
  1. all-gather the digest of the plan of the step (a pure function of every param's layout, muon_dist/plan.py)
     tagged with whether this rank has a non-finite gradient, or the digest of this rank's local error; raise
     ValueError on every rank if any plan differs, after a second all-gather that names the ranks
     ("plan_digest": one collective per step when all agree);
  2. only when a rank has a non-finite gradient: all-gather the non-finite flags of the gradients; a param with a
     non-finite gradient on any rank raises ValueError on every rank (nonfinite="raise") or does not step on any
     rank ("skip") ("nonfinite_check");
  3. momentum and direction on each local shard (muon_dist/elementwise.py: the reference's bits per element),
     the direction cast to the batch's direction dtype where the plan sends a narrower one (the kernel's own
     first op, muon_ref.newton_schulz.input_cast: the same bits);
  4. each batch of the plan through its path (muon_dist/paths): some member runs the backend's kernel on whole
     blocks; every member gets back its box of each update. Paths of the all-to-all family run as Steps that
     yield after issuing each collective, staggered over up to PIPELINE_DEPTH batches (staggered(): batch n's
     directions go out while batch n - 1 runs its kernels and batch n - 2's updates come back), in an order
     that is a pure function of the plan, so every rank issues the same collectives in the same order;
  5. after each write group's batches (write_groups), learn whether any rank's local work raised
     ("failure_check"): then every rank raises RuntimeError and that group and the later ones are not written (a
     failed rank joined the group's remaining collectives with zeros, so no peer waits for it; every rank wrote
     the same earlier groups). Where the group's last batch runs over the whole world on a path that carries a
     flag (all-to-all family), its update all-to-all carries each rank's failure flag, one element per piece,
     and the group is that batch's end (so every such batch is its own write group, at no collective's cost);
     else an all-gather of 32-byte digests over the world, at most WRITE_GROUPS per step (one for the whole step
     when atomic). The flag is read after the group's last kernel ran; only views of the received buffer are
     taken after it;
  6. yield each param of the group: its new local shard and new momentum buffer, one param at a time (the caller
     writes the buffer, and the param unless it is the destination already), then go on with the next group. With
     `out_params` (this rank's local param tensors, the caller's destinations), the new param is written into
     out_params[i] here, after the group's failure check: in place by the update's own ops where that is bitwise
     (apply_in_place), else computed as without it and copied; the yielded new param is then out_params[i].
Without out_params nothing here writes an input; with it, only out_params, in step 6. Equation (proofs/paths.md):
on every rank r, for every param that steps,
    new_param == box_r(muon_ref's P'),   new_buf == box_r(muon_ref's M')
bitwise with the torch backend (another backend: its tolerance, muon_dist/kernels).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import Tensor

from muon_ref import MatrixLayout, MuonConfig
from muon_ref.functional import apply_update, momentum_direction

from .batch import Batch, FailureFlag, Kernel, Steps
from .comm import Comm, Group
from .elementwise import run_stage, runs_as_is
from .geometry import Box, Geometry
from .kernels import Backend
from .paths import PATHS
from .plan import Entry, Options, Plan, plan

# the step's control collectives, each logged under its own name (every other name in the ledger is a path's)
CHECKS: tuple[str, ...] = ("plan_digest", "nonfinite_check", "failure_check")
# batches whose Steps are in flight at once (staggered): one issuing its directions, one running its kernels, one
# receiving its updates
PIPELINE_DEPTH = 3
# a step writes in at most this many groups (each after its own failure check), unless atomic: the new momentum
# buffers and updates held at once are about 1/WRITE_GROUPS of the step's, not all of them
WRITE_GROUPS = 16


@dataclass(frozen=True)
class ParamInput:
    """One param's local shards (read, never written): the param, its gradient (None: no gradient this step on
    this rank) and its momentum buffer."""

    param: Tensor
    grad: Tensor | None
    buf: Tensor


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
    """uint8 per piece: 1 where it holds a NaN or an infinity (0 for None or an empty piece). One aminmax per
    piece: its min and max are both finite iff every element is (it propagates NaN; an infinity is its min or
    max), in one pass without isfinite's boolean copy; then one isfinite over all the extremes."""
    present = [i for i, x in enumerate(pieces) if x is not None and x.numel()]
    local = torch.zeros(len(pieces), dtype=torch.uint8, device=device)
    if present:
        extremes = torch.stack([torch.stack(torch.aminmax(pieces[i])) for i in present])
        bad = extremes.isfinite().all(dim=1).logical_not()
        local[present] = bad.to(device, torch.uint8)
    return local


def local_flags(comm: Comm, entries: Sequence[Entry], inputs: Sequence[ParamInput]) -> Tensor:
    """This rank's non-finite flag of every flag unit (_flag_units) of every param, in order."""
    units = [_flag_units(e, comm.rank) for e in entries]
    return _nonfinite_flags(
        [
            x.grad[part.index] if x.grad is not None and part is not None else None
            for x, parts in zip(inputs, units)
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


def elementwise(
    stage: Callable[[MatrixLayout], Callable[..., tuple[Tensor, ...]]],
    inputs: Sequence[Tensor],
    matrices: MatrixLayout,
    global_shape: tuple[int, ...],
    box: Box,
) -> tuple[Tensor, ...]:
    """An elementwise stage on this rank's box with the reference's bits: on the whole param for a shared layout;
    for a separate layout (split_sizes, num_heads) on each block's part of the box, as the block's own tensor
    (muon_ref steps each block as a param of its own: muon_ref.functional.map_blocks)."""
    if not matrices.separate:
        return run_stage(stage(matrices), inputs, global_shape, box)
    if (
        not box.numel
    ):  # nothing here: any block's stage on the empty inputs gives the empty outputs' dtypes
        return run_stage(stage(matrices.blocks[0].as_param()), inputs, global_shape, box)
    outs: list[Tensor] = []
    for block in matrices.blocks:
        part = box.intersect(block)
        if part is None:
            continue
        mine = part.within(box)
        results = run_stage(
            stage(block.as_param()),
            [x[mine.index].contiguous() for x in inputs],
            block.shape,
            part.within(block),
        )
        if not outs:
            outs = [torch.empty(box.shape, dtype=r.dtype, device=r.device) for r in results]
        for out, r in zip(outs, results):
            out[mine.index] = r
    return tuple(outs)


def within(matrices: MatrixLayout, box: Box) -> MatrixLayout:
    """The layout of the whole blocks inside `box`, in the box's coordinates (the box holds whole blocks)."""
    if box.shape == matrices.shape:  # the whole param
        return matrices
    inside = [b for b in matrices.blocks if box.intersect(b) == Box(b.offsets, b.shape)]
    shifted = tuple(
        type(b)(tuple(o - q for o, q in zip(b.offsets, box.offsets)), b.shape, b.fan_out, b.fan_in)
        for b in inside
    )
    if matrices.separate:
        return MatrixLayout(len(shifted), None, None, shifted, separate=True)
    return MatrixLayout(len(shifted), matrices.fan_out, matrices.fan_in, shifted)


def kernel_for(backend: Backend, matrices: MatrixLayout, cfg: MuonConfig) -> Kernel:
    """The param's kernel: the backend's orthogonalize on the whole blocks of any box of the param, its result in
    row-major order (the update layout muon_dist implements: muon_dist/optim.py UPDATE_LAYOUT; a no-op copy where
    the backend returns it so, a tall matrix's transposed view otherwise), whatever cfg.update_layout says."""

    def kernel(x: Tensor, box: Box) -> Tensor:
        if not box.numel:
            return x.to(cfg.ns_dtype or x.dtype)
        return backend.orthogonalize(x, within(matrices, box), cfg).contiguous()

    return kernel


def _guarded(
    failures: list[tuple[str, Exception]],
    what: str,
    fn: Callable[..., Any],
    fallback: Callable[..., Any],
) -> Callable[..., Any]:
    """fn, except that an exception is recorded in `failures` and answered with fallback(*args) (zeros): the rank
    keeps taking part in the step's remaining collectives instead of leaving its peers blocked in them, and
    step 5 then raises on every rank before anything is written."""

    def run(*args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - re-raised by agree_no_failure, with its rank
            failures.append((what, e))
            return fallback(*args)

    return run


def agree_no_failure(
    comm: Comm,
    failures: list[tuple[str, Exception]],
    written: int,
    failed: list[int] | None = None,
) -> None:
    """Step 5: after a write group's last data collective, before it writes: if the local work of any rank failed,
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
    ):  # (a failure recorded after this rank's flag was sent waits for a later check)
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


def carries_check(comm: Comm, batch: Batch, group: Group) -> bool:
    """Whether a write group ending with `batch` gets its failure check for free: a world of one (the check is
    local), or a path that carries the flag in its last collective over a group that is the whole world."""
    if comm.world_size == 1:
        return True
    return PATHS[batch.path].CARRIES_FLAG and group.ranks == tuple(range(comm.world_size))


def prepare(
    comm: Comm,
    entries: tuple[Entry, ...],
    inputs: Sequence[ParamInput],
    configs: Sequence[MuonConfig],
    options: Options,
    error: str | None = None,
) -> tuple[Plan, dict[int, tuple[int, ...]]]:
    """Steps 1-2: the plan every rank agreed on, without the params skipped as non-finite, and the blocks skipped
    inside params that step (nonfinite()). `entries` say which params have a gradient on this rank (active);
    `error` is this rank's first local error (raised on every rank)."""
    flags = None if error else local_flags(comm, entries, inputs)
    here = flags is not None and bool(flags.any())
    if agree(comm, plan(entries, options), error, here):
        skip, partial = nonfinite(comm, entries, flags, configs)
    else:
        skip, partial = set(), {}
    if not skip:
        return plan(entries, options), partial
    return plan(
        tuple(
            e if i not in skip else dataclasses.replace(e, active=False)
            for i, e in enumerate(entries)
        ),
        options,
    ), partial


def write_groups(
    step_plan: Plan, atomic: bool, free: Sequence[bool] | None = None
) -> list[tuple[Batch, ...]]:
    """The plan's batches in order, cut into write groups: the whole step when `atomic`; else a group closes after
    a batch whose failure check is free (`free[b]` for batch b: carries_check) or once its params' elements reach
    1/WRITE_GROUPS of the step's (so at most WRITE_GROUPS groups end with a check of their own, and such a group
    holds at most one batch more than that share). Global sizes and the plan's batches, never a rank's box: every
    rank must cut the same groups, or their failure checks would not match (a collective mismatch)."""
    if atomic:  # one group, or none in a step where no param has a gradient
        return [step_plan.batches] if step_plan.batches else []
    sizes = [
        sum(math.prod(g.global_shape) for g in batch.geometries) for batch in step_plan.batches
    ]
    free = free if free is not None else [False] * len(sizes)
    share, groups, current, held = sum(sizes) / WRITE_GROUPS, [], [], 0
    for batch, size, cheap in zip(step_plan.batches, sizes, free):
        current.append(batch)
        held += size
        if cheap or held >= share:
            groups.append(tuple(current))
            current, held = [], 0
    return groups + ([tuple(current)] if current else [])


def execute(
    comm: Comm,
    step_plan: Plan,
    inputs: Sequence[ParamInput],
    configs: Sequence[MuonConfig],
    backend: Backend,
    group_for: Callable[[Batch], Group],
    atomic: bool = False,
    skipped: Mapping[int, tuple[int, ...]] | None = None,
    out_params: Sequence[Tensor] | None = None,
) -> Iterator[tuple[int, Tensor, Tensor]]:
    """Steps 3-6 on an agreed plan, one write group at a time (write_groups): its momentum, its paths, the failure
    check, then it yields (param index, new local param, new local buffer) for each of its params, for the caller
    to write. So a step holds the new buffers and updates of one write group at a time, not of the whole step;
    with `atomic`, the whole step is one group and a failure anywhere writes nothing. `skipped`: blocks of params
    that keep their param and buffer bits (non-finite blocks of separate layouts, under nonfinite="skip").
    `out_params`: for each param, a tensor of its local param's shape and dtype (the local param itself, in
    DistributedMuon) that receives the new param after the failure check of its group (step 6), bitwise the
    new param without it; it is what is then yielded as the new param."""
    failures: list[tuple[str, Exception]] = []
    written = 0
    # every batch's process group, found in plan order on every rank (a first use may create sub-groups)
    process_groups = {id(batch): group_for(batch) for batch in step_plan.batches}
    free = {id(b): carries_check(comm, b, process_groups[id(b)]) for b in step_plan.batches}
    groups = write_groups(step_plan, atomic, [free[id(b)] for b in step_plan.batches])
    flags = {  # the groups whose last batch carries their failure check (a world of one needs none)
        id(group[-1]): FailureFlag(lambda: bool(failures), "failure_check")
        for group in groups
        if comm.world_size > 1 and free[id(group[-1])]
    }

    def task(batch: Batch) -> Steps:
        """Step 3 and 4 for one batch: its momentum, then its path (as Steps where the path is PIPELINED);
        returns (param, geometry, new buffer, update) per param."""
        buffers, directions = {}, {}
        for i, geometry in zip(batch.params, batch.geometries):
            layout, x, cfg = step_plan.entries[i].layout, inputs[i], configs[i]
            box = geometry.boxes[geometry.member(comm.rank)]
            momentum = _guarded(
                failures,
                f"the momentum of {layout.name}",
                lambda g, b: elementwise(
                    lambda m: _momentum(cfg), [g, b], layout.matrices, layout.global_shape, box
                ),
                lambda g, b: (torch.zeros_like(g), torch.zeros_like(g)),
            )
            buffers[i], directions[i] = momentum(x.grad, x.buf)
            if (
                str(directions[i].dtype) != batch.direction_dtype
            ):  # the kernel's input cast, done here
                directions[i] = directions[i].to(batch.direction_torch_dtype)
        update_dtype = batch.update_torch_dtype
        kernels = [
            _guarded(
                failures,
                f"the kernel of a batch from {step_plan.entries[i].layout.name}",
                kernel_for(backend, step_plan.entries[i].layout.matrices, configs[i]),
                lambda full, box, dtype=update_dtype: torch.zeros_like(full, dtype=dtype),
            )
            for i in batch.params
        ]
        path = PATHS[batch.path]
        args = (
            comm,
            process_groups[id(batch)],
            batch,
            [directions.pop(i) for i in batch.params],
            kernels,
        )
        flag = flags.get(id(batch))
        extra = {} if flag is None else {"flag": flag}
        outs = (
            (yield from path.steps(*args, **extra)) if path.PIPELINED else path.run(*args, **extra)
        )
        return [
            (i, geometry, buffers[i], out)
            for i, geometry, out in zip(batch.params, batch.geometries, outs)
        ]

    last_of = {id(group[-1]): group for group in groups}
    pending: list[tuple[int, Geometry, Tensor, Tensor]] = []
    for batch, done in staggered(step_plan.batches, task, PIPELINE_DEPTH):
        pending += done
        group = last_of.get(id(batch))
        if group is None:  # the write group goes on
            continue
        flag = flags.get(id(batch))
        agree_no_failure(comm, failures, written, flag.failed if flag is not None else None)
        for i, geometry, buf, update in pending:
            layout, box = step_plan.entries[i].layout, geometry.boxes[geometry.member(comm.rank)]
            dest = None if out_params is None else out_params[i]
            if dest is not None and apply_in_place(
                layout.matrices,
                [inputs[i].param, update],
                layout.global_shape,
                box,
                (skipped or {}).get(i, ()),
            ):
                new = apply_update(
                    inputs[i].param,
                    update.reshape(box.shape),
                    layout.matrices,
                    configs[i],
                    out=dest,
                )
                yield i, new, buf
                continue
            (new,) = elementwise(
                lambda m, cfg=configs[i]: _apply(m, cfg),
                [inputs[i].param, update],
                layout.matrices,
                layout.global_shape,
                box,
            )
            for b in (skipped or {}).get(
                i, ()
            ):  # exact copies: a skipped block keeps its param and buffer bits
                if (part := box.intersect(layout.matrices.blocks[b])) is not None:
                    mine = part.within(box).index
                    new[mine], buf[mine] = inputs[i].param[mine], inputs[i].buf[mine]
            yield i, new if dest is None else dest.copy_(new), buf
        pending = []
        written += len(group)
    # every failure is recorded before the last group's check reads its flag (kernels run before it): one recorded
    # later would have gone unreported by every check
    assert not failures or written < len(step_plan.batches), failures


def staggered(
    items: Sequence[Any], start: Callable[[Any], Steps], depth: int
) -> Iterator[tuple[Any, Any]]:
    """(item, start(item)'s value) for every item, in order, with the Steps of up to `depth` items interleaved as
    a software pipeline: when item n starts, its first segment runs (up to its first yield: it issues its first
    collective), then the next segment of each older unfinished item, newest first (n - 1 waits for its
    directions and runs its kernels, n - 2 waits for its updates); an item still unfinished when `depth` items
    are in flight runs to its end. A pure function of the items' segment counts, so every rank resumes the same
    Steps in the same order and issues the same collectives in the same order."""
    window: deque[list[Any]] = deque()  # [item, steps, finished, value], oldest first

    def advance(entry: list[Any]) -> None:
        try:
            next(entry[1])
        except StopIteration as end:
            entry[2], entry[3] = True, end.value

    for item in items:
        window.append([item, start(item), False, None])
        for entry in reversed(window):
            if not entry[2]:
                advance(entry)
        while window and (window[0][2] or len(window) >= depth):
            while not window[0][2]:
                advance(window[0])
            entry = window.popleft()
            yield entry[0], entry[3]
    while window:
        while not window[0][2]:
            advance(window[0])
        entry = window.popleft()
        yield entry[0], entry[3]


def apply_in_place(
    matrices: MatrixLayout,
    inputs: Sequence[Tensor],
    global_shape: tuple[int, ...],
    box: Box,
    skipped_blocks: tuple[int, ...],
) -> bool:
    """Whether step 6 may write a param (inputs: its local param and update) into its destination by
    apply_update's out= form, bitwise the fresh result (muon_ref.functional.apply_update): a shared layout, no
    skipped block, and a box on which run_stage runs the stage on the inputs as they are (runs_as_is).
    Otherwise the new param is computed as without a destination (padding, tails, per-block calls, skipped
    blocks' bits) and then copied."""
    return not matrices.separate and not skipped_blocks and runs_as_is(inputs, global_shape, box)


def _momentum(cfg: MuonConfig) -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]:
    return lambda g, b: momentum_direction(g, b, cfg)


def _apply(matrices: MatrixLayout, cfg: MuonConfig) -> Callable[[Tensor, Tensor], tuple[Tensor]]:
    return lambda p, u: (apply_update(p, u, matrices, cfg),)
