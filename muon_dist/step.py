"""One distributed Muon step, as a function of this rank's local shards (DistributedMuon is a thin optimizer over
it, as muon_ref.Muon is over muon_ref.functional).

    step_plan, skipped = prepare(comm, entries, inputs, configs, options, error)
    for index, new_param, new_buf in execute(comm, step_plan, inputs, configs, backend, group_for,
                                             out_params=...): ...

prepare: the plan (muon_dist/plan.py, once per step) and the agreement on it (muon_dist/agreement.py: steps 1-2).
execute: for each batch of the plan, in a pipeline (muon_dist/runtime.py), the stages
  momentum  each param's new buffer and direction on this rank's box (muon_dist/elementwise.py), the direction
            cast to the batch's direction dtype where the plan sends a narrower one (the kernel's own first op,
            muon_ref.newton_schulz.input_cast: the same bits), for a path that takes them packed written straight
            into the forward send buffer (Path.packed_directions);
  exchange  the batch through its path (muon_dist/paths): some member runs the backend's kernel on whole blocks,
            every member gets back its box of each update;
  write     after each write group's failure check (agreement step 3), each param's new local shard and new
            buffer, yielded one param at a time (with out_params, the new param is written there first).
Without out_params nothing here writes an input; with it, only out_params and the momentum buffers, in the write
stage.
Equation (proofs/paths.md): on every rank r, for every param that steps,
    new_param == box_r(muon_ref's P'),   new_buf == box_r(muon_ref's M')
bitwise with the torch backend (another backend: its tolerance, muon_dist/kernels).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from muon_ref import MatrixLayout, MuonConfig

from . import agreement, elementwise
from .batch import Batch, FailureFlag, Kernel, KernelCall, Kernels, Packed
from .comm import Comm, Group
from .geometry import Box, Geometry, blocks_in
from .kernels import Backend, orthogonalize_many, stacks
from .paths import PATHS
from .plan import Entry, Options, Plan, plan
from .runtime import Steps, staggered, writes_first


@dataclass(frozen=True)
class ParamInput:
    """One param's local shards: the param, its gradient (None: no gradient this step on this rank) and its
    momentum buffer. Read only, unless execute is given out_params: then its write stage, after the write
    group's failure check, writes the new buffer into buf where that is bitwise (elementwise.buffer_on_box)."""

    param: Tensor
    grad: Tensor | None
    buf: Tensor


# what a batch's stages leave for the write stage: (param index, geometry, update) per param
Done = tuple[int, Geometry, Tensor]


def prepare(
    comm: Comm,
    entries: tuple[Entry, ...],
    inputs: Sequence[ParamInput],
    configs: Sequence[MuonConfig],
    options: Options,
    error: str | None = None,
) -> tuple[Plan, dict[int, tuple[int, ...]]]:
    """Agreement steps 1-2: the plan every rank agreed on, without the params skipped as non-finite, and the blocks
    skipped inside params that step (agreement.nonfinite). `entries` say which params have a gradient on this
    rank (active); `error` is this rank's first local error (raised on every rank). The plan is made once; a
    second time only where a non-finite gradient takes params out of the step."""
    flags = None if error else agreement.local_flags(comm, entries, [x.grad for x in inputs])
    here = flags is not None and bool(flags.any())
    step_plan = plan(entries, options)
    if not agreement.agree(comm, step_plan, error, here):
        return step_plan, {}
    skip, partial = agreement.nonfinite(comm, entries, flags, configs)
    if not skip:
        return step_plan, partial
    kept = tuple(
        e if i not in skip else dataclasses.replace(e, active=False) for i, e in enumerate(entries)
    )
    return plan(kept, options), partial


def kernel_for(backend: Backend, matrices: MatrixLayout, cfg: MuonConfig) -> Kernel:
    """The param's kernel: the backend's orthogonalize on the whole blocks of any box of the param, its result in
    row-major order (the update layout muon_dist implements: muon_dist/optim.py UPDATE_LAYOUT; a no-op copy where
    the backend returns it so, a tall matrix's transposed view otherwise), whatever cfg.update_layout says."""

    def kernel(x: Tensor, box: Box) -> Tensor:
        if not box.numel:
            return x.to(cfg.ns_dtype or x.dtype)
        return backend.orthogonalize(x, blocks_in(matrices, box), cfg).contiguous()

    return kernel


@dataclass
class StepRun:
    """One execute() call's state: its inputs, the process group and failure flag of each batch, the failures
    recorded so far (agreement.guarded) and the batches written so far. Its methods are execute's stages."""

    comm: Comm
    plan: Plan
    inputs: Sequence[ParamInput]
    configs: Sequence[MuonConfig]
    backend: Backend
    skipped: Mapping[int, tuple[int, ...]]
    out_params: Sequence[Tensor] | None
    failures: agreement.Failures = field(default_factory=list)
    written: int = 0
    groups: dict[int, Group] = field(default_factory=dict)  # id(batch) -> its process group
    flags: dict[int, FailureFlag] = field(
        default_factory=dict
    )  # id(last batch) -> its group's flag

    def write_groups(
        self, group_for: Callable[[Batch], Group], atomic: bool
    ) -> list[tuple[Batch, ...]]:
        """Every batch's process group, found in plan order on every rank (a first use may create sub-groups),
        and the write groups (agreement.write_groups), each ending with a batch that carries the group's
        failure flag where its path does over the whole world (a world of one needs no check)."""
        batches, world = self.plan.batches, tuple(range(self.comm.world_size))
        self.groups = {id(b): group_for(b) for b in batches}
        free = {
            id(b): self.comm.world_size == 1
            or (PATHS[b.path].carries_flag and self.groups[id(b)].ranks == world)
            for b in batches
        }
        groups = agreement.write_groups(self.plan, atomic, [free[id(b)] for b in batches])
        if self.comm.world_size > 1:
            self.flags = {
                id(g[-1]): FailureFlag(lambda: bool(self.failures), "failure_check")
                for g in groups
                if free[id(g[-1])]
            }
        return groups

    def pauses(self, batch: Batch) -> bool:
        """Whether the batch's Steps pause (yield with an all-to-all in flight): a pipelined path over a group of
        more than one; the others run to their end in one segment (muon_dist.runtime.writes_first)."""
        return PATHS[batch.path].steps is not None and self.groups[id(batch)].size > 1

    def stages(self, batch: Batch) -> Steps:
        """The momentum and exchange stages of one batch, as Steps for the pipeline."""
        updates = yield from self.exchange(batch, self.momentum(batch))
        return list(zip(batch.params, batch.geometries, updates))

    def momentum(self, batch: Batch) -> list[Tensor]:
        """Each param's direction in the batch's direction dtype, on this rank's box: for a path that takes them
        packed (Path.packed_directions, a shard group of more than one), written straight into the forward send
        buffer at Batch.send_offsets, slab by slab (elementwise.direction_in_slabs; a Packed: copy_ casts as .to
        does, the same bits, with no cast copy, no concatenation and no whole box's temporaries). The new buffer is
        not kept: the write stage computes it again
        (elementwise.buffer_on_box, the same bits), so that no new buffer is held through the exchange."""
        directions: list[Tensor] = []
        send, offsets = None, []
        if PATHS[batch.path].packed_directions and batch.group_size > 1:
            offsets, length = batch.send_offsets(batch.geometries[0].member(self.comm.rank))
            device = self.inputs[batch.params[0]].param.device
            send = torch.empty(length, dtype=batch.direction_torch_dtype, device=device)
        for k, (i, geometry) in enumerate(zip(batch.params, batch.geometries)):
            layout, x, cfg = self.plan.entries[i].layout, self.inputs[i], self.configs[i]
            box = geometry.boxes[geometry.member(self.comm.rank)]
            what = f"the momentum of {layout.name}"
            if send is not None:  # slab by slab into the send buffer, with the kernel's input cast
                view = send[offsets[k] : offsets[k] + box.numel].view(box.shape)
                stage = agreement.guarded(
                    self.failures,
                    what,
                    lambda g, b: elementwise.direction_in_slabs(
                        cfg, g, b, layout.matrices, layout.global_shape, box, view
                    ),
                    lambda g, b: view.zero_(),
                )
                directions.append(stage(x.grad, x.buf))
                continue
            stage = agreement.guarded(
                self.failures,
                what,
                lambda g, b: elementwise.momentum_on_box(
                    cfg, g, b, layout.matrices, layout.global_shape, box
                ),
                lambda g, b: (torch.zeros_like(g), torch.zeros_like(g)),
            )
            direction = stage(x.grad, x.buf)[1]  # the new buffer goes now, not held past this line
            # the kernel's input cast where the batch's direction dtype is narrower (else itself)
            directions.append(direction.to(batch.direction_torch_dtype))
            del direction
        return directions if send is None else Packed(directions, send)

    def exchange(self, batch: Batch, directions: list[Tensor]) -> Steps:
        """The batch through its path, each param's kernel guarded: this rank's box of every update."""
        update_dtype = batch.update_torch_dtype
        each = [
            agreement.guarded(
                self.failures,
                f"the kernel of a batch from {self.plan.entries[i].layout.name}",
                kernel_for(self.backend, self.plan.entries[i].layout.matrices, self.configs[i]),
                lambda full, box: torch.zeros_like(full, dtype=update_dtype),
            )
            for i in batch.params
        ]
        kernels = Kernels(each, self.stacked(batch, each))
        path, group = PATHS[batch.path], self.groups[id(batch)]
        if path.steps is None:
            return path.run(self.comm, group, batch, directions, kernels)
        flag = self.flags.get(id(batch))
        extra = {} if flag is None else {"flag": flag}
        steps = path.steps(self.comm, group, batch, directions, kernels, **extra)
        del directions  # held by the path's Steps alone, which let them go once sent
        return (yield from steps)

    def stacked(
        self, batch: Batch, each: list[Kernel]
    ) -> Callable[[Iterable[KernelCall]], list[Tensor]]:
        """Several kernel calls of the batch at once (Kernels.many), each result the one its kernel_for call gives
        (made contiguous alike): the calls that kernels.stacks admits go through the backend's orthogonalize_many
        on their whole blocks, so that same-shape matrices of different params share one stack kernel call; the
        others run as they come (the paths pass calls lazily: a large param's input is freed after its call).
        Before each call, the send buffers of the all-to-alls in flight that have completed go (Comm.release_done,
        a local check). No kernel's error raises past the guard: should the admission or the stacked call raise,
        those calls run one by one through their guarded kernels, which record the failing param's failure
        (agreement.guarded); a collective that failed raises from release_done as its own wait would."""

        def many(calls: Iterable[KernelCall]) -> list[Tensor]:
            results: list[Tensor | None] = []
            pending = []  # (position in results, call, orthogonalize_many's call)
            for k, x, box in calls:
                self.comm.release_done()
                i = batch.params[k]
                try:
                    layout = blocks_in(self.plan.entries[i].layout.matrices, box)
                    admitted = bool(box.numel) and stacks(
                        self.backend, layout, x.dtype, x.device, self.configs[i]
                    )
                except Exception:  # noqa: BLE001 - the guarded kernel below meets it again and records it
                    admitted = False
                if not admitted:
                    results.append(each[k](x, box))
                    continue
                pending.append((len(results), (k, x, box), (x, layout, self.configs[i])))
                results.append(None)
            if pending:
                try:
                    outs = [
                        u.contiguous()
                        for u in orthogonalize_many(self.backend, [p[2] for p in pending])
                    ]
                except Exception:  # noqa: BLE001 - each call again, guarded: its failure is recorded there
                    outs = [each[k](x, box) for _, (k, x, box), _ in pending]
                for (position, _, _), out in zip(pending, outs):
                    results[position] = out
            return results  # type: ignore[return-value]  # every position is set

        return many

    def check(self, last: Batch) -> None:
        """Agreement step 3 for the write group that ends with `last`."""
        flag = self.flags.get(id(last))
        agreement.agree_no_failure(
            self.comm, self.failures, self.written, flag.failed if flag is not None else None
        )

    def write(self, done: list[Done]) -> Iterator[tuple[int, Tensor, Tensor]]:
        """(param index, new local param, new local buffer) of each param of a checked write group: the new buffer
        computed here (buffer_on_box), the new param written into out_params[i] where given (and then yielded as
        the new param): slab by slab in a world of more than one (elementwise.update_in_slabs), so that the
        stage's temporaries beside the buffers in flight are a slab's; in a world of one, where nothing is in
        flight and Newton-Schulz holds the step's peak, in one call (no slab calls' host time). Before each param,
        the send buffers of the all-to-alls in flight that have completed go (Comm.release_done), as before each
        kernel call."""
        done.reverse()  # taken from the end, so that each param's update goes once written
        while done:
            self.comm.release_done()
            i, geometry, update = done.pop()
            layout, x, cfg = self.plan.entries[i].layout, self.inputs[i], self.configs[i]
            box, skipped = geometry.boxes[geometry.member(self.comm.rank)], self.skipped.get(i, ())
            in_place = (
                self.out_params is not None and not skipped
            )  # the caller takes writes into inputs
            buf = elementwise.buffer_on_box(
                cfg, x.grad, x.buf, layout.matrices, layout.global_shape, box, in_place
            )
            out = None if self.out_params is None else self.out_params[i]
            # in slabs where written into out beside buffers in flight: the stage's temporaries are one slab's
            stage = (
                elementwise.update_on_box
                if out is None or self.comm.world_size == 1
                else elementwise.update_in_slabs
            )
            new = stage(
                cfg, x.param, update, layout.matrices, layout.global_shape, box, out, skipped
            )
            elementwise.keep_blocks(buf, x.buf, layout.matrices, box, skipped)
            yield i, new, buf
            del new, buf, update  # nothing of a written param is held while the next one is written


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
    """The stages on an agreed plan, one write group at a time: each batch's momentum and exchange in the pipeline,
    then per write group its failure check and its writes, yielding (param index, new local param, new local
    buffer) for the caller to write. So a step holds the new buffers and updates of one write group at a time;
    with `atomic`, the whole step is one group and a failure anywhere writes nothing. `skipped`: blocks of params
    that keep their param and buffer bits (non-finite blocks of separate layouts, under nonfinite="skip").
    `out_params`: for each param, a tensor of its local param's shape and dtype (the local param itself, in
    DistributedMuon) that receives the new param, bitwise the new param without it; given, the new buffers are
    written into the inputs' buffers where that is bitwise (else yielded as new tensors for the caller)."""
    run = StepRun(comm, step_plan, inputs, configs, backend, skipped or {}, out_params)
    ends = {id(group[-1]): len(group) for group in run.write_groups(group_for, atomic)}
    done: list[Done] = []
    order = functools.partial(writes_first, pauses=run.pauses)
    for batch, batch_done in staggered(
        step_plan.batches, run.stages, step_plan.options.pipeline_depth, order
    ):
        done += batch_done
        del batch_done  # held by `done` only, which the write stage empties as it writes
        if id(batch) in ends:  # the end of a write group
            run.check(batch)
            yield from run.write(done)
            run.written += ends[id(batch)]
    # every failure is recorded before the last group's check reads its flag (kernels run before it): one recorded
    # later would have gone unreported by every check
    assert not run.failures or run.written < len(step_plan.batches), run.failures
