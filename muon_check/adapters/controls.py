"""Correct controls: Muons on DTensor Shard(0) params (FSDP2's layout), written here independently of muon_ref and
of muon_dist, one per way the field distributes Newton-Schulz. Each must conform to its claim (preset "torch") in
every family and dtype; `python -m muon_check --planted` runs them beside the planted bugs and
prints the false positives (a control called non-conforming) next to the misses (a planted bug not caught).

Every control does what an FSDP2 engine does, with torch's own ops on the rank's shard (the elementwise stages are
shard-local, as in every such engine: the check must name that rounding, never call it a bug), and torch.optim.Muon's
own Newton-Schulz (torch.optim._muon._zeropower_via_newtonschulz) on the whole matrices. Per param P with gradient
shard G_r, momentum shard M_r (torch.optim.Muon's equations, torch 2.9 and later):
    M_r <- lerp(M_r, G_r, 1 - mu);   D_r = lerp(G_r, M_r, mu) if nesterov else copy(M_r)           (shard-local)
    D   = the D_r reassembled in rank order (torch.chunk's boxes along dim 0)                   (style)
    O   = NS(D) per matrix (2-D: D; 3-D [E, m, n]: each D[e]; 4-D: D.reshape(out, -1)), made contiguous
    P_r <- P_r * (1 - lr * wd);   P_r <- P_r - lr * sqrt(max(1, m / n)) * box_r(O)             (shard-local)
Styles (how D reaches the Newton-Schulz and box_r(O) comes back):
    GatherControl      DTensor.full_tensor on every rank; each keeps its box (LlamaFactory v1, AReaL's PR)
    PaddedControl      every shard zero-padded to ceil(rows / W) rows, all_gather_into_tensor, trimmed
    AllToAllControl    param i owned by rank i mod W: one all_to_all_single sends the shards to the owners, the
                       owners orthogonalise, a second sends each rank its box (Dion, xtuner's AGRS peers)
    OwnerControl       param i owned by rank i mod W: gather of padded shards to the owner, scatter of the padded
                       boxes back (owner-compute, Megatron's layer-wise style)
Params step only where every rank has a gradient (flags all-reduced, MIN); the others keep their bits on every
rank (the oracle's "skip" answer to gradients missing on some ranks). The momentum buffer is a zero DTensor like
its param from construction on (torch.distributed.checkpoint saves it for every param).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..fixtures import gathers_through_c10d, whole
from . import Adapter
from .cases import DIST_FAMILIES, SINGLE_FAMILIES

# torch.optim.Muon's defaults (torch/optim/_muon.py): the coefficients of KellerJordan's quintic, 5 steps, eps
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _world(p: Tensor) -> tuple[int, int]:
    """(W, rank) of a DTensor's 1-D mesh; (1, 0) for a plain tensor."""
    if not hasattr(p, "device_mesh"):
        return 1, 0
    mesh = p.device_mesh
    return mesh.size(), mesh.get_local_rank()


def _matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    """(m, n) of each matrix of a param: 2-D as is, 3-D [E, m, n] per expert, 4-D conv as (out, in * kh * kw)."""
    return (shape[1], shape[2]) if len(shape) == 3 else (shape[0], math.prod(shape[1:]))


def newton_schulz(full: Tensor) -> Tensor:
    """torch.optim.Muon's Newton-Schulz on each matrix of `full` (module docstring), contiguous, full's shape."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    def ns(x: Tensor) -> Tensor:
        return _zeropower_via_newtonschulz(x, NS_COEFFICIENTS, NS_STEPS, EPS).contiguous()

    if full.ndim == 3:
        return torch.stack([ns(m) for m in full.unbind(0)])
    if full.ndim == 4:
        return ns(full.reshape(full.shape[0], -1)).reshape(full.shape)
    return ns(full)


def _rows(rows: int, W: int) -> list[tuple[int, int]]:
    """torch.chunk's row boxes [a, b) of each rank (empty past the last chunk)."""
    c = math.ceil(rows / W)
    return [(min(rows, k * c), min(rows, (k + 1) * c)) for k in range(W)]


def _padded(shard: Tensor, rows: int) -> Tensor:
    """The shard with zero rows appended up to `rows`."""
    out = shard.new_zeros((rows, *shard.shape[1:]))
    out[: shard.shape[0]] = shard
    return out


class ShardEngine(torch.optim.Optimizer):
    """The shared body of the controls (module docstring); a style implements `orthogonalized`."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
    ) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)

    def _stepping(self, params: list[Tensor]) -> list[bool]:
        """Which params step: those with a gradient on every rank (flags all-reduced with MIN)."""
        mine = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        if dist.is_initialized() and params and _world(params[0])[0] > 1:
            dist.all_reduce(mine, op=dist.ReduceOp.MIN)
        return [bool(f) for f in mine.tolist()]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        items = [(p, g) for g in self.param_groups for p in g["params"]]
        stepping = self._stepping([p for p, _ in items])
        work = []
        for (p, group), on in zip(items, stepping):
            if not on:
                continue
            grad, buf = _local(p.grad), _local(self.state[p]["momentum_buffer"])
            mu = group["momentum"]
            buf.lerp_(grad, 1 - mu)
            # a copy without Nesterov: torch's Newton-Schulz normalises its bf16 input in place (field bug 11)
            direction = grad.lerp(buf, mu) if group["nesterov"] else buf.clone()
            work.append((p, group, direction))
        boxes = self.orthogonalized([(p, d) for p, _, d in work])
        for (p, group, _), box in zip(work, boxes):
            m, n = _matrix(tuple(p.shape))
            lr = group["lr"]
            shard = _local(p)
            shard.mul_(1 - lr * group["weight_decay"])
            shard.add_(box, alpha=-(lr * math.sqrt(max(1, m / n))))

    def orthogonalized(self, work: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
        """For each (param, this rank's direction shard): this rank's box of NS(D), D the whole direction."""
        raise NotImplementedError


class GatherEngine(ShardEngine):
    """D = DTensor.full_tensor() of the direction shards on every rank; each rank keeps its box of NS(D). On gloo
    over CUDA tensors the same gather through c10d (muon_check.fixtures.whole: the same bits)."""

    def orthogonalized(self, work: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
        from torch.distributed.tensor import DTensor

        out = []
        for p, d in work:
            W, rank = _world(p)
            if W == 1:
                out.append(newton_schulz(d))
                continue
            D = DTensor.from_local(d, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            full = whole(D, "c10d") if gathers_through_c10d(D) else D.full_tensor()
            a, b = _rows(p.shape[0], W)[rank]
            out.append(newton_schulz(full)[a:b])
        return out


class PaddedEngine(ShardEngine):
    """Each shard padded to ceil(rows / W) rows, all_gather_into_tensor, the padding trimmed."""

    def orthogonalized(self, work: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
        out = []
        for p, d in work:
            W, rank = _world(p)
            if W == 1:
                out.append(newton_schulz(d))
                continue
            c = math.ceil(p.shape[0] / W)
            gathered = d.new_empty((W * c, *d.shape[1:]))
            dist.all_gather_into_tensor(gathered, _padded(d, c))
            a, b = _rows(p.shape[0], W)[rank]
            out.append(newton_schulz(gathered[: p.shape[0]])[a:b])
        return out


class AllToAllEngine(ShardEngine):
    """Param i is owned by rank i mod W: all_to_all_single to the owners, NS there, all_to_all_single back."""

    def orthogonalized(self, work: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
        if not work or _world(work[0][0])[0] == 1:
            return [newton_schulz(d) for _, d in work]
        W, rank = _world(work[0][0])
        per_row = [math.prod(p.shape[1:]) for p, _ in work]
        boxes = [_rows(p.shape[0], W) for p, _ in work]
        owned = [[i for i in range(len(work)) if i % W == r] for r in range(W)]
        # to the owners: my shard of every param, grouped by owner
        send = torch.cat([work[i][1].reshape(-1) for r in range(W) for i in owned[r]])
        send_sizes = [sum(work[i][1].numel() for i in owned[r]) for r in range(W)]
        recv_sizes = [
            sum((boxes[i][src][1] - boxes[i][src][0]) * per_row[i] for i in owned[rank])
            for src in range(W)
        ]
        recv = send.new_empty(sum(recv_sizes))
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes)
        pieces = iter(
            recv.split(
                [
                    (boxes[i][src][1] - boxes[i][src][0]) * per_row[i]
                    for src in range(W)
                    for i in owned[rank]
                ]
            )
        )
        parts: dict[int, list[Tensor]] = {i: [] for i in owned[rank]}
        for src in range(W):
            for i in owned[rank]:
                parts[i].append(next(pieces))
        results = {
            i: newton_schulz(torch.cat(parts[i]).reshape(work[i][0].shape)) for i in owned[rank]
        }
        # back: each rank's box of every param I own, grouped by rank
        dtype = next(iter(results.values())).dtype if results else torch.bfloat16
        back = [
            results[i][boxes[i][dst][0] : boxes[i][dst][1]].reshape(-1)
            for dst in range(W)
            for i in owned[rank]
        ]
        back_send = torch.cat(back) if back else recv.new_empty(0, dtype=dtype)
        back_sizes = [
            sum((boxes[i][dst][1] - boxes[i][dst][0]) * per_row[i] for i in owned[rank])
            for dst in range(W)
        ]
        mine = [(boxes[i][rank][1] - boxes[i][rank][0]) * per_row[i] for i in range(len(work))]
        got_sizes = [sum(mine[i] for i in owned[src]) for src in range(W)]
        got = back_send.new_empty(sum(got_sizes))
        dist.all_to_all_single(got, back_send.to(got.dtype), got_sizes, back_sizes)
        pieces = iter(got.split([mine[i] for src in range(W) for i in owned[src]]))
        out: dict[int, Tensor] = {}
        for src in range(W):
            for i in owned[src]:
                out[i] = next(pieces).reshape((-1, *work[i][0].shape[1:]))
        return [out[i] for i in range(len(work))]


class OwnerEngine(ShardEngine):
    """Param i is owned by rank i mod W: padded shards gathered to the owner, NS there, padded boxes scattered."""

    def orthogonalized(self, work: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
        out = []
        for i, (p, d) in enumerate(work):
            W, rank = _world(p)
            if W == 1:
                out.append(newton_schulz(d))
                continue
            owner, c, rows = i % W, math.ceil(p.shape[0] / W), p.shape[0]
            shard = _padded(d, c)
            gathered = [torch.empty_like(shard) for _ in range(W)] if rank == owner else None
            dist.gather(shard, gathered, dst=owner)
            box = torch.empty(shard.shape, dtype=torch.bfloat16, device=shard.device)
            scattered = None
            if rank == owner:
                result = newton_schulz(torch.cat(gathered)[:rows])
                scattered = [_padded(result[a:b], c) for a, b in _rows(rows, W)]
            dist.scatter(box, scattered, src=owner)
            a, b = _rows(rows, W)[rank]
            out.append(box[: b - a])
        return out


class _Control(Adapter):
    """A control's adapter: DTensor Shard(0) params, every single-device and dtensor family, preset torch."""

    preset = "torch"
    distributed = "dtensor"
    families = SINGLE_FAMILIES | DIST_FAMILIES
    engine: type[ShardEngine] = ShardEngine

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        return self.engine(params, **hp)


class GatherControl(_Control):
    name, engine = "control: gather (full_tensor)", GatherEngine


class PaddedControl(_Control):
    name, engine = "control: padded all-gather", PaddedEngine


class AllToAllControl(_Control):
    name, engine = "control: all-to-all", AllToAllEngine


class OwnerControl(_Control):
    name, engine = "control: owner-compute (gather/scatter)", OwnerEngine


CONTROLS: tuple[type[Adapter], ...] = (GatherControl, PaddedControl, AllToAllControl, OwnerControl)

__all__ = ["CONTROLS", "newton_schulz"]
