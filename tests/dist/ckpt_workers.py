"""Functions the rank pool runs for the checkpoint and reliability tests (module-level, picklable arguments,
small picklable results). Cases, meshes and gradients are tests/dist/workers.py's; `none` names the params whose
gradient is None on every rank in the steps before `none_until`."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import muon_ref
from muon_check.fixtures import box_of, distribute, local
from muon_dist import DistributedMuon
from muon_dist.checkpoint import from_reference_state_dict, to_reference_state_dict
from muon_dist.optim import UPDATE_LAYOUT

from .workers import Case, _groups, grads_of, initial_params

Changes = tuple[
    tuple[int, tuple[tuple[str, Any], ...]], ...
]  # (group index, ((key, value), ...)) per group


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def _setup(case: Case, zeros: bool = False) -> tuple[list[torch.Tensor], DistributedMuon]:
    fulls = initial_params(case)
    params = [
        distribute(torch.zeros_like(f) if zeros else f, pl, case.mesh)
        for f, pl in zip(fulls, case.placements)
    ]
    return params, DistributedMuon(
        _groups(case, params),
        preset=case.preset,
        **dict(case.overrides),
        update_layout=UPDATE_LAYOUT,
    )


def _set_grads(
    case: Case, params: list[torch.Tensor], step: int, none: tuple[int, ...], none_until: int
) -> None:
    for i, (p, grad, pl) in enumerate(zip(params, grads_of(case, step), case.placements)):
        p.grad = None if i in none and step < none_until else distribute(grad, pl, case.mesh)


def _state_order(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The params in state-dict index order (group by group), which is not the case's order with groups."""
    return [p for group in opt.param_groups for p in group["params"]]


def _state_keys(opt: torch.optim.Optimizer) -> list[tuple[int, tuple[str, ...]]]:
    return [(k, tuple(sorted(v))) for k, v in sorted(opt.state_dict()["state"].items())]


def _locals(params: list[torch.Tensor], opt: DistributedMuon) -> dict:
    return {
        "params": [local(p).clone() for p in params],
        "buffers": [local(opt.state[p]["momentum_buffer"]).clone() for p in params],
    }


def save_after(case: Case, steps: int, none: tuple[int, ...], path: str) -> list:
    """`steps` steps, then a DCP checkpoint of the params and the optimizer; returns this rank's state keys."""
    params, opt = _setup(case)
    for step in range(steps):
        _set_grads(case, params, step, none, steps)
        opt.step()
    dcp.save(
        {"params": {f"p{i}": p for i, p in enumerate(params)}, "optim": opt.state_dict()},
        checkpoint_id=path,
    )
    return _state_keys(opt)


def resume(case: Case, start: int, stop: int, path: str, changes: Changes = ()) -> dict:
    """Fresh zero params and optimizer, loaded from the DCP checkpoint at `path` (any world size and mesh), the
    group `changes` applied to the loaded state dict, then steps [start, stop)."""
    params, opt = _setup(case, zeros=True)
    state = {"params": {f"p{i}": p for i, p in enumerate(params)}, "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=path)
    for group, updates in changes:
        state["optim"]["param_groups"][group].update(dict(updates))
    opt.load_state_dict(state["optim"])
    loaded_lr = [g["lr"] for g in opt.param_groups]
    for step in range(start, stop):
        _set_grads(case, params, step, (), 0)
        opt.step()
    return {**_locals(params, opt), "lr": loaded_lr, "keys": _state_keys(opt)}


def resume_reference(case: Case, start: int, stop: int, path: str) -> dict:
    """muon_ref.Muon on plain full tensors, loaded from the DCP checkpoint at `path` (DCP gathers the shards into
    full tensors), then steps [start, stop). muon_ref's state is lazy: the template names a zero buffer per param."""
    params = [torch.zeros_like(f) for f in initial_params(case)]
    ref = muon_ref.Muon(
        _groups(case, params),
        preset=case.preset,
        **dict(case.overrides),
        update_layout=UPDATE_LAYOUT,
    )
    template = {
        "state": {
            i: {"momentum_buffer": torch.zeros_like(p)} for i, p in enumerate(_state_order(ref))
        },
        "param_groups": ref.state_dict()["param_groups"],
    }
    state = {"params": {f"p{i}": p for i, p in enumerate(params)}, "optim": template}
    dcp.load(state, checkpoint_id=path)
    ref.load_state_dict(state["optim"])
    for step in range(start, stop):
        for p, grad in zip(params, grads_of(case, step)):
            p.grad = grad
        ref.step()
    return {"params": params, "buffers": [ref.state[p]["momentum_buffer"] for p in params]}


def reference_run(
    case: Case,
    stop: int,
    none: tuple[int, ...] = (),
    none_until: int = 0,
    changes_at: int | None = None,
    changes: Changes = (),
) -> tuple[list, list]:
    """muon_ref.Muon on full tensors: steps [0, stop), group `changes` applied before step `changes_at`;
    (params, momentum buffers, zeros where the param never stepped)."""
    params = initial_params(case)
    ref = muon_ref.Muon(
        _groups(case, params),
        preset=case.preset,
        **dict(case.overrides),
        update_layout=UPDATE_LAYOUT,
    )
    for step in range(stop):
        if step == changes_at:
            for group, updates in changes:
                ref.param_groups[group].update(dict(updates))
        for i, (p, grad) in enumerate(zip(params, grads_of(case, step))):
            p.grad = None if i in none and step < none_until else grad
        ref.step()
    bufs = [ref.state[p].get("momentum_buffer") for p in params]
    return params, [torch.zeros_like(p) if b is None else b for p, b in zip(params, bufs)]


def differing(got: list[torch.Tensor], fulls: list[torch.Tensor], case: Case) -> dict[int, int]:
    """{param index: elements whose bits differ from this rank's box of the full tensor}, on this rank."""
    rank, W = dist.get_rank(), dist.get_world_size()
    out = {}
    for i, (t, full, pl) in enumerate(zip(got, fulls, case.placements)):
        want = box_of(full, pl, case.mesh, rank, W)
        if t.dtype != want.dtype or t.shape != want.shape or not torch.equal(_bits(t), _bits(want)):
            out[i] = -1 if t.shape != want.shape else int((_bits(t) != _bits(want)).sum())
    return out


def convert_round_trip(case: Case, steps: int, more: int) -> dict:
    """`steps` distributed steps; to_reference_state_dict; a fresh optimizer loaded through
    from_reference_state_dict of muon_ref's own state dict; `more` steps. Differences from muon_ref, per rank."""
    params, opt = _setup(case)
    for step in range(steps):
        _set_grads(case, params, step, (), 0)
        opt.step()
    as_ref = to_reference_state_dict(opt)
    ref_params, ref_bufs = reference_run(case, steps)
    ref = muon_ref.Muon(
        _groups(case, ref_params),
        preset=case.preset,
        **dict(case.overrides),
        update_layout=UPDATE_LAYOUT,
    )
    index = {id(p): i for i, p in enumerate(_state_order(ref))}
    ref.load_state_dict(
        {
            "state": {index[id(p)]: {"momentum_buffer": b} for p, b in zip(ref_params, ref_bufs)},
            "param_groups": ref.state_dict()["param_groups"],
        }
    )
    order = {id(p): i for i, p in enumerate(_state_order(opt))}
    converted = [as_ref["state"][order[id(p)]]["momentum_buffer"] for p in params]
    fresh, opt2 = _setup(case)
    for p, full, pl in zip(fresh, ref_params, case.placements):
        local(p).copy_(local(distribute(full, pl, case.mesh)))
    opt2.load_state_dict(from_reference_state_dict(ref.state_dict(), opt2))
    for step in range(steps, steps + more):
        _set_grads(case, fresh, step, (), 0)
        opt2.step()
    final_params, final_bufs = reference_run(case, steps + more)
    return {
        "to_reference": {
            i: int((_bits(a) != _bits(b)).sum())
            for i, (a, b) in enumerate(zip(converted, ref_bufs))
            if not torch.equal(_bits(a), _bits(b))
        },
        "continued": differing([local(p) for p in fresh], final_params, case),
        "buffers": differing(
            [local(opt2.state[p]["momentum_buffer"]) for p in fresh], final_bufs, case
        ),
    }


# ---------------------------------------------------------------- reliability


def nonfinite_on_one_rank(case: Case, value: float, policy: str) -> dict:
    """Step 0 normal; in step 1 the last element of param 0's gradient is `value` (NaN or Inf: only the rank
    holding the last row sees it). The error this rank raised, and its params against muon_ref's (which sees
    the same full gradient)."""
    case = replace(case, overrides=case.overrides + (("nonfinite", policy),))
    params, opt = _setup(case)
    _set_grads(case, params, 0, (), 0)
    opt.step()
    before = _locals(params, opt)
    grads = grads_of(case, 1)
    grads[0][-1, -1] = value
    for p, g, pl in zip(params, grads, case.placements):
        p.grad = distribute(g, pl, case.mesh)
    error, sees = "no error", bool(not torch.isfinite(local(params[0].grad)).all())
    try:
        opt.step()
    except ValueError as e:
        error = f"ValueError: {e}"
    ref_params = initial_params(case)
    ref = muon_ref.Muon(
        _groups(case, ref_params),
        preset=case.preset,
        **dict(case.overrides),
        update_layout=UPDATE_LAYOUT,
    )
    for step, gs in enumerate([grads_of(case, 0), grads]):
        for p, g in zip(ref_params, gs):
            p.grad = g
        try:
            ref.step()
        except ValueError:
            pass
    after = _locals(params, opt)
    unchanged = all(
        torch.equal(_bits(a), _bits(b))
        for k in ("params", "buffers")
        for a, b in zip(before[k], after[k])
    )
    return {
        "error": error,
        "sees": sees,
        "unchanged": unchanged,
        "differing": differing(after["params"], ref_params, case),
        "keys": _state_keys(opt),
    }


def zero_gradients(case: Case) -> dict:
    """Two steps with all-zero gradients: params against muon_ref's and against the initial params."""
    params, opt = _setup(case)
    for _ in range(2):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
    ref_params = initial_params(case)
    ref = muon_ref.Muon(
        _groups(case, ref_params),
        preset=case.preset,
        **dict(case.overrides),
        update_layout=UPDATE_LAYOUT,
    )
    for _ in range(2):
        for p in ref_params:
            p.grad = torch.zeros_like(p)
        ref.step()
    return {
        "vs_reference": differing([local(p) for p in params], ref_params, case),
        "vs_initial": differing([local(p) for p in params], initial_params(case), case),
        "buffers_nonzero": sum(
            int(local(opt.state[p]["momentum_buffer"]).count_nonzero()) for p in params
        ),
    }


def none_on_some_ranks_then_recover(case: Case, none_ranks: tuple[int, ...]) -> dict:
    """Step 1: param 0's grad is None on `none_ranks` only (every rank must raise). Then step 2 runs normally:
    the params must equal muon_ref's run that skipped step 1, and the state keys agree."""
    params, opt = _setup(case)
    _set_grads(case, params, 0, (), 0)
    opt.step()
    _set_grads(case, params, 1, (), 0)
    if dist.get_rank() in none_ranks:
        params[0].grad = None
    error = "no error"
    try:
        opt.step()
    except ValueError as e:
        error = str(e)
    _set_grads(case, params, 2, (), 0)
    opt.step()
    ref_params = initial_params(case)
    ref = muon_ref.Muon(
        _groups(case, ref_params),
        preset=case.preset,
        **dict(case.overrides),
        update_layout=UPDATE_LAYOUT,
    )
    for step in (0, 2):
        for p, g in zip(ref_params, grads_of(case, step)):
            p.grad = g
        ref.step()
    return {
        "error": error,
        "differing": differing([local(p) for p in params], ref_params, case),
        "keys": _state_keys(opt),
    }


def groups_change_between_steps(case: Case, path: str) -> dict:
    """Step 0 with the case's groups minus the last param; add_param_group(last param) and step 1; remove param 0
    from its group and step 2. muon_ref does the same; then a DCP save must work (same keys on every rank)."""
    fulls = initial_params(case)
    params = [distribute(f, pl, case.mesh) for f, pl in zip(fulls, case.placements)]
    ref_params = initial_params(case)
    opts = [
        DistributedMuon(
            [params[0], params[1]],
            preset=case.preset,
            **dict(case.overrides),
            update_layout=UPDATE_LAYOUT,
        ),
        muon_ref.Muon(
            [ref_params[0], ref_params[1]],
            preset=case.preset,
            **dict(case.overrides),
            update_layout=UPDATE_LAYOUT,
        ),
    ]
    keys = []
    for step in range(3):
        if step == 1:
            opts[0].add_param_group({"params": [params[2]], "lr": 0.01})
            opts[1].add_param_group({"params": [ref_params[2]], "lr": 0.01})
        if step == 2:
            for opt in opts:
                opt.param_groups[0]["params"] = opt.param_groups[0]["params"][1:]
        grads = grads_of(case, step)
        for i, (p, r, pl) in enumerate(zip(params, ref_params, case.placements)):
            p.grad, r.grad = distribute(grads[i], pl, case.mesh), grads[i]
        for opt in opts:
            opt.step()
        keys.append(_state_keys(opts[0]))
    dcp.save({"optim": opts[0].state_dict()}, checkpoint_id=path)
    return {"differing": differing([local(p) for p in params], ref_params, case), "keys": keys}


def _raise_on(rank: int, where: str) -> None:
    if dist.get_rank() == rank:
        raise RuntimeError(f"deliberate failure in the {where} on rank {rank}")


def raise_mid_step(case: Case, failing_rank: int, where: str) -> dict:
    """Step 0 normal; in step 1 `failing_rank` raises inside its kernel ("kernel") or its momentum stage
    ("momentum") while the other ranks are in (or about to enter) the step's collectives. The error each rank
    raised, how long its step took, whether anything was written; then step 1 again without the fault, and the
    params against muon_ref."""
    import muon_dist.elementwise as elementwise
    from muon_dist.kernels import Backend

    params, opt = _setup(case)
    _set_grads(case, params, 0, (), 0)
    opt.step()
    before = _locals(params, opt)
    real_backend, real_stage = opt.backend, elementwise.run_stage
    if where == "kernel":
        opt.backend = Backend(
            "torch",
            lambda d, layout, cfg: (
                _raise_on(failing_rank, where),
                real_backend.orthogonalize(d, layout, cfg),
            )[1],
            True,
        )
    else:  # the first run_stage call of the step is param 0's momentum
        elementwise.run_stage = lambda stage, inputs, shape, box, free=False: (
            _raise_on(failing_rank, where),
            real_stage(stage, inputs, shape, box, free),
        )[1]
    _set_grads(case, params, 1, (), 0)
    error, start = "no error", time.monotonic()
    try:
        opt.step()
    except RuntimeError as e:
        error = str(e)
    finally:
        opt.backend, elementwise.run_stage = real_backend, real_stage
    seconds = time.monotonic() - start
    after = _locals(params, opt)
    unchanged = all(
        torch.equal(_bits(a), _bits(b))
        for k in ("params", "buffers")
        for a, b in zip(before[k], after[k])
    )
    opt.step()  # the same gradients, no fault: the run goes on as if the failed step never happened
    ref_params, _ = reference_run(case, 2)
    return {
        "error": error,
        "seconds": seconds,
        "unchanged": unchanged,
        "differing": differing([local(p) for p in params], ref_params, case),
    }


def raise_in_a_later_write_group(
    case: Case, failing_rank: int, failing_shape: tuple[int, ...], atomic: bool
) -> dict:
    """Step 0 normal; in step 1 `failing_rank`'s kernel raises on the param(s) of `failing_shape`. The error each rank
    raised and, per param, whether its shard and momentum buffer changed in the failed step."""
    from muon_dist.kernels import Backend

    params, opt = _setup(replace(case, overrides=case.overrides + (("atomic", atomic),)))
    _set_grads(case, params, 0, (), 0)
    opt.step()
    before = _locals(params, opt)
    real = opt.backend

    def failing(direction: torch.Tensor, layout, cfg) -> torch.Tensor:
        if dist.get_rank() == failing_rank and tuple(direction.shape) == tuple(failing_shape):
            raise RuntimeError(f"deliberate failure on {tuple(failing_shape)}")
        return real.orthogonalize(direction, layout, cfg)

    opt.backend = Backend("torch", failing, bitwise=True)
    _set_grads(case, params, 1, (), 0)
    error = "no error"
    try:
        opt.step()
    except RuntimeError as e:
        error = str(e)
    after = _locals(params, opt)
    changed = [
        not (torch.equal(_bits(a), _bits(b)) and torch.equal(_bits(m), _bits(n)))
        for a, b, m, n in zip(
            before["params"], after["params"], before["buffers"], after["buffers"]
        )
    ]
    return {"error": error, "changed": changed}
