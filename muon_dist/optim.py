"""DistributedMuon: muon_ref.Muon's optimizer on DTensor / FSDP2 shards (or plain replicated tensors).

One step: validate locally; plan (muon_dist/plan.py); all-gather the plan's digest and raise on every rank if
any rank disagrees; OR the ranks' non-finite flags; run momentum on local shards; move each batch through its
path (muon_dist/paths), where the owner runs muon_ref's kernel on the whole matrix; all-gather whether any rank's
local work failed (then every rank raises, nothing written); apply the update on local shards. The elementwise
stages go through muon_dist.elementwise.run_stage for the reference's bits.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from muon_ref.functional import apply_update, check_gradient, is_finite, momentum_direction
from muon_ref.optim import check_param, group_config, param_name
from muon_ref.presets import preset_defaults

from .comm import Comm, TorchComm
from .elementwise import run_stage
from .kernels import orthogonalizer
from .layout import ParamLayout, read_layout
from .paths import RUNNERS, global_all_to_all
from .plan import Entry, Options, Plan, plan


@dataclass(frozen=True)
class StepReport:
    """paths: (param name, path or None when it did not step), in param-group order.
    bytes_by_path: this rank's (sent, received) bytes of the step, by path (and by the step's checks)."""

    paths: tuple[tuple[str, str | None], ...]
    bytes_by_path: dict[str, tuple[int, int]]


@dataclass
class _Item:
    param: Tensor
    name: str
    group_index: int
    layout: ParamLayout
    grad: Tensor | None  # this rank's shard of the gradient


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class DistributedMuon(torch.optim.Optimizer):
    """`DistributedMuon(params, preset=..., **overrides)`: muon_ref.Muon's arguments, presets, param-group keys
    and state ("momentum_buffer", a DTensor like its param, for every param from construction on; checkpoints:
    muon_dist/checkpoint.py), plus keyword-only options: `comm` (default TorchComm over torch.distributed),
    `remainder` ("agrs" | "padded_all_to_all"), `force_path` and `dispatch` ("batched" | "global": one
    FLOP-balanced all-to-all per shard group and dtype pair, muon_dist/paths/global_all_to_all.py).
    After each step, `last_report` is a StepReport.
    """

    def __init__(self, params: Iterable[Any], preset: str | None = "torch", *, comm: Comm | None = None,
                 remainder: str = "agrs", force_path: str | None = None, dispatch: str = "batched",
                 ns_backend: str = "torch", **overrides: Any) -> None:
        self.comm = comm if comm is not None else TorchComm()
        self.orthogonalize = orthogonalizer(ns_backend)  # "triton": a tolerance, not bits (kernels/triton_ns.py)
        self.options = Options(remainder, force_path, dispatch)
        self.preset = preset
        self.last_report: StepReport | None = None
        self.last_plan: Plan | None = None
        super().__init__(params, preset_defaults(preset, overrides))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group_config(group)
        for i, p in enumerate(group["params"]):
            name = param_name(group, i)
            check_param(p, name)
            self._layout(p, group, name).matrices  # ValueError naming the param for a non-matrix
        self._own_group_params()

    def _own_group_params(self) -> None:
        """State holds exactly the params of the groups, each with a "momentum_buffer" (zeros until it steps), so
        every rank holds the same state keys from construction on (DCP saving needs that: Dion #18). The zeros
        change no bits: muon_ref's first step starts from zeros_like(grad), and a grad has its param's dtype. A
        param removed from its group loses its state at the next step (torch's state_dict fails on orphans)."""
        owned = {id(p) for group in self.param_groups for p in group["params"]}
        for p in [p for p in self.state if id(p) not in owned]:
            del self.state[p]
        for group in self.param_groups:
            for p in group["params"]:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)

    def _layout(self, p: Tensor, group: dict[str, Any], name: str) -> ParamLayout:
        return read_layout(p, name, group.get("num_experts"), group["flatten"], self.comm.rank, self.comm.world_size)

    def _collect(self) -> tuple[list[_Item], str | None]:
        """Every param in param-group order with its local gradient; the first local error, as a message."""
        items, error = [], None
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                name = param_name(group, i)
                grad = p.grad
                if grad is not None and error is None:
                    try:
                        check_gradient(grad, p, name)
                        if getattr(grad, "placements", None) != getattr(p, "placements", None):
                            raise ValueError(f"{name} of shape {tuple(p.shape)}: gradient placements "
                                             f"{getattr(grad, 'placements', None)} differ from the param's")
                    except ValueError as e:
                        error = str(e)
                items.append(_Item(p, name, gi, self._layout(p, group, name), None if grad is None else _local(grad)))
        return items, error

    def _update_dtype(self, item: _Item) -> torch.dtype:
        """The kernel's output dtype: the config's ns_dtype, or the param's when it is None."""
        return group_config(self.param_groups[item.group_index]).ns_dtype or item.param.dtype

    def _entries(self, items: list[_Item], skip: set[int]) -> tuple[Entry, ...]:
        return tuple(Entry(item.layout, item.group_index, str(self._update_dtype(item)),
                           item.grad is not None and i not in skip) for i, item in enumerate(items))

    def _agree(self, step_plan: Plan, error: str | None) -> None:
        """All-gather the plan digests (or a local error's) and raise the same way on every rank on mismatch."""
        digest = hashlib.sha256(b"error:" + error.encode()).digest() if error else step_plan.digest()
        digests = self.comm.check_agreement(digest, "plan_digest")
        if error:
            raise ValueError(error)
        if len(set(digests)) > 1:
            differ = [r for r, d in enumerate(digests) if d != digests[0]]
            mine = [(e.layout.name, e.layout.global_shape, e.layout.placements, e.layout.dtype, e.active)
                    for e in step_plan.entries]
            raise ValueError(f"DistributedMuon: ranks {differ} disagree with rank 0 on the step's plan (param shapes, "
                             f"dtypes, placements, meshes, param groups, which params have gradients, or a local "
                             f"error on that rank); rank {self.comm.rank} sees (name, shape, placements, dtype, "
                             f"has grad): {mine}")

    def _nonfinite(self, items: list[_Item]) -> set[int]:
        """Indices of params whose gradient is non-finite on any rank (one small all-gather over the world)."""
        flags = [item.grad is not None and not is_finite(item.grad) for item in items]
        world = self.comm.group(tuple(range(self.comm.world_size)), None, 0)
        mine = torch.tensor(flags, dtype=torch.uint8, device=self.comm.device)
        gathered = self.comm.all_gather(mine, world, "nonfinite_check").cpu().reshape(self.comm.world_size, len(items))
        bad = set(torch.nonzero(gathered.amax(dim=0)).flatten().tolist())
        for i in sorted(bad):
            if group_config(self.param_groups[items[i].group_index]).nonfinite == "raise":
                p = items[i].param
                raise ValueError(f"{items[i].name} of shape {tuple(p.shape)} has a non-finite gradient (NaN or Inf)")
        return bad

    def kernel(self, item: _Item) -> Callable[[Tensor], Tensor]:
        """This param's kernel: muon_ref's orthogonalize (newton_schulz per matrix) on the whole param, or on a run
        of its whole experts (the expert paths pass a rank's experts: the layout keeps their count)."""
        cfg, matrices = group_config(self.param_groups[item.group_index]), item.layout.matrices
        size = matrices.fan_out * matrices.fan_in
        return lambda x: self.orthogonalize(x, dataclasses.replace(matrices, num_matrices=x.numel() // size), cfg)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.comm.reset()
        items, error = self._collect()
        self._agree(plan(self._entries(items, set()), self.options), error)
        step_plan = plan(self._entries(items, self._nonfinite(items)), self.options)
        failures: list[tuple[str, Exception]] = []
        buffers, directions = self._momentum(items, step_plan, failures)
        updates = self._orthogonalize(items, step_plan, directions, failures)
        self._agree_no_failure(failures)
        self._apply(items, updates, buffers)
        self._own_group_params()
        self.last_plan = step_plan
        self.last_report = StepReport(tuple((it.name, p) for it, p in zip(items, step_plan.path_of())),
                                      {k: (v[0], v[1]) for k, v in self.comm.ledger.items()})
        return loss

    @staticmethod
    def _guard(failures: list[tuple[str, Exception]], what: str, fn: Callable[..., Any],
               fallback: Callable[..., Any]) -> Callable[..., Any]:
        """fn, except that an exception is recorded in `failures` and answered with fallback(*args) (zeros): the
        rank keeps taking part in the step's remaining collectives instead of leaving its peers blocked in them,
        and _agree_no_failure then raises on every rank before anything is written."""
        def run(*args: Any) -> Any:
            try:
                return fn(*args)
            except Exception as e:  # noqa: BLE001 - re-raised by _agree_no_failure, with its rank
                failures.append((what, e))
                return fallback(*args)
        return run

    def _agree_no_failure(self, failures: list[tuple[str, Exception]]) -> None:
        """A digest all-gather after the step's last data collective, before any write: if the local work of any
        rank failed, every rank raises (promptly: no rank waits on a collective its peer never joins)."""
        ok = hashlib.sha256(b"step ok").digest()
        digests = self.comm.check_agreement(hashlib.sha256(b"step failed").digest() if failures else ok, "plan_digest")
        failed = [r for r, d in enumerate(digests) if d != ok]
        if failures:
            what, e = failures[0]
            raise RuntimeError(f"DistributedMuon: rank {self.comm.rank} failed mid-step in {what} "
                               f"({type(e).__name__}: {e}); failed ranks {failed}; no param or momentum buffer "
                               f"was written on any rank") from e
        if failed:
            raise RuntimeError(f"DistributedMuon: ranks {failed} failed mid-step (their own errors name the cause); "
                               f"no param or momentum buffer was written on any rank")

    def _momentum(self, items: list[_Item], step_plan: Plan,
                  failures: list[tuple[str, Exception]]) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
        """(new momentum buffers, directions) of the active params, on local shards; nothing is written."""
        buffers, directions = {}, {}
        for batch in step_plan.batches:
            for i in batch.params:
                item = items[i]
                cfg = group_config(self.param_groups[item.group_index])
                buf = self.state[item.param].get("momentum_buffer")
                buf = torch.zeros_like(item.grad) if buf is None else _local(buf)
                stage = functools.partial(momentum_direction, cfg=cfg)
                momentum = self._guard(failures, f"the momentum of {item.name}",
                                       lambda g, b, s=stage, lay=item.layout: run_stage(s, [g, b], lay),
                                       lambda g, b: (torch.zeros_like(g), torch.zeros_like(g)))
                buffers[i], directions[i] = momentum(item.grad, buf)
        return buffers, directions

    @staticmethod
    def _like_param(local: Tensor, param: Tensor) -> Tensor:
        if not hasattr(param, "device_mesh"):
            return local
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())

    def _orthogonalize(self, items: list[_Item], step_plan: Plan, directions: dict[int, Tensor],
                       failures: list[tuple[str, Exception]]) -> dict[int, Tensor]:
        """Each batch through its path; returns this rank's shard of every active param's update."""
        updates = {}
        for batch in step_plan.batches:
            first = items[batch.params[0]]
            layout = first.layout
            mesh = getattr(first.param, "device_mesh", None)
            group = self.comm.group(layout.group_ranks(), mesh, layout.shard_axes or (0,))
            dtype = self._update_dtype(first)
            kernels = [self._guard(failures, f"the kernel of a batch from {items[i].name}", self.kernel(items[i]),
                                   lambda full, dtype=dtype: torch.zeros_like(full, dtype=dtype)) for i in batch.params]
            moving = [directions[i] for i in batch.params]
            if batch.path == "global_all_to_all":
                outs = global_all_to_all.run(self.comm, group, moving, [items[i].layout for i in batch.params],
                                             kernels, batch.owners, dtype)
            else:
                outs = RUNNERS[batch.path](self.comm, group, moving, layout, kernels[0], dtype)
            updates.update(zip(batch.params, outs))
        return updates

    def _apply(self, items: list[_Item], updates: dict[int, Tensor], buffers: dict[int, Tensor]) -> None:
        """Write params and momentum buffers (only now, after every collective of the step succeeded)."""
        for i, update in updates.items():
            item = items[i]
            cfg = group_config(self.param_groups[item.group_index])
            stage = lambda p, u, m=item.layout.matrices: (apply_update(p, u, m, cfg),)  # noqa: E731
            (new,) = run_stage(stage, [_local(item.param), update], item.layout)
            _local(item.param).copy_(new)
            self.state[item.param]["momentum_buffer"] = self._like_param(buffers[i], item.param)
