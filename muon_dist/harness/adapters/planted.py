"""Planted bugs: for each class of docs/field-bugs.md that a check can reach, a small Muon written
here with exactly that defect, behind an adapter; `python -m muon_dist.harness.conformance --planted` runs them all
and says which the check caught, by which families, and whether its diagnosis is the right one.

Four small correct Muons carry the defects, one per way a candidate sees its parameters; each is muon_ref's three
stages (muon_ref.functional: momentum_direction, orthogonalize, apply_update) on whole tensors, so each is bitwise
muon_ref.Muon, and each conforms on every family of its mode (BASES; tests/test_planted.py checks each where the
planted bugs built on it are caught). A planted bug is one of them with one method changed:
    SmallMuon        single device
    GatherMuon       DTensor Shard(0): every rank gathers each param whole (DTensor.full_tensor) and keeps its box
    RoundRobinMuon   replicated, DDP style: KellerJordan's batches of W params, one owner per param, all-gathered
    ZeroMuon         unreduced, ZeRO-1/2 style: gradients reduce-scattered over W flat partitions
Where a field bug is a race or depends on hardware, the planted defect is its deterministic limit, said so in its
docstring. Unreachable here: bug 10 (UNREACHABLE).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from muon_dist.comm import older_collective_names
from muon_ref import MatrixLayout, lr_scale, matrix_layout, momentum_direction, orthogonalize
from muon_ref.config import MuonConfig
from muon_ref.functional import apply_update, decay
from muon_ref.optim import group_config
from muon_ref.presets import preset_defaults

from ..fixtures import chunk, local
from . import Adapter
from .cases import (
    CHECKPOINT_FAMILIES,
    DIST_FAMILIES,
    REPLICATED_FAMILIES,
    SINGLE_FAMILIES,
    UNREDUCED_FAMILIES,
)


def _groups(params: list[Tensor]) -> list[dict[str, Any]]:
    """One group per param; 4-D conv weights read as (out, -1) matrices (flatten=True), as the oracle reads them."""
    return [{"params": [p], "flatten": p.ndim >= 4} for p in params]


def _layout(p: Tensor, group: dict[str, Any]) -> MatrixLayout:
    """The param's matrices as muon_ref reads them (the global shape: a DTensor's, not its box's)."""
    return matrix_layout(tuple(p.shape), flatten=group["flatten"])


def agreed_gradients(params: list[Tensor]) -> list[bool]:
    """Which params step this step, the same on every rank: the has-gradient flags of every rank, all-gathered.
    A param with a gradient on some ranks only is a ValueError on every rank, before anything is written."""
    mine = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    flags = torch.stack(every)
    differ = torch.nonzero(flags.amin(0) != flags.amax(0)).flatten().tolist()
    if differ:
        ranks = torch.nonzero(flags[:, differ[0]]).flatten().tolist()
        raise ValueError(
            f"param {differ[0]} of shape {tuple(params[differ[0]].shape)} has a gradient on ranks "
            f"{ranks} only"
        )
    return flags[0].bool().tolist()


# ---------------------------------------------------------------- single device


class SmallMuon(torch.optim.Optimizer):
    """A correct single-device Muon: for each param with a gradient G (muon_ref.functional's stages, MuonConfig's
    conventions),
        M', D = momentum_direction(G, M);   O = orthogonalized(D);   P' = applied(P, O)
    with orthogonalized = orthogonalize and applied = apply_update: bitwise muon_ref.Muon."""

    def __init__(self, params: Any, preset: str | None = "torch", **overrides: Any) -> None:
        super().__init__(params, preset_defaults(preset, overrides))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        """Every param with a gradient steps; the others are skipped (as muon_ref.Muon does)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_param(p, group)

    def _step_param(self, p: Tensor, group: dict[str, Any]) -> None:
        """The three stages on p (the class docstring's equations), written into p and its state."""
        cfg, layout = group_config(group), _layout(p, group)
        buf = self.state[p].get("momentum_buffer", torch.zeros_like(p))
        new_buf, direction = momentum_direction(p.grad, buf, cfg)
        update = self.orthogonalized(direction, layout, cfg)
        p.copy_(self.applied(p, update, layout, cfg))
        self.state[p]["momentum_buffer"] = new_buf

    def orthogonalized(self, direction: Tensor, layout: MatrixLayout, cfg: MuonConfig) -> Tensor:
        """O = orthogonalize(D): Newton-Schulz on each matrix of the layout; D is not written."""
        return orthogonalize(direction, layout, cfg)

    def applied(self, p: Tensor, update: Tensor, layout: MatrixLayout, cfg: MuonConfig) -> Tensor:
        """P' = apply_update(P, O): decay, then the update scaled by lr and the layout's shape scale."""
        return apply_update(p, update, layout, cfg)


class InPlaceNormalisedInput(SmallMuon):
    """Field bug 11, torch.optim.Muon 2.13 (found here; docs/conventions.md, "Noticed in the field"): its kernel normalises its
    input in place, `X = G.bfloat16(); X.div_(X.norm().clamp(min=eps))` (torch/optim/_muon.py), and with
    nesterov=False the input is the momentum buffer itself, which `.bfloat16()` returns uncopied for bf16 params.
    Here: the same in-place normalisation of `direction.to(ns_dtype)` (the kernel's own output is unchanged: its
    normalised copy feeds only its own iterations). Shows with bf16 params and nesterov=False only."""

    def orthogonalized(self, direction: Tensor, layout: MatrixLayout, cfg: MuonConfig) -> Tensor:
        update = super().orthogonalized(direction, layout, cfg)
        X = direction.to(cfg.ns_dtype)
        X.div_(X.norm().clamp(min=cfg.eps))
        return update


class InPlaceForeachScale(SmallMuon):
    """Field bug 12, xtuner's post-update (found here; docs/conventions.md, "What changes bits"): the update is scaled in place,
    `torch._foreach_mul_(updates, lr * s)`, which rounds the Python scalar to the update's dtype first when that is
    bf16; the claim (preset dion, `P - O*(lr*s)`) scales out of place, in fp32. A convention of muon_ref
    (scale_apply="update_lr_cast"), so the right diagnosis names it."""

    def applied(self, p: Tensor, update: Tensor, layout: MatrixLayout, cfg: MuonConfig) -> Tensor:
        scaled = update if cfg.update_dtype is None else update.to(cfg.update_dtype)
        torch._foreach_mul_(
            [scaled], cfg.lr * lr_scale(cfg.lr_scale, layout.fan_out, layout.fan_in, cfg.scale_sqrt)
        )
        return decay(p, cfg).sub(scaled).to(p.dtype)


class MuonPerMicroBatch(SmallMuon):
    """Field bug 7, DeepSpeed #8443 (fixed by PR #8600): ZeRO-3 ran Muon inside its gradient reduce, once per
    micro-batch, so the momentum advanced once per micro-batch and Newton-Schulz saw each micro-batch's gradient.
    Here: a gradient hook does the momentum and Newton-Schulz on each incoming gradient and hands autograd the
    orthogonalised update to accumulate; step() applies what accumulated. One micro-batch: muon_ref exactly."""

    def __init__(self, params: Any, preset: str | None = "torch", **overrides: Any) -> None:
        super().__init__(params, preset, **overrides)
        for group in self.param_groups:
            for p in group["params"]:
                p.register_hook(functools.partial(self._on_gradient, p, group))

    @torch.no_grad()
    def _on_gradient(self, p: Tensor, group: dict[str, Any], grad: Tensor) -> Tensor:
        """The hook: momentum on this micro-batch's gradient, and its orthogonalised direction as the gradient."""
        cfg = group_config(group)
        buf = self.state[p].get("momentum_buffer", torch.zeros_like(p))
        self.state[p]["momentum_buffer"], direction = momentum_direction(grad, buf, cfg)
        return self.orthogonalized(direction, _layout(p, group), cfg).to(
            grad.dtype
        )  # a gradient has p's dtype

    def _step_param(self, p: Tensor, group: dict[str, Any]) -> None:
        """P' = applied(P, what autograd accumulated of the hooks' updates)."""
        layout = _layout(p, group)
        p.copy_(self.applied(p, p.grad, layout, group_config(group)))


# ---------------------------------------------------------------- DTensor Shard(0)


class GatherMuon(torch.optim.Optimizer):
    """A correct Muon on DTensor Shard(0) params (plain tensors: one rank): for each param that steps, every rank
    gathers the whole gradient, momentum and param, runs SmallMuon's stages on them, and keeps its box:
        P'_r = box_r(apply_update(P, orthogonalize(D)))   with M', D = momentum_direction(G, M), all whole tensors
    bitwise muon_ref.Muon (the same functions on the same tensors; box_r is torch.chunk's). Which params step:
    agreed_gradients. Momentum: a buffer like its param for every param from construction on, so every rank holds
    the same state keys and torch.distributed.checkpoint can save them (Dion #89)."""

    def __init__(self, params: Any, preset: str | None = "torch", **overrides: Any) -> None:
        super().__init__(params, preset_defaults(preset, overrides))
        for group in self.param_groups:
            for p in group["params"]:
                self.initial_state(p)

    def initial_state(self, p: Tensor) -> None:
        """A zero momentum buffer like p (a DTensor for a DTensor), at construction."""
        self.state[p]["momentum_buffer"] = torch.zeros_like(p)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        """The params that `stepping` selects, one after the other, every rank in the same order."""
        params = [p for group in self.param_groups for p in group["params"]]
        steps = iter(self.stepping(params))
        for group in self.param_groups:
            for p in group["params"]:
                if next(steps):
                    self._step_param(p, group)

    def stepping(self, params: list[Tensor]) -> list[bool]:
        """Which params step: agreed_gradients (the same on every rank, or ValueError on every rank)."""
        return agreed_gradients(params)

    def _step_param(self, p: Tensor, group: dict[str, Any]) -> None:
        """The three stages on the gathered whole tensors; this rank's box of the results into p and its buffer."""
        cfg, layout = group_config(group), _layout(p, group)
        state = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
        G, M, P = (self.gathered(t) for t in (p.grad, state, p))
        new_buf, direction = momentum_direction(G, M, cfg)
        new = apply_update(
            P, orthogonalize(direction, layout, cfg), self.scale_layout(p, layout), cfg
        )
        local(p).copy_(self._box(new, p))
        local(state).copy_(self._box(new_buf, p))

    def gathered(self, t: Tensor) -> Tensor:
        """The whole tensor of a DTensor (DTensor.full_tensor: an all-gather, exact for any boxes), or t."""
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def scale_layout(self, p: Tensor, layout: MatrixLayout) -> MatrixLayout:
        """The layout whose (fan_out, fan_in) gives the lr scale: the param's own."""
        return layout

    @staticmethod
    def _box(full: Tensor, p: Tensor) -> Tensor:
        """This rank's box of a whole tensor placed like p: torch.chunk's chunk on the 1-D mesh (empty past the end)."""
        if not hasattr(p, "device_mesh"):
            return full
        mesh = p.device_mesh
        return chunk(full, 0, mesh.get_local_rank(), mesh.size())


class EmptyBoxSkipsItsParam(GatherMuon):
    """Field bug 1, microsoft/dion #74 (fix #75, regression #97): the all-to-all hung when FSDP2 produced empty
    shards ((18, D) on 8 ranks). Here: a rank whose box of a param is empty has nothing to update and skips the
    param, with its gathers, while its peers wait in them."""

    def _step_param(self, p: Tensor, group: dict[str, Any]) -> None:
        if local(p).numel():
            super()._step_param(p, group)


class LocalGradientDecision(GatherMuon):
    """Field bug 2, KellerJordan/Muon #37: `if p.grad is None: continue` on some ranks only (MoE experts that got
    no tokens) skips that param's collectives there, and the others hang in them. Here: each rank decides from its
    own gradients which params step, instead of agreeing with the others."""

    def stepping(self, params: list[Tensor]) -> list[bool]:
        return [p.grad is not None for p in params]


class PaddedShapeScale(GatherMuon):
    """Field bug 4, NVIDIA/Megatron-LM #6683 (fix PR #7236): rows padded for sharding were not stripped before the
    lr scale, f(M + pad, N) instead of f(M, N). Here: the scale is read from the shape with dim 0 padded to a
    multiple of the mesh size (the padding of an even split), everything else from the true matrix."""

    def scale_layout(self, p: Tensor, layout: MatrixLayout) -> MatrixLayout:
        W = p.device_mesh.size() if hasattr(p, "device_mesh") else 1
        rows = math.ceil(p.shape[0] / W) * W
        return matrix_layout((rows, *p.shape[1:]), flatten=p.ndim >= 4)


class ShardShapeScale(GatherMuon):
    """Field bug 5, InternLM/xtuner PR 1716: the lr ratio was computed from a shard's shape after communication
    (fixed by precomputing it from the global shape). Here: the scale is read from this rank's box."""

    def scale_layout(self, p: Tensor, layout: MatrixLayout) -> MatrixLayout:
        return matrix_layout(tuple(local(p).shape), flatten=p.ndim >= 4)


class LazyState(GatherMuon):
    """Field bug 8, microsoft/dion #18 (fix #89; ByteDance VeOmni #1008): state created lazily, at a param's first
    step with a gradient, so a param without one yet has no state keys: a DCP save lacks them and a resume, whose
    template a fresh optimizer fills (torch.distributed.checkpoint.state_dict initialises empty state with a zero
    step), cannot find them. Here: no state at construction."""

    def initial_state(self, p: Tensor) -> None:
        pass


class EqualShardGather(GatherMuon):
    """Field bug 13, muon-fsdp2 0.3.0 (found by this check): its gather and scatter assume equal shards, so uneven shards
    are a gloo size mismatch. Here: the whole tensor is gathered with the list form of all_gather into buffers of
    this rank's box shape (right only when every box has that shape)."""

    def gathered(self, t: Tensor) -> Tensor:
        if not hasattr(t, "device_mesh"):
            return t
        box = local(t).contiguous()
        boxes = [torch.empty_like(box) for _ in range(t.device_mesh.size())]
        dist.all_gather(boxes, box, group=t.device_mesh.get_group())
        return torch.cat(boxes)


# ---------------------------------------------------------------- replicated, DDP style


class RoundRobinMuon(torch.optim.Optimizer):
    """A correct DDP-style Muon on replicated plain params (KellerJordan's Muon.step, muon-optimizer 0.1.0, made right
    for remainders and mixed shapes). Every rank runs momentum_direction on every param that steps (elementwise:
    the momentum buffers stay replicated, and DCP may save them from any rank). The params that step, in order,
    padded with -len % W empty slots, form batches of W; in a batch, rank r orthogonalises and updates slot r, and
    the batch's new params are all-gathered (flattened, zero-padded to the batch's largest) into every rank:
        P' = apply_update(P, orthogonalize(D)) on every rank, bitwise muon_ref.Muon."""

    def __init__(self, params: Any, preset: str | None = "torch", **overrides: Any) -> None:
        super().__init__(params, preset_defaults(preset, overrides))
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        """Momentum on every rank, then batch by batch: the owner's update, all-gathered, landed (class docstring)."""
        entries = [(p, g) for g in self.param_groups for p in g["params"]]
        entries = [e for e, on in zip(entries, agreed_gradients([p for p, _ in entries])) if on]
        directions = {}
        for p, group in entries:
            buf = self.state[p]["momentum_buffer"]
            self.state[p]["momentum_buffer"], directions[p] = momentum_direction(
                p.grad, buf, group_config(group)
            )
        W, rank = dist.get_world_size(), dist.get_rank()
        slots = entries + [None] * self.padding(len(entries), W)
        for start in range(0, len(entries), W):
            batch = slots[start : start + W]
            size = max(p.numel() for p, _ in filter(None, batch))
            mine = torch.zeros(size, dtype=entries[0][0].dtype)
            if batch[rank] is not None:
                p, group = batch[rank]
                cfg, layout = group_config(group), _layout(p, group)
                mine[: p.numel()] = apply_update(
                    p, orthogonalize(directions[p], layout, cfg), layout, cfg
                ).flatten()
            gathered = torch.empty(W * size, dtype=mine.dtype)
            with older_collective_names():  # names every supported torch has
                dist.all_gather_into_tensor(gathered, mine)
            self.land(batch, gathered.view(W, size))

    @staticmethod
    def padding(num_params: int, world_size: int) -> int:
        """Empty slots that make the list a multiple of W."""
        return -num_params % world_size

    def land(self, batch: list, gathered: Tensor) -> None:
        """Every slot's new values (row r of the gather: rank r's) into its param, on every rank."""
        for entry, row in zip(batch, gathered):
            if entry is not None:
                p, _ = entry
                p.copy_(row[: p.numel()].view(p.shape))


class RemainderPadding(RoundRobinMuon):
    """Field bug 3, KellerJordan muon-optimizer 0.1.0 (found by this check): `params + [...] * (len(params) % W)`, where
    `-len(params) % W` slots are needed; they differ when len(params) % W is neither 0 nor W / 2 (5 params on
    W = 4): the last batch is short and ranks past its end fail."""

    @staticmethod
    def padding(num_params: int, world_size: int) -> int:
        return num_params % world_size


class GatherNeverLands(RoundRobinMuon):
    """Field bug 9, karpathy/nanochat #843: async all-gather inputs and Work handles freed before wait(), so the
    gather could deliver torn data: each rank keeps its own part of every matrix right and stale bytes for the
    others' parts. A race; here its deterministic limit: the gathered values never reach the params, so each rank
    holds only the params it updated itself."""

    def land(self, batch: list, gathered: Tensor) -> None:
        rank = dist.get_rank()
        if batch[rank] is not None:
            p, _ = batch[rank]
            p.copy_(gathered[rank][: p.numel()].view(p.shape))


# ---------------------------------------------------------------- unreduced, ZeRO-1/2 style


class ZeroMuon(torch.optim.Optimizer):
    """A correct ZeRO-1/2-style Muon on replicated plain params, each rank with its own gradient. The gradients,
    flattened and concatenated in param order (zeros for a param that does not step), are cut into W partitions
    of ceil(total / W) elements and reduce-scattered (SUM, then / W: the mean); the partitions are all-gathered
    back, so every rank holds the whole mean gradient. Each rank steps every param that overlaps its partition
    on the whole matrix (a param straddling a boundary on each rank that holds part of it, on the same mean: the
    fix of DeepSpeed PR #8141) and keeps its partition of the new params, which are all-gathered into every rank.
    Momentum: the buffer of each param that overlaps this rank's partition (ZeRO partitions optimizer state), so
    it claims no checkpoint families: torch.distributed.checkpoint.state_dict's set_optimizer_state_dict refuses a
    rank without state for a param it holds (strict loading; ZeRO checkpoints through its own format)."""

    def __init__(self, params: Any, preset: str | None = "torch", **overrides: Any) -> None:
        super().__init__(params, preset_defaults(preset, overrides))
        W, rank = dist.get_world_size(), dist.get_rank()
        entries = [(p, g) for g in self.param_groups for p in g["params"]]
        ends = [0, *torch.tensor([p.numel() for p, _ in entries]).cumsum(0).tolist()]
        self.part = math.ceil(ends[-1] / W)
        self.spans = [(p, group, a, b) for (p, group), a, b in zip(entries, ends, ends[1:])]
        self.mine = (rank * self.part, (rank + 1) * self.part)
        for p, _, a, b in self.spans:
            if a < self.mine[1] and b > self.mine[0]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        """Reduce-scatter the flat gradients, whole_gradient, step what overlaps this partition, all-gather params."""
        W, (lo, hi) = dist.get_world_size(), self.mine
        stepping = agreed_gradients([p for p, *_ in self.spans])
        flat = torch.cat(
            [
                p.grad.flatten() if on else torch.zeros(p.numel(), dtype=p.dtype)
                for (p, *_), on in zip(self.spans, stepping)
            ]
        )
        flat = torch.cat([flat, flat.new_zeros(W * self.part - flat.numel())])
        reduced = torch.empty(self.part, dtype=flat.dtype)
        with older_collective_names():  # names every supported torch has
            dist.reduce_scatter_tensor(reduced, flat)
        reduced.div_(W)
        whole = self.whole_gradient(flat, reduced)
        new = flat.new_zeros(W * self.part)
        for (p, group, a, b), on in zip(self.spans, stepping):
            new[a:b] = p.detach().flatten()
            if on and a < hi and b > lo:
                cfg, layout = group_config(group), _layout(p, group)
                buf = self.state[p]["momentum_buffer"]
                self.state[p]["momentum_buffer"], direction = momentum_direction(
                    whole[a:b].view(p.shape), buf, cfg
                )
                new[a:b] = apply_update(
                    p, orthogonalize(direction, layout, cfg), layout, cfg
                ).flatten()
        gathered = torch.empty_like(new)
        with older_collective_names():  # names every supported torch has
            dist.all_gather_into_tensor(gathered, new[lo:hi].clone())
        for p, _, a, b in self.spans:
            p.copy_(gathered[a:b].view(p.shape))

    def whole_gradient(self, flat: Tensor, reduced: Tensor) -> Tensor:
        """The mean gradient of every element: the reduced partitions of all ranks, all-gathered."""
        whole = torch.empty_like(flat)
        with older_collective_names():  # names every supported torch has
            dist.all_gather_into_tensor(whole, reduced)
        return whole


class PartlyReducedStraddlers(ZeroMuon):
    """Field bug 6, deepspeedai/DeepSpeed #7807 (#8090 refused the configuration, #8141 fixed it): with
    reduce_scatter, a rank holds the mean only for its own partition and its local, unreduced gradient for the
    rest, and Muon ran on that matrix: a param crossing a partition boundary was orthogonalised on a partly reduced
    gradient, differently on each rank that holds part of it. Here: the same whole gradient, without the gather."""

    def whole_gradient(self, flat: Tensor, reduced: Tensor) -> Tensor:
        lo, hi = self.mine
        whole = flat.clone()
        whole[lo:hi] = reduced
        return whole


# ---------------------------------------------------------------- adapters and the suite


class PlantedAdapter(Adapter):
    """One of this module's optimizers behind the conformance check: built on one group per param, claiming
    `preset` (torch unless said), for the families of its kind that the suite runs."""

    def __init__(
        self,
        optimizer: type[torch.optim.Optimizer],
        distributed: str | None,
        families: frozenset[str],
        preset: str = "torch",
        dtypes: tuple[str, ...] = ("float32",),
    ) -> None:
        self.optimizer, self.distributed, self.families = optimizer, distributed, families
        self.name, self.preset, self.dtypes = optimizer.__name__, preset, dtypes

    def version(self) -> str:
        return "planted"

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        """The optimizer on one group per param, under the claimed preset and the check's hyperparameters."""
        return self.optimizer(_groups(params), preset=self.preset, **hp)


@dataclass(frozen=True)
class Planted:
    """A planted bug and the right answer of the check. diagnosis: what the diagnosis line must say first or at all:
    "bug" (no convention explains it), "convention" (then `names`, the muon_ref option, must appear), "crash",
    "hang" or "replicas" (replicas disagree). caught_by: families in which it must depart; bitwise_on: families
    that must stay bitwise (the diagnosis' controls: the defect shows nowhere else)."""

    field_bug: int
    source: str
    adapter: PlantedAdapter
    diagnosis: str
    caught_by: frozenset[str]
    bitwise_on: frozenset[str] = frozenset()
    world_sizes: tuple[int, ...] = (2,)
    names: str = ""


_SHOWN = frozenset({"tall", "square", "experts3d"})  # single-device families that must stay bitwise
PLANTED: tuple[Planted, ...] = (
    Planted(
        1,
        "microsoft/dion #74",
        PlantedAdapter(EmptyBoxSkipsItsParam, "dtensor", DIST_FAMILIES),
        "hang",
        frozenset({"empty"}),
        DIST_FAMILIES - {"empty"},
    ),
    Planted(
        2,
        "KellerJordan/Muon #37",
        PlantedAdapter(LocalGradientDecision, "dtensor", DIST_FAMILIES),
        "hang",
        frozenset({"asym_none"}),
        DIST_FAMILIES - {"asym_none"},
    ),
    Planted(
        3,
        "KellerJordan muon-optimizer 0.1.0",
        PlantedAdapter(RemainderPadding, "replicated", REPLICATED_FAMILIES),
        "crash",
        frozenset({"remainder"}),
        REPLICATED_FAMILIES - {"remainder"},
        world_sizes=(2, 4),
    ),
    Planted(
        4,
        "NVIDIA/Megatron-LM #6683",
        PlantedAdapter(PaddedShapeScale, "dtensor", DIST_FAMILIES),
        "bug",
        frozenset({"padded_scale", "uneven"}),
        frozenset({"even", "empty", "remainder", "experts"}),
    ),
    Planted(
        5,
        "InternLM/xtuner PR 1716",
        PlantedAdapter(ShardShapeScale, "dtensor", DIST_FAMILIES),
        "bug",
        frozenset({"padded_scale"}),
        frozenset({"even", "uneven", "remainder", "experts"}),
    ),
    Planted(
        6,
        "deepspeedai/DeepSpeed #7807",
        PlantedAdapter(
            PartlyReducedStraddlers, "unreduced", UNREDUCED_FAMILIES - CHECKPOINT_FAMILIES
        ),
        "replicas",
        frozenset({"straddle"}),
        frozenset({"even", "experts"}),
    ),
    Planted(
        7,
        "deepspeedai/DeepSpeed #8443",
        PlantedAdapter(MuonPerMicroBatch, None, SINGLE_FAMILIES),
        "bug",
        frozenset({"micro_batches"}),
        SINGLE_FAMILIES - {"micro_batches"},
    ),
    Planted(
        8,
        "microsoft/dion #18",
        PlantedAdapter(LazyState, "dtensor", DIST_FAMILIES),
        "crash",
        frozenset({"checkpoint_unstepped"}),
        DIST_FAMILIES - {"checkpoint_unstepped"},
    ),
    Planted(
        9,
        "karpathy/nanochat #843",
        PlantedAdapter(GatherNeverLands, "replicated", REPLICATED_FAMILIES),
        "replicas",
        frozenset({"even", "remainder", "mixed"}),
    ),
    Planted(
        11,
        "torch.optim.Muon 2.13",
        PlantedAdapter(
            InPlaceNormalisedInput, None, _SHOWN | {"nesterov_off"}, dtypes=("float32", "bfloat16")
        ),
        "bug",
        frozenset({"nesterov_off"}),
        _SHOWN,
    ),
    Planted(
        12,
        "InternLM/xtuner vs microsoft/dion",
        PlantedAdapter(InPlaceForeachScale, None, _SHOWN, preset="dion"),
        "convention",
        _SHOWN,
        names="scale_apply='update_lr_cast'",
    ),
    Planted(
        13,
        "muon-fsdp2 0.3.0",
        PlantedAdapter(EqualShardGather, "dtensor", DIST_FAMILIES),
        "crash",
        frozenset({"uneven", "empty"}),
        frozenset({"even", "remainder"}),
    ),
)
UNREACHABLE: dict[int, str] = {
    10: "PrimeIntellect/prime-rl #3490: a first-step all-to-all deadlock across nodes (EP8/CP4) until NCCL "
    "connections were warmed up. The check runs gloo ranks on one machine: no NCCL, no second node.",
}
# Each base conforms on every family of its kind (tests/test_planted.py): the planted defect is the only departure.
BASES: tuple[PlantedAdapter, ...] = (
    PlantedAdapter(SmallMuon, None, SINGLE_FAMILIES),
    PlantedAdapter(GatherMuon, "dtensor", DIST_FAMILIES),
    PlantedAdapter(RoundRobinMuon, "replicated", REPLICATED_FAMILIES),
    PlantedAdapter(ZeroMuon, "unreduced", UNREDUCED_FAMILIES - CHECKPOINT_FAMILIES),
)


def judge(planted: Planted, report: dict[str, Any]) -> dict[str, Any]:
    """Did the check catch the planted bug (some case departs), in which families and how, and is its diagnosis
    right: the expected kind (Planted.diagnosis), every caught_by family departing, every bitwise_on family bitwise."""
    outcomes, diagnosis = report["outcomes"], report["diagnosis"]
    by: dict[str, set[str]] = {}
    for o in outcomes:
        if o["status"] != "bitwise":
            by.setdefault(o["family"], set()).add(o["status"])
    expected_status = {"crash": "crash", "hang": "hang"}.get(planted.diagnosis)
    kind = {
        "bug": diagnosis.startswith("bug:"),
        "replicas": "replicas disagree on" in diagnosis,
        "convention": diagnosis.startswith("convention:") and planted.names in diagnosis,
        "crash": "crashes on" in diagnosis,
        "hang": "hangs on" in diagnosis,
    }[planted.diagnosis]
    wrong = [f"not {planted.diagnosis}"] if not kind else []
    wrong += [f"{f} did not depart" for f in sorted(planted.caught_by - set(by))]
    wrong += [
        f"{f} departed ({', '.join(sorted(by[f]))})" for f in sorted(planted.bitwise_on & set(by))
    ]
    if expected_status:
        wrong += [
            f"{f}: {', '.join(sorted(by[f]))}, not {expected_status}"
            for f in sorted(planted.caught_by & set(by))
            if by[f] != {expected_status}
        ]
    return {
        "field_bug": planted.field_bug,
        "source": planted.source,
        "optimizer": planted.adapter.name,
        "caught": bool(by),
        "by": {f: sorted(s) for f, s in sorted(by.items())},
        "right": not wrong,
        "wrong": wrong,
        "diagnosis": diagnosis,
    }
