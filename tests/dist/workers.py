"""Functions the rank pool runs on every rank (module-level, picklable arguments, small picklable results)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import muon_ref
from muon_check.fixtures import (
    box_of,
    chunk,
    count_kernel_flops,
    device_mesh,
    distribute,
    local,
    same_bits,
    seeded,
)
from muon_dist import DistributedMuon, expected_bytes, expected_collectives, expected_flops
from muon_dist.kernels import with_kernels
from muon_dist.optim import UPDATE_LAYOUT

ITEMSIZES = {"torch.float32": 4, "torch.bfloat16": 2}


@dataclass(frozen=True)
class Case:
    """One distributed-vs-reference experiment. placements per param: "S0", "S1", "R" (DTensor) or "plain"."""

    shapes: tuple[tuple[int, ...], ...]
    placements: tuple[str, ...]
    dtype: str = "float32"
    preset: str = "torch"
    steps: int = 3
    seed: int = 0
    mesh: str = "fsdp"  # or "hsdp": (replicate=2, shard=W/2), or "ep<k>": (ep=k, fsdp=W/k) sharding one dim twice
    options: tuple[tuple[str, object], ...] = ()
    overrides: tuple[tuple[str, object], ...] = ()
    sabotage: str | None = None
    groups: tuple[int, ...] = field(
        default=()
    )  # param group of each param (default: all in group 0)
    no_grad: tuple[int, ...] = ()  # params whose grad is None on every rank in step 1


def _groups(case: Case, params: list) -> list[dict]:
    indices = case.groups or (0,) * len(params)
    out: list[dict] = []
    for g in sorted(set(indices)):
        out.append(
            {
                "params": [p for p, i in zip(params, indices) if i == g],
                "param_names": [f"p{k}" for k, i in enumerate(indices) if i == g],
            }
        )
    return out


def _sabotaged(opt: DistributedMuon, how: str | None) -> None:
    """Negative controls: break the distributed step the way the field has (the equality check must notice)."""
    from muon_dist.kernels import Backend

    if (
        how == "ns_on_padded"
    ):  # Dion's bug: rows padded to a multiple of W inside NS (flips the transpose choice)
        W = dist.get_world_size()

        def padded(direction, layout, cfg):
            rows = math.ceil(direction.shape[0] / W) * W
            pad = direction.new_zeros(rows - direction.shape[0], *direction.shape[1:])
            return muon_ref.newton_schulz(torch.cat([direction, pad]), **cfg.ns_kwargs())[
                : direction.shape[0]
            ]

        opt.backend = Backend("torch", padded, bitwise=False)
    elif how == "drop_remainder":  # a remainder batch that is never orthogonalised
        from muon_dist.paths import PATHS

        real_path = PATHS["agrs"]

        def dropped(comm, group, batch, directions, kernels):
            return [torch.zeros_like(d, dtype=batch.update_torch_dtype) for d in directions]

        PATHS["agrs"] = dataclasses.replace(real_path, run=dropped)
        opt._restore = lambda: PATHS.__setitem__("agrs", real_path)
    elif (
        how == "wrong_slice"
    ):  # the subgroup path keeps the mirror member's rows of the gathered expert
        from muon_dist.paths import subgroup_all_gather as sub

        real_piece = sub.own_piece

        def mirrored(update, mine, frame):
            start = mine.offsets[0] - frame.offsets[0]
            return update.narrow(0, update.shape[0] - start - mine.shape[0], mine.shape[0])

        sub.own_piece = mirrored
        opt._restore = lambda: setattr(sub, "own_piece", real_piece)
    elif how == "bundle_ns":  # NS on a rank's experts as one stacked matrix, not per expert

        def bundled(direction, layout, cfg):
            return muon_ref.newton_schulz(
                direction.reshape(-1, direction.shape[-1]), **cfg.ns_kwargs()
            ).reshape(direction.shape)

        opt.backend = Backend("torch", bundled, bitwise=False)
    elif (
        how == "global_send_order"
    ):  # global_all_to_all's forward send buffer holds each owner's boxes in reverse
        from muon_dist.batch import (
            Batch,  # travel order (the momentum stage writes them there: Batch.send_offsets)
        )

        real_offsets = Batch.send_offsets

        def reversed_forward(
            batch, member
        ):  # the update's way back keeps its order (both reversed only relabels)
            offsets, length = real_offsets(batch, member)
            for owner in range(batch.group_size):
                owned = [k for k, o in enumerate(batch.owners) if o == owner]
                at = min((offsets[k] for k in owned), default=0)
                for k in reversed(owned):
                    offsets[k], at = at, at + batch.geometries[k].sizes[member]
            return offsets, length

        Batch.send_offsets = reversed_forward
        opt._restore = lambda: setattr(Batch, "send_offsets", real_offsets)
    elif (
        how == "extra_collective"
    ):  # global_all_to_all calls one all-to-all more than its record states (0 bytes)
        from muon_dist.paths import PATHS

        real_path = PATHS["global_all_to_all"]

        def steps(comm, group, batch, directions, kernels, **flag):
            comm.all_to_all(
                directions[0].new_empty(0),
                [0] * group.size,
                [0] * group.size,
                group,
                "global_all_to_all",
            )
            return (yield from real_path.steps(comm, group, batch, directions, kernels, **flag))

        PATHS["global_all_to_all"] = dataclasses.replace(real_path, steps=steps)
        opt._restore = lambda: PATHS.__setitem__("global_all_to_all", real_path)
    elif (
        how == "ns_twice"
    ):  # every kernel call made twice, the second result kept: the same bits, twice the work

        def twice(kernel):
            def run(*args):
                kernel(*args)
                return kernel(*args)

            return run

        opt.backend = with_kernels(opt.backend, twice)  # both kernels: a stacked call too
    elif (
        how == "naive_elementwise"
    ):  # momentum and update on the shard as a whole-tensor call (no run_stage)
        import muon_dist.elementwise as elementwise

        real_stage = elementwise.run_stage
        elementwise.run_stage = lambda stage, inputs, global_shape, box, free=False: stage(*inputs)
        opt._restore = lambda: setattr(elementwise, "run_stage", real_stage)


def grads_of(case: Case, step: int) -> list[torch.Tensor]:
    """The full gradients of a step: the same on every rank and in the parent (seeded per step and param)."""
    dtype = getattr(torch, case.dtype)
    return [
        seeded(shape, case.seed * 104729 + 1000 * step + i + 1, dtype)
        for i, shape in enumerate(case.shapes)
    ]


def initial_params(case: Case) -> list[torch.Tensor]:
    return [
        seeded(s, case.seed * 7919 + i, getattr(torch, case.dtype))
        for i, s in enumerate(case.shapes)
    ]


def distributed_steps(case: Case) -> dict:
    """case.steps steps of DistributedMuon; this rank's params, buffers, last report and planned bytes."""
    params = [distribute(f, pl, case.mesh) for f, pl in zip(initial_params(case), case.placements)]
    opt = DistributedMuon(
        _groups(case, params), preset=case.preset, **dict(case.options), **dict(case.overrides)
    )
    flops = count_kernel_flops(opt)
    _sabotaged(opt, case.sabotage)
    try:
        for step in range(case.steps):
            for i, (p, grad, pl) in enumerate(zip(params, grads_of(case, step), case.placements)):
                p.grad = (
                    None if step == 1 and i in case.no_grad else distribute(grad, pl, case.mesh)
                )
            flops[0] = 0
            opt.step()
    finally:
        getattr(opt, "_restore", lambda: None)()
    return {
        "params": [local(p).clone() for p in params],
        "buffers": [local(opt.state[p]["momentum_buffer"]).clone() for p in params],
        "paths": opt.last_report.paths,
        "bytes": opt.last_report.bytes_by_path,
        "expected": expected_bytes(opt.last_plan, dist.get_rank(), ITEMSIZES),
        "flops": flops[0],
        "expected_flops": expected_flops(opt.last_plan, dist.get_rank()),
        "calls": [
            (path, op) for path, op, _, _ in opt.comm.calls
        ],  # the last step's collectives, in order
        "expected_collectives": expected_collectives(opt.last_plan, dist.get_rank()),
    }


def reference_steps(case: Case) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The same steps with muon_ref.Muon on the full tensors: (params, momentum buffers)."""
    params = initial_params(case)
    ref = muon_ref.Muon(
        _groups(case, params),
        preset=case.preset,
        **dict(case.overrides),
        update_layout=UPDATE_LAYOUT,
    )
    for step in range(case.steps):
        for i, (p, grad) in enumerate(zip(params, grads_of(case, step))):
            p.grad = None if step == 1 and i in case.no_grad else grad
        ref.step()
    return params, [ref.state[p]["momentum_buffer"] for p in params]


def bad_step(kind: str) -> str:
    """One step with a caller's mistake on some ranks; the error this rank raised ("no error" otherwise)."""
    rank, W = dist.get_rank(), dist.get_world_size()
    try:
        params, grads = _bad_setup(kind, rank, W)
        opt = DistributedMuon(
            params, preset="torch", nonfinite="skip" if kind == "nonfinite_skip" else "raise"
        )
        before = [local(p).clone() for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        if kind == "nonfinite_skip":
            return (
                "unchanged"
                if all(torch.equal(local(p), b) for p, b in zip(params, before))
                else "changed"
            )
        return "no error"
    except ValueError as e:
        return f"ValueError: {e}"


def _bad_setup(kind: str, rank: int, W: int) -> tuple[list, list]:
    full = torch.ones(6, 4)
    if kind == "shape_differs":  # a plain tensor of another shape on rank 0
        p = torch.ones(4, 6) if rank == 0 else full.clone()
        return [p], [torch.ones_like(p)]
    if kind == "grad_none_on_one_rank":
        ps = [distribute(full, "S0", "fsdp"), distribute(full, "S0", "fsdp")]
        return ps, [
            distribute(full, "S0", "fsdp"),
            None if rank == W - 1 else distribute(full, "S0", "fsdp"),
        ]
    if kind == "mesh_mixed":  # a DTensor on rank 0, a plain tensor elsewhere
        p = distribute(full, "S0" if rank == 0 else "plain", "fsdp")
        return [p], [distribute(full, "S0" if rank == 0 else "plain", "fsdp")]
    if kind == "grad_placement_differs_on_one_rank":
        p = distribute(full, "S0", "fsdp")
        return [p], [distribute(full, "R" if rank == 0 else "S0", "fsdp")]
    if kind in ("nonfinite_on_one_shard", "nonfinite_skip"):
        g = full.clone()
        g[-1, -1] = float("nan")  # only the last non-empty shard holds it
        return [distribute(full, "S0", "fsdp")], [distribute(g, "S0", "fsdp")]
    raise AssertionError(kind)


def fsdp_training(preset: str, steps: int, dtype: str) -> dict:
    """fully_shard a small MLP on a 1-D CPU mesh and train it with DistributedMuon; beside it, on every rank,
    muon_ref.Muon (a) on FSDP2's own averaged gradients, (b) single-process training whose gradient is the
    mean of the ranks' gradients summed in rank order. Returns, per step, the elements that differ."""
    import copy

    from torch import nn
    from torch.distributed.fsdp import fully_shard

    rank, W = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(12, 8, bias=False),
        nn.Tanh(),
        nn.Linear(8, 8, bias=False),
        nn.Tanh(),
        nn.Linear(8, 8, bias=False),
        nn.Tanh(),
        nn.Linear(8, 3, bias=False),
    ).to(getattr(torch, dtype))
    given, single = copy.deepcopy(model), copy.deepcopy(model)
    mesh = device_mesh("fsdp")
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = DistributedMuon(model.parameters(), preset=preset)
    opt_given, opt_single = (
        muon_ref.Muon(given.parameters(), preset=preset, update_layout=UPDATE_LAYOUT),
        muon_ref.Muon(single.parameters(), preset=preset, update_layout=UPDATE_LAYOUT),
    )
    out = {"given_differs": [], "single_differs": [], "grad_differs": [], "paths": None}
    for step in range(steps):
        xs = [seeded((5, 12), 1000 * step + r, getattr(torch, dtype)) for r in range(W)]
        model(xs[rank]).square().mean().backward()
        fsdp_grads = [p.grad.full_tensor() for p in model.parameters()]
        mean = _mean_grads(single, xs)
        for p, g in zip(given.parameters(), fsdp_grads):
            p.grad = g.clone()
        for p, g in zip(single.parameters(), mean):
            p.grad = g
        out["grad_differs"].append(sum(int((a != b).sum()) for a, b in zip(fsdp_grads, mean)))
        for o in (opt, opt_given, opt_single):
            o.step()
            o.zero_grad()
        out["given_differs"].append(_shard_differs(model, given, rank, W))
        out["single_differs"].append(_shard_differs(model, single, rank, W))
    out["paths"] = opt.last_report.paths
    return out


def _mean_grads(model, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    per_rank = []
    for x in xs:
        model.zero_grad()
        model(x).square().mean().backward()
        per_rank.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    total = per_rank[0]
    for grads in per_rank[1:]:
        total = [a + b for a, b in zip(total, grads)]
    return [t / len(xs) for t in total]


def _shard_differs(model, ref_model, rank: int, W: int) -> int:
    return sum(
        int((local(p) != chunk(r.detach(), 0, rank, W)).sum())
        for p, r in zip(model.parameters(), ref_model.parameters())
    )


def layouts_of_distributed(shape: tuple[int, int], placement: str, mesh_kind: str) -> tuple:
    """read_layout of a distribute_tensor'd param beside DTensor's own local shape and global offset."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from muon_dist import read_layout

    mesh = device_mesh(mesh_kind)
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(int(placement[1:]))]
    p = torch.distributed.tensor.distribute_tensor(torch.zeros(shape), mesh, placements)
    geometry = read_layout(p, "w", {}, dist.get_world_size(), dist.get_rank()).geometry
    box = geometry.boxes[geometry.member(dist.get_rank())]
    want = compute_local_shape_and_global_offset(p.shape, mesh, p.placements)
    return (box.shape, box.offsets), (tuple(want[0]), tuple(want[1])), tuple(p.to_local().shape)


def fail_on(rank_to_fail: int, how: str) -> int:
    """Raise or hang on one rank (to test the pool); the rank number elsewhere."""
    import time

    if dist.get_rank() == rank_to_fail:
        if how == "raise":
            raise RuntimeError("deliberate failure")
        time.sleep(30)
    return dist.get_rank()


def agrs_on_gloo(dtype: str) -> bool:
    """AGRS on gloo with a kernel whose output holds -0.0 and +0.0: does every bit survive the reduce-scatter?"""
    from muon_dist import Group, TorchComm
    from muon_dist.paths import agrs

    from .batches import batch_of, box, layout_1d

    rank, W = dist.get_rank(), dist.get_world_size()
    full = seeded((7, 3), 0, getattr(torch, dtype))
    layout = layout_1d((7, 3), "S0", W, full.dtype)

    def kernel(x: torch.Tensor, frame) -> torch.Tensor:
        return torch.where(x > 0, torch.full_like(x, -0.0), torch.zeros_like(x))

    comm = TorchComm()
    (got,) = agrs.run(
        comm,
        Group(tuple(range(W)), dist.group.WORLD),
        batch_of("agrs", layout, 1, full.dtype),
        [box(full, layout, rank)],
        [kernel],
    )
    want = box(kernel(full, None), layout, rank)
    view = torch.int32 if full.element_size() == 4 else torch.int16
    return torch.equal(got.view(view), want.view(view))


def bad_expert_step(kind: str) -> str:
    """One step of an expert param with a caller's mistake; the error this rank raised ("no error" otherwise)."""
    rank, W = dist.get_rank(), dist.get_world_size()
    try:
        full, num_experts, placements = torch.ones(8, 3), 4, [Shard(0), Shard(0)]
        if kind == "num_experts_does_not_divide_rows":
            num_experts = 3
        elif kind == "num_experts_differs_on_one_rank":
            num_experts = 2 if rank == W - 1 else 4
        mesh = device_mesh("ep2")
        local = box_of(full, "S0", "ep2", rank, W)
        p = DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride())
        opt = DistributedMuon([{"params": [p], "num_experts": num_experts}], preset="torch")
        p.grad = DTensor.from_local(
            local.clone(), mesh, placements, shape=full.shape, stride=full.stride()
        )
        opt.step()
        return "no error"
    except ValueError as e:
        return f"ValueError: {e}"


def subgroup_cache_probe() -> dict:
    """Two optimizers on two DeviceMesh objects of one (ep 2, fsdp W/2) layout, each stepping a subgroup case:
    the partitions cached after each, the paths, and the process groups its subgroup all-gathers used."""
    from muon_dist import comm as comm_module

    rank, W = dist.get_rank(), dist.get_world_size()
    full, before, handles, paths, counts = torch.ones(8, 3), len(comm_module._SUBGROUPS), [], [], []
    real_all_gather = comm_module.TorchComm._all_gather

    def spy(self, x, group):
        handles.append(group.handle)
        return real_all_gather(self, x, group)

    comm_module.TorchComm._all_gather = spy
    try:
        for _ in range(2):
            mesh = init_device_mesh("cpu", (2, W // 2), mesh_dim_names=("ep", "fsdp"))
            local = box_of(full, "S0", "ep2", rank, W)
            p = DTensor.from_local(
                local, mesh, [Shard(0)] * 2, shape=full.shape, stride=full.stride()
            )
            opt = DistributedMuon([{"params": [p], "num_experts": 2}], preset="torch")
            p.grad = DTensor.from_local(
                local.clone(), mesh, [Shard(0)] * 2, shape=full.shape, stride=full.stride()
            )
            opt.step()
            paths.append(opt.last_report.paths[0][1])
            counts.append(len(comm_module._SUBGROUPS) - before)
    finally:
        comm_module.TorchComm._all_gather = real_all_gather
    sub = [h for h in handles if h is not dist.group.WORLD]
    return {
        "counts": counts,
        "paths": paths,
        "subgroup_calls": len(sub),
        "distinct_groups": len(set(map(id, sub))),
    }


def _made_by_fsdp2_over_tp(full: torch.Tensor, codes: tuple[str, ...], mesh) -> torch.Tensor:
    """`full` as FSDP2 over tensor parallelism places it, for codes with a _StridedShard (the only producer of one
    in the field): an nn.Linear holding `full`, ColwiseParallel (dim 0) or RowwiseParallel (dim 1) over the last
    axis, then fully_shard over the axes before it (HSDP when one of them replicates), sharding the same dim."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dim = int(codes[-1][1])
    assert codes[-1] == f"S{dim}" and codes[-2].startswith(f"S{dim}:"), codes
    linear = nn.Linear(full.shape[1], full.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(full)
    names = mesh.mesh_dim_names
    parallelize_module(
        linear, mesh[names[-1]], ColwiseParallel() if dim == 0 else RowwiseParallel()
    )
    fsdp_mesh = mesh[names[:-1]] if len(names) > 2 else mesh[names[0]]
    fully_shard(linear, mesh=fsdp_mesh, shard_placement_fn=lambda p: Shard(dim))
    return linear.weight


def tp_layout_against_dtensor(
    placement: str, kind: str, shape: tuple[int, ...]
) -> tuple[bool, bool, bool]:
    """A tensor placed by torch with per-axis placements that may include _StridedShard: by FSDP2 over tensor
    parallelism when they do (torch 2.9.1's distribute_tensor splits an uneven _StridedShard otherwise than FSDP2
    places it: measured), else by distribute_tensor (src_data_rank=None). (Its local shard is the fixtures' box of
    the full tensor; read_layout's box has the local shard's shape; and the box is torch's
    compute_local_shape_and_global_offset's, its offset where the box is not empty.)"""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from muon_check.fixtures import axis_codes, placement_of
    from muon_dist import read_layout

    W, r = dist.get_world_size(), dist.get_rank()
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    mesh = device_mesh(kind)
    codes = axis_codes(placement, kind, W)
    placements = [placement_of(c) for c in codes]
    if any(":" in c for c in codes):
        t = _made_by_fsdp2_over_tp(full, codes, mesh)
        assert list(t.placements) == placements, (t.placements, placements)
    else:
        t = distribute_tensor(full, mesh, placements, src_data_rank=None)
    geometry = read_layout(t, "w", {}, W, r).geometry
    box = geometry.boxes[geometry.member(r)]
    local_shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    return (
        torch.equal(t.to_local(), box_of(full, placement, kind, r, W)),
        box.shape == tuple(t.to_local().shape),
        (box.shape == tuple(local_shape) and (box.offsets == tuple(offset) or box.numel == 0)),
    )


def all_gather_routes_on_gloo(numel: int, dtype: str, members: tuple[int, ...]) -> dict | None:
    """TorchComm.all_gather on gloo over `members` (the world, or a sub-group) by each route: the one gloo takes
    (gathers_by_all_to_all: an all_to_all_single of x repeated), the ring all-gather, and a planted route that
    exchanges nothing (each member's own x repeated: the negative control). Per route: whether piece j of the
    result has member j's bits, and the ledger it recorded. None on a rank outside `members`."""
    from muon_dist import Group, TorchComm

    rank, W = dist.get_rank(), dist.get_world_size()
    handle = dist.group.WORLD if members == tuple(range(W)) else dist.new_group(list(members))
    if rank not in members:
        return None
    group = Group(members, handle)
    payload = lambda j: seeded((numel,), 10 + j, getattr(torch, dtype))  # noqa: E731 - member j's x
    want = torch.cat([payload(j) for j in range(len(members))])
    mine = payload(members.index(rank))
    out: dict = {"by_all_to_all": TorchComm().gathers_by_all_to_all(group)}
    for route in ("chosen", "ring", "planted"):
        comm = TorchComm()
        if route == "ring":
            comm._gloo[handle] = False
        if route == "planted":
            comm._all_to_all_start = lambda x, o, i, g: lambda: x.clone()  # noqa: E731 - no exchange at all
        got = comm.all_gather(mine.clone(), group, "g")
        out[route] = {"bits": same_bits(got, want), "ledger": dict(comm.ledger)}
    return out


def release_done_on_gloo() -> dict:
    """An asynchronous TorchComm.all_to_all of a seeded buffer on gloo: released (the send buffer went by
    release_done alone, polled for up to 10 s, before the Pending's wait), result (the wait's result is every
    member's piece for this rank), kept_without (the same exchange without release_done still holds its send
    buffer after the peers' results are in, until its wait)."""
    import time
    import weakref

    from muon_dist import Group, TorchComm

    rank, W = dist.get_rank(), dist.get_world_size()
    group = Group(tuple(range(W)), dist.group.WORLD)
    piece = lambda j, to: seeded((3,), 100 * j + to)  # noqa: E731 - member j's piece for member `to`
    want = torch.cat([piece(j, rank) for j in range(W)])

    def issue(comm):
        send = torch.cat([piece(rank, to) for to in range(W)])
        sent = weakref.ref(send)
        return comm.all_to_all(send, [3] * W, [3] * W, group, "p", async_op=True), sent

    comm = TorchComm()
    pending, sent = issue(comm)
    deadline = time.monotonic() + 10
    while sent() is not None and time.monotonic() < deadline:
        comm.release_done()
        time.sleep(0.001)
    out = {"released": sent() is None, "result": same_bits(pending.wait(), want)}
    dist.barrier()
    pending, sent = issue(TorchComm())
    dist.barrier()  # every member has sent and received by now: the exchange is done
    time.sleep(0.05)
    out["kept_without"] = sent() is not None
    pending.wait()
    return out


def whole_against_full_tensor(shapes: tuple, dtype: str) -> list[tuple[bool, bool]]:
    """For each shape: a seeded whole tensor distributed Shard(0) on a 1-D mesh of every rank, gathered by
    muon_check.fixtures.whole through "c10d" and through "full_tensor". Per shape: (c10d equal to full_tensor and to
    the seeded tensor, bitwise; the control equal to full_tensor), the control being the c10d gather with its rows
    taken from the end of the gathered buffer instead of the start."""
    from muon_check.fixtures import whole

    out = []
    for i, shape in enumerate(shapes):
        full = seeded(tuple(shape), 100 + i, dtype)
        t = distribute(full, "S0", "fsdp")
        by_c10d, by_dtensor = whole(t, "c10d"), whole(t, "full_tensor")
        control = _gathered_rows_from_the_end(t)
        out.append(
            (
                same_bits(by_c10d, by_dtensor) and same_bits(by_c10d, full),
                same_bits(control, by_dtensor),
            )
        )
    return out


def _gathered_rows_from_the_end(t: DTensor) -> torch.Tensor:
    """The control of whole_against_full_tensor: whole()'s c10d gather, its rows taken from the end."""
    from muon_check.fixtures import padded_gather

    out = padded_gather(t)
    return out[out.shape[0] - t.shape[0] :].contiguous()


def killed_in_a_collective(how: str) -> int:
    """Rank 0 is killed by a signal (how: "SIGSEGV", "SIGABRT") inside a function whose code is filed under
    torch/distributed (as a crash inside torch's functional collectives would be), or exits without one ("exit");
    the other ranks then wait in a barrier, which its death breaks."""
    import os
    import signal

    funcol = os.path.join(os.path.dirname(dist.__file__), "_functional_collectives.py")
    if dist.get_rank() == 0:
        if how == "exit":
            os._exit(1)
        namespace: dict = {}
        exec(compile("def all_gather_tensor(kill):\n    kill()\n", funcol, "exec"), namespace)
        namespace["all_gather_tensor"](lambda: os.kill(os.getpid(), getattr(signal, how)))
    dist.barrier()
    return dist.get_rank()


def tensors_of_every_kind() -> dict:
    """An answer with tensors as a check's case returns them and the corners beside: views of one storage (a slice,
    a transpose), bf16, an empty tensor, a 0-d one, ints and bools, a Parameter, a leaf that requires grad, and the
    same tensor twice."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 4, generator=g)
    return {
        "base": base,
        "rows": base[1:3],
        "t": base.t(),
        "again": base,
        "bf16": torch.randn(5, generator=g).bfloat16(),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3.5),
        "ints": torch.arange(5),
        "bools": torch.tensor([True, False]),
        "param": torch.nn.Parameter(torch.randn(3, 3, generator=g)),
        "leaf": torch.randn(2, generator=g).requires_grad_(),
        "text": "not a tensor",
    }
