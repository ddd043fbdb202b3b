"""The rank side of the conformance run: module-level functions that muon_check.launch.RankPool runs on every
rank (picklable arguments, small picklable results).

Every gradient reaches the candidate through autograd (torch.autograd.backward on the param with the rank's
gradient as the incoming gradient), one backward per micro-batch, after the grads were set to None: gradient hooks
fire as in training, and p.grad is the sum of the micro-batches (muon_check/adapters/cases.py says what each
rank feeds). torch's random generators are seeded before a case (the same seed for every case: a candidate that
draws random numbers gets the same draws whatever ran before it on the rank; check's determinism probe passes
another). The candidate is built through `build`, whose failure is a ConstructionError (a refusal at construction,
not a crash in a step). After every step the ranks meet at a barrier of the harness's own group (_steps). Per rank
the result is {"first_step", "params" (after each step from first_step), "errors" (per step: None, or the exception
a step raised where the family allows one), "momentum" (at the end), "recorded" (after the first RECORDED_STEPS
steps and the last: the momentum the adapter exposes and every param-sized state tensor, by path: state_tensors),
"state_keys", and for a resume "loaded" (the params right after the load)}; in the families of
STATE_ROUNDTRIP_FAMILIES also "state" (every entry of every param's optimizer state at the end: state_snapshot) and,
for the resume, "loaded_state" (the same right after the load).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..fixtures import distribute, local
from . import Adapter
from .cases import (
    STATE_ROUNDTRIP_FAMILIES,
    Case,
    asym_step,
    initial_params,
    placement,
    rank_gradients,
    save_step,
)

_HARNESS_GROUP: list[Any] = []


def _harness_group() -> Any:
    """A gloo group of all ranks for the harness's own barrier, made once per rank process (a collective: every
    rank calls it first thing in a case); None in a process without torch.distributed (conformance.run_here). The
    candidate's collectives run on the default group; a barrier there could be matched with a collective that a
    peer left pending inside the candidate."""
    if not dist.is_initialized():
        return None
    if not _HARNESS_GROUP:
        _HARNESS_GROUP.append(dist.new_group(backend="gloo"))
    return _HARNESS_GROUP[0]


def _on_rank(full: torch.Tensor, case: Case) -> torch.Tensor:
    """This rank's view of a full tensor: a DTensor Shard(0) with its torch.chunk box, or a plain copy."""
    return distribute(full, placement(case), "fsdp", case.device)


def _params(case: Case, zeros: bool = False) -> torch.nn.Module:
    """The case's params (zeros: the same shapes, for a resume to load into) as a module, whose parameter names
    torch.distributed.checkpoint.state_dict uses as the optimizer state's keys."""
    module = torch.nn.Module()
    module.params = torch.nn.ParameterList(
        [
            torch.nn.Parameter(_on_rank(torch.zeros_like(p) if zeros else p, case))
            for p in initial_params(case)
        ]
    )
    return module


def _feed(params: list[torch.Tensor], case: Case, step: int) -> None:
    """p.grad = None, then one backward per micro-batch with this rank's gradients (none where it has none)."""
    for p in params:
        p.grad = None
    for micro in rank_gradients(case, step, dist.get_rank() if dist.is_initialized() else 0):
        fed = [(p, _on_rank(g, case)) for p, g in zip(params, micro) if g is not None]
        if fed:  # through p * 1.0: the gradient reaching p is g * 1.0, g's bits; fed to the leaves directly, torch
            # 2.9.1's autograd stores an unevenly sharded DTensor's gradient as Replicate (measured; right in 2.13.0)
            torch.autograd.backward([p * 1.0 for p, _ in fed], [g for _, g in fed])


# The steps after which every param-sized state tensor and the exposed momentum are kept (besides the last): the
# first departing step is almost always among them, and the stage replay (locate.py) starts from the step before.
RECORDED_STEPS = 4


class ConstructionError(Exception):
    """The candidate's constructor raised on this case's params (before any step): its message is
    "ExceptionType: first line" of what the constructor raised."""


def build(adapter: Adapter, params: list[torch.Tensor], options: dict[str, Any]) -> Any:
    """adapter.build, its failure raised as ConstructionError (the check tells a refusal at construction from a
    crash in a step)."""
    try:
        return adapter.build(params, **options)
    except ImportError:
        raise  # the candidate is not installed: the run could not start (conformance: could not run)
    except Exception as e:  # noqa: BLE001 - whatever else the constructor raises is its refusal
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConstructionError(f"{type(e).__name__}: {first}") from None


def state_tensors(
    entry: Any, sizes: dict[int, torch.Size], path: str = ""
) -> dict[str, torch.Tensor]:
    """Every tensor in a param's optimizer state with as many elements as the param (its local shard or the whole),
    found through nested dicts, lists and tuples, as {path: CPU copy in the param's (local) shape}; path spells the
    subscripts after state[p] (e.g. "['momentum_buffer']", "[0]['buf']")."""
    if isinstance(entry, torch.Tensor):
        t = local(entry.detach())
        if t.numel() > 1 and t.numel() in sizes:
            return {path: t.reshape(sizes[t.numel()]).cpu().clone()}
        return {}
    if not isinstance(entry, (dict, list, tuple)):
        return {}
    items = entry.items() if isinstance(entry, dict) else enumerate(entry)
    found: dict[str, torch.Tensor] = {}
    for key, value in items:
        found.update(state_tensors(value, sizes, f"{path}[{key!r}]"))
    return found


def _recorded(opt: torch.optim.Optimizer, adapter: Adapter, params: list[torch.Tensor]) -> dict:
    """The momentum the adapter exposes and every param-sized state tensor, per param, now."""
    states = []
    for p in params:
        sizes = {p.numel(): p.shape, local(p.detach()).numel(): local(p.detach()).shape}
        states.append(state_tensors(opt.state.get(p, {}), sizes))
    momenta = [adapter.momentum(opt, p) for p in params]
    return {
        "momentum": [None if m is None else m.detach().cpu().clone() for m in momenta],
        "state": states,
    }


def _steps(
    adapter: Adapter,
    case: Case,
    opt: torch.optim.Optimizer,
    params: list[torch.Tensor],
    steps: range,
) -> dict[str, Any]:
    """Run `steps`. After each, every rank meets at the harness barrier: a rank that finished its step cannot run
    ahead into the next step's collectives while a peer is still inside this one (the peer then waits, and the
    case is a hang, as in the field). The step of asym_none may raise: the error is recorded, not raised. After the
    first RECORDED_STEPS steps and the last, the exposed momentum and the param-sized state are kept ("recorded",
    by step index)."""
    per_step, errors, recorded = [], [], {}
    for step in steps:
        _feed(params, case, step)
        error = None
        try:
            opt.step()
        except Exception as e:  # noqa: BLE001 - asym_none: the same error on every rank is a conforming answer
            if case.family != "asym_none" or step != asym_step(case):
                raise
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if dist.is_initialized():
            dist.barrier(group=_harness_group())
        per_step.append([local(p.detach()).cpu().clone() for p in params])
        errors.append(error)
        if step < RECORDED_STEPS or step == steps.stop - 1:
            recorded[step] = _recorded(opt, adapter, params)
    momenta = [adapter.momentum(opt, p) for p in params]
    snapshot = (
        {"state": state_snapshot(opt, params)} if case.family in STATE_ROUNDTRIP_FAMILIES else {}
    )
    return {
        **snapshot,
        "first_step": steps.start,
        "params": per_step,
        "errors": errors,
        "momentum": [None if m is None else m.detach().cpu().clone() for m in momenta],
        "state_keys": [
            [] if m is not None else param_sized_state(opt, p) for m, p in zip(momenta, params)
        ],
        "recorded": recorded,
    }


def state_snapshot(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[dict[str, Any]]:
    """Per param, each entry of its optimizer state: a tensor as (dtype, device, this rank's local values on the
    CPU), anything else as its repr (a Python step counter, a flag)."""
    out = []
    for p in params:
        entries = {}
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                v = local(v.detach())
                entries[str(k)] = (
                    str(v.dtype).removeprefix("torch."),
                    str(v.device),
                    v.cpu().clone(),
                )
            else:
                entries[str(k)] = repr(v)
        out.append(entries)
    return out


def param_sized_state(opt: torch.optim.Optimizer, p: torch.Tensor) -> list[str]:
    """The keys of p's optimizer state that hold a tensor with as many elements as p or its shard: state the
    check would compare as momentum if it knew the key (a scalar step counter is not one)."""
    sizes = {p.numel(), local(p.detach()).numel()}
    return sorted(
        str(k)
        for k, v in opt.state.get(p, {}).items()
        if isinstance(v, torch.Tensor) and v.numel() > 1 and v.numel() in sizes
    )


def _seed_random(rng_seed: int) -> None:
    """torch's global generators seeded before each case (a candidate that draws random numbers, e.g. stochastic
    rounding, gets the same draws whatever ran before it on this rank; the determinism probe varies rng_seed)."""
    torch.manual_seed(rng_seed)


def candidate_steps(
    adapter: Adapter, case: Case, hp: dict[str, Any], rng_seed: int = 0
) -> dict[str, Any]:
    """case.steps steps of the candidate, built with the check's hyperparameters `hp` and the case's options; this
    rank's params after every step and its final momentum (CPU copies: results travel to the parent by a pipe)."""
    _harness_group()
    _seed_random(rng_seed)
    params = list(_params(case).params)
    opt = build(adapter, params, {**hp, **dict(case.options)})
    return _steps(adapter, case, opt, params, range(case.steps))


def candidate_save(adapter: Adapter, case: Case, hp: dict[str, Any], path: str) -> dict[str, Any]:
    """The checkpoint family before the save: save_step(case) steps, then `adapter.save_checkpoint` at `path`
    (torch.distributed.checkpoint unless the candidate saves through its own engine)."""
    _harness_group()
    _seed_random(0)
    module = _params(case)
    opt = build(adapter, list(module.params), {**hp, **dict(case.options)})
    result = _steps(adapter, case, opt, list(module.params), range(save_step(case)))
    adapter.save_checkpoint(opt, module, path)
    return result


def candidate_resume(adapter: Adapter, case: Case, hp: dict[str, Any], path: str) -> dict[str, Any]:
    """The checkpoint family after the save, on case.resume_world_size ranks: a fresh candidate on zero params,
    loaded from `path` by `adapter.load_checkpoint`, then the remaining steps."""
    _harness_group()
    _seed_random(1)
    module = _params(case, zeros=True)
    opt = build(adapter, list(module.params), {**hp, **dict(case.options)})
    adapter.load_checkpoint(opt, module, path)
    loaded = [local(p.detach()).cpu().clone() for p in module.params]
    snapshot = (
        {"loaded_state": state_snapshot(opt, list(module.params))}
        if case.family in STATE_ROUNDTRIP_FAMILIES
        else {}
    )
    return {
        **_steps(adapter, case, opt, list(module.params), range(save_step(case), case.steps)),
        "loaded": loaded,
        **snapshot,
    }
