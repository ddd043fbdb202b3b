"""DistributedMuon: muon_ref.Muon's optimizer on DTensor / FSDP2 shards (or plain replicated tensors).

A thin torch.optim.Optimizer over the step function of muon_dist/step.py, as muon_ref.Muon is over
muon_ref.functional: the class validates params and gradients, owns the state ("momentum_buffer" per param),
reads each param's layout (once, while its shape, placements and mesh stay the same), resolves each group's
config once per step, finds the process group of each batch (a DeviceMesh axis's own group where there is one),
and writes what the step yields (the step writes each new param into its local tensor: execute's out_params).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from muon_ref import LAYOUT_DEFAULTS, MuonConfig
from muon_ref.functional import check_gradient
from muon_ref.optim import (
    add_group_checked,
    check_param,
    check_step_param,
    follow_torch_keys,
    group_config,
    param_name,
    torch_state_dict_groups,
)
from muon_ref.presets import preset_defaults, split_arguments

from .batch import Batch
from .comm import Comm, Group, ThreadComm, ThreadWorld, TorchComm
from .geometry import Geometry
from .kernels import backend, send_dtype
from .layout import ParamLayout, read_layout
from .plan import PIPELINE_DEPTH, Entry, Options, Plan
from .step import ParamInput, execute, prepare


@dataclass(frozen=True)
class StepReport:
    """paths: (param name, path or None when it did not step), in param-group order.
    bytes_by_path: this rank's (sent, received) bytes of the step, by path and by the step's checks."""

    paths: tuple[tuple[str, str | None], ...]
    bytes_by_path: dict[str, tuple[int, int]]


# The update layout DistributedMuon implements (muon_ref.MuonConfig.update_layout): the update reaches each rank's
# elementwise stage in row-major shards, so its contract is bitwise muon_ref.Muon with update_layout="contiguous"
# (docs/distributed.md, "Update layout").
UPDATE_LAYOUT = "contiguous"


def check_update_layout(value: Any, where: str) -> None:
    """ValueError naming the option for an update layout DistributedMuon does not implement."""
    if value != UPDATE_LAYOUT:
        raise ValueError(
            f"{where}: update_layout={value!r} is not implemented by DistributedMuon; valid: "
            f"{UPDATE_LAYOUT!r} (its updates arrive in row-major shards; muon_ref.Muon has 'kernel')"
        )


# The stack mode DistributedMuon implements (muon_ref.MuonConfig.ns_stack): each matrix of a stack orthogonalised
# alone, so that its bits do not depend on which of its stack's matrices share its rank.
NS_STACK = "per_matrix"


def check_ns_stack(value: Any, where: str) -> None:
    """ValueError naming the option for a stack mode DistributedMuon does not implement."""
    if value != NS_STACK:
        raise ValueError(
            f"{where}: ns_stack={value!r} is not implemented by DistributedMuon; valid: {NS_STACK!r} (each "
            "matrix of a stack is orthogonalised alone, wherever its stack's other matrices lie; muon_ref.Muon "
            "has 'batched')"
        )


def default_comm() -> Comm:
    """TorchComm over the default process group when there is one; otherwise a world of one (plain
    tensors on one device: every group has one member and no collective is called, and the step is
    muon_ref.Muon's, bitwise)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return TorchComm()
    return ThreadComm(ThreadWorld(1), 0)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def resolve_options(
    remainder: str | None,
    force_path: str | None,
    dispatch: str | None,
    rounds: int | None,
    pipeline_depth: int | None = None,
    memory_budget: int | None = None,
) -> Options:
    """The plan's Options from DistributedMuon's arguments: dispatch None is "global" (the fastest in
    docs/benchmarks.md), or "batched" when a remainder path or a forced path is asked for (options of batched
    dispatch); remainder None is "agrs"; pipeline_depth None is muon_dist.plan.PIPELINE_DEPTH."""
    if dispatch is None:
        dispatch = "batched" if remainder is not None or force_path is not None else "global"
    depth = PIPELINE_DEPTH if pipeline_depth is None else pipeline_depth
    return Options(remainder or "agrs", force_path, dispatch, rounds, depth, memory_budget)


def layout_keys(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's layout keys (LAYOUT_DEFAULTS' and "flatten"), its own values or the defaults."""
    return {k: group.get(k, LAYOUT_DEFAULTS.get(k)) for k in (*LAYOUT_DEFAULTS, "flatten")}


class DistributedMuon(torch.optim.Optimizer):
    """Muon on DTensor / FSDP2 / TP shards: muon_ref.Muon's update, distributed.

    Equation (per param, per step): M <- momentum(M, G); O <- NewtonSchulz(direction(M, G)) on each whole matrix
    (each expert of a stack, each block of a split or per-head param), computed where the plan puts it (one owner
    per matrix and shard group, or every rank of a replicated param); P <- decay(P) - lr * scale(shape) * O,
    elementwise on each rank's shard.

    Contract: bitwise muon_ref.Muon(params, preset, **overrides, update_layout="contiguous") on the full tensors
    (the layout it implements, UPDATE_LAYOUT; muon_ref's presets keep the kernel's layout, which differs in the
    last bits of bf16 params of tall matrices on CPU: docs/distributed.md, "Update layout"), with ns_backend
    "torch"; the other backends have the tolerance of their docstrings (muon_dist/kernels/).

    Args:
        params: params or param groups, as muon_ref.Muon takes them (its param-group keys, presets and
            torch.optim.Muon's signature and state dicts); DTensor params sharded on any mesh, or plain tensors.
        preset, **overrides: muon_ref.Muon's preset and options (muon_ref/presets.py, muon_ref/config.py).
        comm: where collectives run (muon_dist.comm): TorchComm over torch.distributed by default, or a world of
            one without a process group (default_comm).
        dispatch: "global" (the default: FLOP-balanced all-to-alls per shard group and dtype pair,
            muon_dist/paths/global_all_to_all.py) or "batched" (batches of W same-layout params; the default when
            `remainder` or `force_path` is given).
        remainder: batched dispatch's remainder path, "agrs" or "padded_all_to_all".
        force_path: one path of muon_dist.paths.PATHS for every matrix (checks and benchmarks).
        rounds: the step's all-to-all traffic in about that many pipelined rounds; None (the default): up to
            muon_dist.plan.ROUNDS, each of at least ROUND_MIN_ELEMENTS elements (muon_dist/plan.py, round_count).
        pipeline_depth: how many batches are in flight at once; None (the default): muon_dist.plan.PIPELINE_DEPTH,
            3 (one issuing its directions, one running its kernels, one receiving its updates). Fewer hold less
            memory and overlap less: 1 runs each batch to its end before the next starts (docs/benchmarks.md,
            "Pipeline depth"). The same bits at any depth.
        memory_budget: with rounds None (global dispatch), the bytes per rank the communication buffers of the
            batches in flight may hold: the rounds are as many as keep pipeline_depth times the most a rank sends
            and receives in a round within it, down to one param per owner and round, and from there fewer are in
            flight (last_plan.options.pipeline_depth, at least one); None (the default): pipeline_depth rounds
            of 4/3 of the floor round each (muon_dist.plan.BUDGET_FLOOR_ROUNDS, floor_round: every member
            orthogonalising one largest matrix), no round under 2^18 elements, the depth kept
            (docs/benchmarks.md, "A memory budget for the rounds"). The same bits at any budget.
        ns_backend: a name of muon_dist.kernels.BACKENDS ("torch", muon_ref's kernel, is bitwise).
        atomic: False (the default) writes the step in write groups, each after every rank agreed that its local
            work succeeded, holding one group's new buffers and updates at a time (a failure on any rank writes
            neither its group nor the later ones, on every rank); True holds the whole step's, and a failure
            writes nothing (muon_dist/step.py).

    State: "momentum_buffer", a DTensor like its param, for every param from construction on (checkpoints:
    muon_dist/checkpoint.py). After each step, `last_report` is a StepReport and `last_plan` the step's Plan.
    """

    def __init__(
        self,
        params: Iterable[Any],
        *args: Any,
        comm: Comm | None = None,
        remainder: str | None = None,
        force_path: str | None = None,
        dispatch: str | None = None,
        rounds: int | None = None,
        pipeline_depth: int | None = None,
        memory_budget: int | None = None,
        ns_backend: str = "torch",
        atomic: bool = False,
        **kwargs: Any,
    ) -> None:
        preset, overrides = split_arguments(args, kwargs)
        self._configure(
            comm,
            dict(
                preset=preset,
                remainder=remainder,
                force_path=force_path,
                dispatch=dispatch,
                rounds=rounds,
                pipeline_depth=pipeline_depth,
                memory_budget=memory_budget,
                ns_backend=ns_backend,
                atomic=atomic,
            ),
        )
        check_update_layout(overrides.get("update_layout", UPDATE_LAYOUT), "DistributedMuon")
        check_ns_stack(overrides.get("ns_stack", NS_STACK), "DistributedMuon")
        defaults = preset_defaults(preset, overrides)
        super().__init__(params, {**defaults, "update_layout": UPDATE_LAYOUT})

    def _configure(self, comm: Comm | None, construction: dict[str, Any]) -> None:
        """Everything but torch.optim's defaults, state and param groups, from the constructor's
        keyword options (kept in `construction`, so that a deepcopy or an unpickled copy rebuilds them:
        a comm and its process groups are not picklable, and the copy takes the default comm of where
        it is loaded)."""
        self.construction = construction
        self.comm = comm if comm is not None else default_comm()
        self.backend = backend(construction["ns_backend"])
        self.options = resolve_options(
            construction["remainder"],
            construction["force_path"],
            construction["dispatch"],
            construction.get("rounds"),
            construction.get("pipeline_depth"),
            construction.get("memory_budget"),
        )
        self.atomic = construction["atomic"]
        self.preset = construction["preset"]
        self.last_report: StepReport | None = None
        self.last_plan: Plan | None = None
        self._layouts: dict[
            int, tuple[tuple, ParamLayout]
        ] = {}  # id(param) -> (what it was read from, layout)
        self._groups: dict[
            tuple, Group
        ] = {}  # (partition, sharding axes, mesh) -> this rank's process group

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "construction": self.construction}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # load_state_dict passes state and param groups only
        construction = state.pop("construction", None)
        super().__setstate__(state)
        if construction is not None:
            self._configure(None, construction)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads this class's state dicts, muon_ref.Muon's and torch.optim.Muon's
        (torch_state_dict_groups); params that have not stepped get zero buffers, as at construction."""
        super().load_state_dict(torch_state_dict_groups(state_dict, self.defaults))
        for group in self.param_groups:
            follow_torch_keys(self, group)
            group["update_layout"] = UPDATE_LAYOUT  # muon_ref.Muon's groups say "kernel"
        self._own_group_params()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict) and "update_layout" in param_group:
            check_update_layout(param_group["update_layout"], "param group")
        if isinstance(param_group, dict) and "ns_stack" in param_group:
            check_ns_stack(param_group["ns_stack"], "param group")
        group = add_group_checked(self, param_group)
        for i, p in enumerate(group["params"]):
            name = param_name(group, i)
            check_param(p, name)
            self.layout(
                p, group, name
            ).geometry  # ValueError naming the param for a non-matrix or bad layout
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

    def layout(
        self, p: Tensor, group: dict[str, Any], name: str, keys: dict[str, Any] | None = None
    ) -> ParamLayout:
        """The param's layout, read once and reused while its shape, placements, mesh, local shape and layout keys
        stay the same. `keys`: the group's layout keys (layout_keys(group)), where the caller has read them."""
        if keys is None:
            keys = layout_keys(group)
        split = keys.get("split_sizes")
        seen = (
            name,
            tuple(p.shape),
            p.dtype,
            getattr(p, "placements", None),
            getattr(p, "device_mesh", None),
            tuple(_local(p).shape),
            tuple(split) if split is not None else None,
            *(keys[k] for k in ("num_experts", "num_heads", "split_dim", "flatten")),
        )
        cached = self._layouts.get(id(p))
        if cached is None or cached[0] != seen:
            cached = (seen, read_layout(p, name, keys, self.comm.world_size, self.comm.rank))
            self._layouts[id(p)] = cached
        return cached[1]

    def _collect(
        self, configs: list[MuonConfig]
    ) -> tuple[tuple[Entry, ...], list[ParamInput], list, str | None]:
        """Every param in param-group order: its entry, local shards, param object; the first local error."""
        entries, inputs, params, error = [], [], [], None
        sent_dtypes: dict[tuple[int, torch.dtype], torch.dtype | None] = {}
        for gi, group in enumerate(self.param_groups):
            update_dtype, keys = configs[gi].ns_dtype, layout_keys(group)
            for i, p in enumerate(group["params"]):
                name, grad = param_name(group, i), p.grad
                if grad is not None and error is None:
                    try:
                        check_gradient(grad, p, name)
                        if getattr(grad, "placements", None) != getattr(p, "placements", None):
                            raise ValueError(
                                f"{name} of shape {tuple(p.shape)}: gradient placements "
                                f"{getattr(grad, 'placements', None)} differ from the param's "
                                f"{getattr(p, 'placements', None)}; valid: the param's placements"
                            )
                    except ValueError as e:
                        error = str(e)
                if (gi, p.dtype) not in sent_dtypes:
                    sent_dtypes[gi, p.dtype] = send_dtype(self.backend, configs[gi], p.dtype)
                sent = sent_dtypes[gi, p.dtype]
                entries.append(
                    Entry(
                        self.layout(p, group, name, keys),
                        gi,
                        str(update_dtype or p.dtype),
                        grad is not None,
                        None if sent is None else str(sent),
                    )
                )
                buf = _local(self.state[p]["momentum_buffer"])
                inputs.append(ParamInput(_local(p), None if grad is None else _local(grad), buf))
                params.append(p)
        return tuple(entries), inputs, params, error

    def shard_group(self, geometry: Geometry, mesh: Any) -> Group:
        """This rank's shard group of a param of `geometry` on DeviceMesh `mesh` (None for a plain tensor): the
        mesh axis's own group when one axis shards, sub-groups made once per partition when several do (every rank
        calls this in the same order), the default group otherwise; found once per (partition, mesh) and reused."""
        key = (geometry.groups, geometry.axes, mesh)
        if key not in self._groups:
            ranks = geometry.group_of(self.comm.rank)
            if mesh is None:
                self._groups[key] = self.comm.group(ranks)
            elif len(geometry.axes) <= 1:  # one sharding axis, or a replicated DTensor's 1-D mesh
                self._groups[key] = self.comm.group(
                    ranks, mesh.get_group(geometry.axes[0] if geometry.axes else 0)
                )
            else:
                self._groups[key] = self.comm.subgroups(geometry.groups)[ranks]
        return self._groups[key]

    def _group_for(self, params: list[Tensor]) -> Callable[[Batch], Group]:
        """The process group of a batch (shard_group of its first param; every rank calls this in plan order)."""

        def group_for(batch: Batch) -> Group:
            return self.shard_group(
                batch.geometries[0], getattr(params[batch.params[0]], "device_mesh", None)
            )

        return group_for

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.comm.reset()
        # resolved once per group per step
        configs = [group_config(follow_torch_keys(self, g)) for g in self.param_groups]
        for i, (cfg, group) in enumerate(zip(configs, self.param_groups)):
            # the same groups and params on every rank: raised on all of them, before any collective
            check_update_layout(cfg.update_layout, f"param group {i}")
            check_ns_stack(cfg.ns_stack, f"param group {i}")
            for k, p in enumerate(group["params"]):
                if p.grad is not None:
                    check_step_param(p, param_name(group, k))
        entries, inputs, params, error = self._collect(configs)
        per_param = [configs[e.group_index] for e in entries]
        step_plan, skipped = prepare(self.comm, entries, inputs, per_param, self.options, error)
        local_params = [x.param for x in inputs]  # the step writes each new param into these
        for i, new_param, new_buf in execute(
            self.comm,
            step_plan,
            inputs,
            per_param,
            self.backend,
            self._group_for(params),
            self.atomic,
            skipped,
            out_params=local_params,
        ):
            p = params[i]
            if new_param is not local_params[i]:
                local_params[i].copy_(new_param)
            self._write_buffer(p, new_buf)
            del new_param, new_buf  # not held while the step computes the next ones
        self._own_group_params()
        self.last_plan = step_plan
        self.last_report = StepReport(
            tuple((e.layout.name, path) for e, path in zip(entries, step_plan.path_of())),
            {k: (v[0], v[1]) for k, v in self.comm.ledger.items()},
        )
        return loss

    def _write_buffer(self, p: Tensor, new_buf: Tensor) -> None:
        """The new momentum buffer into the storage of the old one: nothing to do where the step wrote it there
        (execute's out_params), an exact copy where they share dtype and shape (the step's other inputs still hold
        the old one, so replacing it would hold both until the step ends), else a new tensor like the param (a
        loaded buffer of another dtype). As in torch.optim's own optimizers, a state_dict() taken before the step
        holds the same buffers."""
        old = _local(self.state[p]["momentum_buffer"])
        if new_buf.data_ptr() == old.data_ptr() and new_buf.shape == old.shape:
            return  # the step wrote it in place
        if old.dtype == new_buf.dtype and old.shape == new_buf.shape:
            old.copy_(new_buf)
        else:
            self.state[p]["momentum_buffer"] = self._like_param(new_buf, p)

    @staticmethod
    def _like_param(local: Tensor, param: Tensor) -> Tensor:
        if not hasattr(param, "device_mesh"):
            return local
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
