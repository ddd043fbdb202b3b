"""Planted bugs: for each class of docs/field-bugs.md that a check can reach, a small Muon written
here with exactly that defect, behind an adapter; `python -m muon_check --planted` runs them all
and says which the check caught, by which families, and whether its diagnosis is the right one.

Four small correct Muons carry the defects, one per way a candidate sees its parameters; each is muon_ref's three
stages (muon_ref.functional: momentum_direction, orthogonalize, apply_update) on whole tensors, so each is bitwise
muon_ref.Muon, and each conforms on every family of its mode (BASES; tests/test_planted_cases.py checks each where the
planted bugs built on it are caught). A planted bug is one of them with one method changed:
    SmallMuon        single device
    GatherMuon       DTensor Shard(0): every rank gathers each param whole (DTensor.full_tensor) and keeps its box
    RoundRobinMuon   replicated, DDP style: KellerJordan's batches of W params, one owner per param, all-gathered
    ZeroMuon         unreduced, ZeRO-1/2 style: gradients reduce-scattered over W flat partitions
Where a field bug is a race or depends on hardware, the planted defect is its deterministic limit, said so in its
docstring. Unreachable here, each with its reason: bugs 10, 19, 20, 21, 22 and 27 (UNREACHABLE). The classes about
the setup around the optimizer (a routing, a path, a layout) are planted as training setups instead
(adapters/planted_setups.py: PLANTED_SETUPS, caught by the setup audit and the invariance families).
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

from ..fixtures import chunk, gathers_through_c10d, local, whole
from . import Adapter
from .cases import (
    CHECKPOINT_FAMILIES,
    DIST_FAMILIES,
    FUSED_DIST_FAMILIES,
    REPLICATED_FAMILIES,
    SINGLE_FAMILIES,
    UNREDUCED_FAMILIES,
)


def _groups(params: list[Tensor]) -> list[dict[str, Any]]:
    """One group per param; 4-D conv weights read as (out, -1) matrices (flatten=True), as the oracle reads them."""
    return [{"params": [p], "flatten": p.ndim >= 4} for p in params]


def _layout(p: Tensor, group: dict[str, Any]) -> MatrixLayout:
    """The param's matrices as muon_ref reads them (the global shape: a DTensor's, not its box's)."""
    return matrix_layout(
        tuple(p.shape), num_experts=group.get("num_experts"), flatten=group["flatten"]
    )


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


class ExpertAxisNewtonSchulz(SmallMuon):
    """Field bug 14, AI-Hypercomputer/maxtext #4798 and #4843: Newton-Schulz ran across the expert axis of an
    expert stack instead of on each expert's matrix. Here: a 3-D [E, m, n] direction is orthogonalised as one
    (E * m, n) matrix (its experts stacked along the rows), everything else as muon_ref reads it; the lr scale
    stays the per-expert one."""

    def orthogonalized(self, direction: Tensor, layout: MatrixLayout, cfg: MuonConfig) -> Tensor:
        if direction.ndim != 3:
            return super().orthogonalized(direction, layout, cfg)
        stacked = direction.reshape(-1, direction.shape[-1])
        return orthogonalize(stacked, matrix_layout(tuple(stacked.shape)), cfg).reshape(
            direction.shape
        )


# ---------------------------------------------------------------- DTensor Shard(0)


class GatherMuon(torch.optim.Optimizer):
    """A correct Muon on DTensor Shard(0) params (plain tensors: one rank): for each param that steps, every rank
    gathers the whole gradient, momentum and param, runs SmallMuon's stages on them, and keeps its box:
        P'_r = box_r(apply_update(P, orthogonalize(D)))   with M', D = momentum_direction(G, M), all whole tensors
    bitwise muon_ref.Muon (the same functions on the same tensors; box_r is torch.chunk's). Which params step:
    agreed_gradients. Momentum: a buffer like its param for every param from construction on, so every rank holds
    the same state keys and torch.distributed.checkpoint can save them (Dion #89). A step counter per param, a
    float32 scalar tensor under the key "step" (as torch.optim.Adam keeps it: torch.optim.Optimizer.load_state_dict
    casts every floating-point state tensor to its param's dtype except the one under "step"); nothing reads it,
    and the resume_long family checks that a save and load keep it."""

    counter_key = "step"

    def __init__(self, params: Any, preset: str | None = "torch", **overrides: Any) -> None:
        super().__init__(params, preset_defaults(preset, overrides))
        for group in self.param_groups:
            for p in group["params"]:
                self.initial_state(p)

    def initial_state(self, p: Tensor) -> None:
        """A zero momentum buffer like p (a DTensor for a DTensor) and a zero step counter, at construction."""
        self.state[p]["momentum_buffer"] = torch.zeros_like(p)
        self.state[p][self.counter_key] = torch.tensor(0.0)

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
            P, self.orthogonalized(direction, layout, cfg, p), self.scale_layout(p, layout), cfg
        )
        self.landed(p, new)
        local(state).copy_(self._box(new_buf, p))
        count = self.state[p].get(self.counter_key, torch.tensor(0.0))
        self.state[p][self.counter_key] = count + 1

    def landed(self, p: Tensor, new: Tensor) -> None:
        """This rank's box of the whole new param into p's local tensor."""
        local(p).copy_(self._box(new, p))

    def orthogonalized(
        self, direction: Tensor, layout: MatrixLayout, cfg: MuonConfig, p: Tensor
    ) -> Tensor:
        """O = orthogonalize(D) on the whole direction, read with the param's own layout."""
        return orthogonalize(direction, layout, cfg)

    def gathered(self, t: Tensor) -> Tensor:
        """The whole tensor of a DTensor (DTensor.full_tensor: an all-gather, exact for any boxes; through c10d on
        gloo over CUDA tensors, muon_check.fixtures.whole), or t."""
        if gathers_through_c10d(t):
            return whole(t, "c10d")
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


class NestedStateDict(GatherMuon):
    """Field bug 16, ByteDance VeOmni #1008 (and microsoft/dion #109): a composite optimizer (Muon + AdamW
    sub-optimizers behind one torch.optim.Optimizer) hands out its own merged state dict, not one optimizer's
    {"state", "param_groups"}; torch.distributed.checkpoint.state_dict's get_optimizer_state_dict, which reads
    the latter, fails on the first save. Here: the state dict of its one sub-optimizer keyed by its name, as a
    composite's own state dict nests it."""

    def state_dict(self) -> dict[str, Any]:
        return {"muon": super().state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict["muon"])


class PrefixedStateKeys(GatherMuon):
    """Field bug 17, NVIDIA-NeMo/RL #3345 (and the reviews of InternLM/xtuner #2018): a composite optimizer saved
    its sub-optimizers' state under prefixed keys and loaded it without strictness, so the optimizer found none of
    its own keys after a resume and started from fresh state, silently. Here: the state dict names every state
    entry "muon.<key>"; the load installs those names as they are, so the step after a resume finds no
    "momentum_buffer" and starts from a zero buffer (the prefixed ones lie unread)."""

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["state"] = {
            i: {f"muon.{k}": v for k, v in entries.items()} for i, entries in out["state"].items()
        }
        return out


class RecastStepCounter(GatherMuon):
    """Field bug 18, microsoft/dion #104 (and deepspeedai/DeepSpeed #7746): state recast on load. A step counter
    kept as a floating-point tensor under a key other than "step" is cast to the param's dtype by
    torch.optim.Optimizer.load_state_dict (torch/optim/optimizer.py, _process_value_according_to_param_policy
    exempts only "step"): with bf16 params a counter saved at 257 loads as 256, and 256 + 1 rounds back to 256.
    Here: GatherMuon's counter under the key "count"; nothing reads it, so only resume_long's state comparison
    shows it (bf16 only)."""

    counter_key = "count"


class ExpertSlabNewtonSchulz(GatherMuon):
    """Field bug 23, PaddlePaddle/PaddleFleet #1703, #1704 and InternLM/xtuner #1582: expert parallelism sharded a
    dimension that is not the expert one, and each rank ran Newton-Schulz on what it held as if it were whole
    experts, so NS saw slabs of experts. Here, on xtuner's fused layout [E * m, n] (param-group key num_experts):
    each rank's torch.chunk box is read as whole experts of m rows from its first row; where a box boundary falls
    inside an expert (fused_sharded), NS runs on the slabs on either side of it. With boxes on expert boundaries
    it is muon_ref exactly."""

    def orthogonalized(
        self, direction: Tensor, layout: MatrixLayout, cfg: MuonConfig, p: Tensor
    ) -> Tensor:
        if layout.num_matrices == 1 or direction.ndim != 2 or not hasattr(p, "device_mesh"):
            return super().orthogonalized(direction, layout, cfg, p)
        rows, m, W = direction.shape[0], layout.fan_out, p.device_mesh.size()
        c, out = math.ceil(rows / W), torch.empty_like(direction)
        for a in range(0, rows, c):
            for lo in range(a, min(a + c, rows), m):
                hi = min(lo + m, a + c, rows)
                slab = direction[lo:hi]
                out[lo:hi] = orthogonalize(slab, matrix_layout(tuple(slab.shape)), cfg)
        return out


class PaddingEntersNewtonSchulz(GatherMuon):
    """Field bug 24, NVIDIA/Megatron-LM #6740: under tensor parallelism, the zero rows that pad a shard to an
    alignment were not stripped before Newton-Schulz, which then orthogonalised the padded matrix. Zero rows leave
    X X^T's nonzero block alone, but they can flip the choice of the side to iterate on (a matrix with more rows
    than columns is transposed first) and change the operands' shapes. Here: the direction is padded with zero rows
    to a multiple of the mesh size (an even split), orthogonalised, and trimmed."""

    def orthogonalized(
        self, direction: Tensor, layout: MatrixLayout, cfg: MuonConfig, p: Tensor
    ) -> Tensor:
        W = p.device_mesh.size() if hasattr(p, "device_mesh") else 1
        rows = math.ceil(direction.shape[0] / W) * W
        if rows == direction.shape[0] or direction.ndim != 2:
            return super().orthogonalized(direction, layout, cfg, p)
        padded = direction.new_zeros((rows, *direction.shape[1:]))
        padded[: direction.shape[0]] = direction
        return orthogonalize(padded, matrix_layout(tuple(padded.shape)), cfg)[: direction.shape[0]]


class ReplicatedInPlaceUpdate(GatherMuon):
    """Field bug 25, vllm-project/speculators #821: torch.optim.Muon on FSDP2 params crashed at the first step on
    a [1, N] weight (nn.Linear(dim, 1)): its in-place update of a Shard(0) DTensor needs a placement change that
    DTensor refuses ("in-place operations that require placement changes are not supported") when dim 0 is
    shorter than the mesh. Here: the whole new param, computed as GatherMuon computes it, lands through an
    in-place DTensor op, p.copy_(a Replicate DTensor of it) (bitwise where DTensor accepts it: measured with
    torch 2.13, which refuses it for every param with fewer rows than ranks). Whether a torch refuses it is
    measured where the suite runs (dtensor_refuses_a_placement_change): torch 2.11's DTensor accepts the copy and
    lands the right bits, so there the bug is absent and this Muon is a correct one."""

    def landed(self, p: Tensor, new: Tensor) -> None:
        if not hasattr(p, "device_mesh"):
            return super().landed(p, new)
        from torch.distributed.tensor import DTensor, Replicate

        p.copy_(DTensor.from_local(new, p.device_mesh, [Replicate()], run_check=False))


def dtensor_refuses_a_placement_change(device: str) -> str | None:
    """The trigger of field bug 25, measured on a rank of a world of 2 or more: None when this torch's DTensor
    refuses an in-place copy of a Replicate DTensor into a Shard(0) param with fewer rows than ranks (the crash of
    vllm-project/speculators #821); else why the bug is absent with this torch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(device, (dist.get_world_size(),))
    p = distribute_tensor(torch.zeros(1, 4, device=device), mesh, [Shard(0)])
    new = torch.ones(1, 4, device=device)
    try:
        p.copy_(DTensor.from_local(new, mesh, [Replicate()], run_check=False))
    except RuntimeError:
        return None
    return (
        f"torch {torch.__version__}'s DTensor accepts the in-place copy that changes a [1, N] Shard(0) param's "
        "placement, so the crash cannot occur"
    )


class GlobalShapeFromLocal(GatherMuon):
    """Field bug 26, pytorch/torchtitan #4593 (and NVIDIA/Megatron-LM #5786): the global shape was rebuilt from a
    rank's local shard (its rows times the mesh size, as if every shard were equal), which is wrong for uneven
    shards. Here: the whole tensor is gathered through DTensor.from_local without its global shape and stride, so
    DTensor infers them from this rank's box."""

    def gathered(self, t: Tensor) -> Tensor:
        if not hasattr(t, "device_mesh"):
            return t
        from torch.distributed.tensor import DTensor

        inferred = DTensor.from_local(local(t), t.device_mesh, t.placements)
        return whole(inferred, "c10d") if gathers_through_c10d(t) else inferred.full_tensor()


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
    "hang", "replicas" (replicas disagree), "resume" (a bug, and the optimizer state right after a load differs
    from the state at the save) or "lazy state" (resume fails: the load crashes on state a param that never
    stepped does not have). caught_by: families in which it must depart; bitwise_on: families
    that must stay bitwise (the diagnosis' controls: the defect shows nowhere else). trigger: for a bug that only
    some torch versions have, trigger(device) runs on every rank of a pool of world_sizes[0] ranks and returns
    None where this torch has the bug's cause, else why not: the bug is then absent, and the Muon under it, a
    correct one there, must conform (planted_verdict)."""

    field_bug: int
    source: str
    adapter: PlantedAdapter
    diagnosis: str
    caught_by: frozenset[str]
    bitwise_on: frozenset[str] = frozenset()
    world_sizes: tuple[int, ...] = (2,)
    names: str = ""
    trigger: Callable[[str], str | None] | None = None


_SHOWN = frozenset({"tall", "square", "experts3d"})  # single-device families that must stay bitwise
PLANTED: tuple[Planted, ...] = (
    Planted(
        1,
        "microsoft/dion #74",
        PlantedAdapter(EmptyBoxSkipsItsParam, "dtensor", DIST_FAMILIES),
        "hang",
        frozenset({"empty", "row_sharded"}),  # row_sharded's [1, N] params: empty boxes at W >= 2
        DIST_FAMILIES - {"empty", "row_sharded"},
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
        "lazy state",
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
    Planted(
        14,
        "AI-Hypercomputer/maxtext #4798",
        PlantedAdapter(ExpertAxisNewtonSchulz, None, SINGLE_FAMILIES),
        "bug",
        frozenset({"experts3d"}),
        SINGLE_FAMILIES - {"experts3d"},
    ),
    Planted(
        16,
        "ByteDance VeOmni #1008",
        PlantedAdapter(NestedStateDict, "dtensor", DIST_FAMILIES),
        "crash",
        CHECKPOINT_FAMILIES,
        DIST_FAMILIES - CHECKPOINT_FAMILIES,
    ),
    Planted(
        17,
        "NVIDIA-NeMo/RL #3345",
        PlantedAdapter(PrefixedStateKeys, "dtensor", DIST_FAMILIES),
        "bug",
        CHECKPOINT_FAMILIES,
        DIST_FAMILIES - CHECKPOINT_FAMILIES,
    ),
    Planted(
        18,
        "microsoft/dion #104",
        PlantedAdapter(RecastStepCounter, "dtensor", DIST_FAMILIES, dtypes=("float32", "bfloat16")),
        "resume",
        frozenset({"resume_long"}),
        DIST_FAMILIES - {"resume_long"},
    ),
    Planted(
        23,
        "PaddlePaddle/PaddleFleet #1703",
        PlantedAdapter(ExpertSlabNewtonSchulz, "dtensor", DIST_FAMILIES | FUSED_DIST_FAMILIES),
        "bug",
        FUSED_DIST_FAMILIES,
        DIST_FAMILIES,
    ),
    Planted(
        24,
        "NVIDIA/Megatron-LM #6740",
        PlantedAdapter(PaddingEntersNewtonSchulz, "dtensor", DIST_FAMILIES),
        "bug",
        frozenset({"uneven"}),
        frozenset({"even", "remainder", "experts", "row_sharded"}),
    ),
    Planted(
        25,
        "vllm-project/speculators #821",
        PlantedAdapter(ReplicatedInPlaceUpdate, "dtensor", DIST_FAMILIES),
        "crash",
        frozenset({"row_sharded", "empty"}),
        DIST_FAMILIES - {"row_sharded", "empty"},
        trigger=dtensor_refuses_a_placement_change,
    ),
    Planted(
        26,
        "pytorch/torchtitan #4593",
        PlantedAdapter(GlobalShapeFromLocal, "dtensor", DIST_FAMILIES),
        "crash",
        frozenset({"uneven"}),
        frozenset({"even", "remainder"}),
    ),
)
UNREACHABLE: dict[int, str] = {
    10: "PrimeIntellect/prime-rl #3490: a first-step all-to-all deadlock across nodes (EP8/CP4) until NCCL "
    "connections were warmed up. The check runs gloo ranks on one machine: no NCCL, no second node.",
    19: "microsoft/dion #108, #107: CUDA-graph capture (params without a gradient at capture never update again; "
    "captured NCCL collectives hang at teardown). The check runs eager steps on gloo ranks on CPU: no CUDA "
    "graphs, no NCCL.",
    20: "microsoft/dion #102, NVIDIA-NeMo/Emerging-Optimizers #245: GPU kernel indexing (an int32 batch offset "
    "overflowing on large stacks; a TMA stride assert on narrow matrices). The check runs gloo ranks on CPU, "
    "where no such kernel runs; tests/gpu/test_field_bugs_gpu.py runs this repository's Triton kernel on both "
    "inputs.",
    21: "microsoft/dion #58, #100, Dao-AILab/gram-newton-schulz PR 22: autotuner NaNs, out of memory when every "
    "rank autotunes on one device, memory growth over a run. The check runs short runs on gloo ranks on CPU, "
    "with no autotuner; tests/gpu/test_field_bugs_gpu.py checks this repository's autotuned kernel for "
    "NaNs and for memory growth over repeated calls.",
    22: "InternLM/xtuner #1987: the AGRS remainder path holds O(R x matrix) memory per rank. The bits are "
    "right, and the check compares bits on gloo ranks on CPU, where it measures no allocations: a per-rank "
    "peak-memory measurement (torch.cuda.max_memory_allocated on a GPU) against the remainder count would.",
    27: "InternLM/xtuner #2047: gradient clipping over the AdamW groups only. The clipping is the trainer's "
    "code, before the optimizer step; the check builds and steps the optimizer alone on gloo ranks, so "
    "it never runs a trainer's clipping.",
}
# Each base conforms on every family of its kind (tests/test_planted_cases.py): the planted defect is the only departure.
BASES: tuple[PlantedAdapter, ...] = (
    PlantedAdapter(SmallMuon, None, SINGLE_FAMILIES),
    PlantedAdapter(GatherMuon, "dtensor", DIST_FAMILIES | FUSED_DIST_FAMILIES),
    PlantedAdapter(RoundRobinMuon, "replicated", REPLICATED_FAMILIES),
    PlantedAdapter(ZeroMuon, "unreduced", UNREDUCED_FAMILIES - CHECKPOINT_FAMILIES),
)


def planted_verdict(planted: Planted, report: dict[str, Any], absent: str | None) -> dict[str, Any]:
    """The suite's verdict on one planted bug: judge's where the bug is present; where it is absent with this torch
    (`absent`: its trigger's reason), whether the Muon under it conforms, as a correct Muon must ("right")."""
    if absent is None:
        return judge(planted, report)
    return {
        "field_bug": planted.field_bug,
        "source": planted.source,
        "optimizer": planted.adapter.name,
        "absent": absent,
        "conforms": report["conforms"],
        "right": bool(report["conforms"]),
        "diagnosis": report["diagnosis"],
    }


def judge(planted: Planted, report: dict[str, Any]) -> dict[str, Any]:
    """Did the check catch the planted bug (some case departs), in which families and how, and is its diagnosis
    right: the expected kind (Planted.diagnosis), every caught_by family departing, every bitwise_on family bitwise.
    Where it is not, `wrong` says why; a bitwise_on family that crashed or hung carries its first case's message."""
    outcomes, diagnosis = report["outcomes"], report["diagnosis"]
    by: dict[str, set[str]] = {}
    # the first crash's or hang's message per family, for a wrong diagnosis's line
    errors: dict[str, str] = {}
    for o in outcomes:
        if o["status"] != "bitwise":
            by.setdefault(o["family"], set()).add(o["status"])
        if o["status"] in ("crash", "hang") and o.get("error"):
            errors.setdefault(o["family"], " ".join(str(o["error"]).split())[:240])
    expected_status = {"crash": "crash", "hang": "hang", "lazy state": "crash"}.get(
        planted.diagnosis
    )
    kind = {
        "bug": diagnosis.startswith("bug:"),
        "replicas": "replicas disagree on" in diagnosis,
        "convention": diagnosis.startswith("convention:") and planted.names in diagnosis,
        "crash": "crashes on" in diagnosis,
        "hang": "hangs on" in diagnosis,
        "lazy state": diagnosis.startswith("resume fails (state created lazily"),
        "resume": diagnosis.startswith("bug:")
        and "the resume changes the optimizer state on" in diagnosis,
    }[planted.diagnosis]
    wrong = [f"not {planted.diagnosis}"] if not kind else []
    wrong += [f"{f} did not depart" for f in sorted(planted.caught_by - set(by))]
    wrong += [
        f"{f} departed ({', '.join(sorted(by[f]))}{': ' + errors[f] if f in errors else ''})"
        for f in sorted(planted.bitwise_on & set(by))
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
