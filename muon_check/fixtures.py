"""Fixtures shared by the harness (verify, conformance), the benchmarks and the tests: seeded full tensors, meshes
by kind, the box of a full tensor that a rank holds, DTensors built from full tensors, bit patterns, and a
counter of the Newton-Schulz FLOPs a DistributedMuon's kernels run.

The boxes are computed here from torch.chunk alone, independently of muon_dist's layout code, so that comparing a
rank's shard with `box_of(reference, ...)` checks muon_dist against DTensor's semantics, not against itself.

Mesh kinds (W ranks): "fsdp" (1-D), "hsdp" (replicate 2 x fsdp W/2), "ep<k>" (ep k x fsdp W/k; "ep" is "ep2"),
"tp<k>" (dp W/k x tp k), "grid<r>x<s>x<t>" (replicate r x shard s x tp t: HSDP over tensor parallelism).
Placements: "plain" (a plain tensor, the same on every rank), "R" (Replicate), "S<d>" (Shard(d) on the mesh's last
axis, Replicate on the others; on ep meshes Shard(d) on both axes: EP chunks the dim, FSDP chunks each EP block),
or one code per mesh axis joined by commas ("S0,S1": Shard(0) on axis 0, Shard(1) on axis 1; DTensor applies
them left to right, each chunking the current piece). "S<d>:<f>" is _StridedShard(d, split_factor=f), FSDP2's
placement over a tensor-parallel Shard(d): the later axes that cut dim d (sizes multiplying to f) cut first and
this axis cuts each of their pieces (torch.distributed.tensor.placement_types._StridedShard's docstring).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

_MESHES: dict[tuple[str, int, str], Any] = {}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def seeded(
    shape: tuple[int, ...], seed: int, dtype: str | torch.dtype = "float32", device: str = "cpu"
) -> Tensor:
    """torch.randn(shape) from a generator seeded with `seed`, drawn on the CPU (the same bits on every rank and
    device), then cast to `dtype` and moved to `device`."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def bits(t: Tensor) -> Tensor:
    """The bit patterns of t as integers (torch.equal says -0.0 == +0.0; bits do not)."""
    return t.view(_INT_VIEW[t.element_size()])


def same_bits(a: Tensor, b: Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b.contiguous()))


def chunk(full: Tensor, dim: int, index: int, parts: int) -> Tensor:
    """torch.chunk's chunk `index` of `parts` along `dim` (empty past the last chunk): DTensor's Shard, a copy."""
    chunks = full.chunk(parts, dim)
    return (
        chunks[index].clone()
        if index < len(chunks)
        else full.narrow(dim, full.size(dim), 0).clone()
    )


def mesh_shape(kind: str, world_size: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(shape, axis names) of a mesh kind on world_size ranks."""
    if kind == "fsdp":
        return (world_size,), ("fsdp",)
    if kind == "hsdp":
        return (2, world_size // 2), ("replicate", "fsdp")
    if kind.startswith("ep"):
        ep = int(kind[2:] or 2)
        return (ep, world_size // ep), ("ep", "fsdp")
    if kind.startswith("tp"):
        tp = int(kind[2:])
        return (world_size // tp, tp), ("dp", "tp")
    if kind.startswith("grid"):
        shape = tuple(int(n) for n in kind[4:].split("x"))
        if math.prod(shape) != world_size:
            raise ValueError(f"mesh kind {kind!r} has {math.prod(shape)} ranks, not {world_size}")
        return shape, ("replicate", "shard", "tp")
    raise ValueError(f"unknown mesh kind {kind!r}")


def device_mesh(kind: str, device: str = "cpu") -> Any:
    """The DeviceMesh of a kind over the default group, made once per process (a collective: every rank calls)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    key = (kind, dist.get_world_size(), device)
    if key not in _MESHES:
        shape, names = mesh_shape(kind, dist.get_world_size())
        _MESHES[key] = init_device_mesh(device, shape, mesh_dim_names=names)
    return _MESHES[key]


def axis_codes(placement: str, kind: str, world_size: int) -> tuple[str, ...]:
    """One code per mesh axis ("R" or "S<d>") of a placement on a mesh of the kind."""
    shape, _ = mesh_shape(kind, world_size)
    if "," in placement:
        codes = tuple(placement.split(","))
        if len(codes) != len(shape):
            raise ValueError(
                f"placement {placement!r} has {len(codes)} codes for a {len(shape)}-D mesh {kind!r}"
            )
        return codes
    if placement in ("plain", "R"):
        return ("R",) * len(shape)
    if kind.startswith("ep"):
        return (placement,) * len(shape)
    return ("R",) * (len(shape) - 1) + (placement,)


def box_of(full: Tensor, placement: str, kind: str, rank: int, world_size: int) -> Tensor:
    """What `rank` holds of `full` under the placement on a mesh of the kind (computed without a mesh: each
    axis's Shard chunks the current piece, left to right; rank = the row-major index of its mesh coordinates)."""
    shape, _ = mesh_shape(kind, world_size)
    coords, rest = [], rank
    for size in reversed(shape):
        rest, c = divmod(rest, size)
        coords.append(c)
    coords.reverse()
    codes = axis_codes(placement, kind, world_size)
    order = [a for a, code in enumerate(codes) if code != "R"]
    for a in [
        a for a in order if ":" in codes[a]
    ]:  # right to left: the later axes on its dim cut first
        later = [b for b in order if b > a and codes[b].split(":")[0] == codes[a].split(":")[0]]
        order = [b for b in order if b != a]
        order.insert(order.index(later[-1]) + 1, a)
    piece = full
    for a in order:
        piece = chunk(piece, int(codes[a][1:].split(":")[0]), coords[a], shape[a])
    return piece


def distribute(full: Tensor, placement: str, kind: str, device: str = "cpu") -> Tensor:
    """This rank's view of `full`: a copy for "plain", else a DTensor holding box_of(full) (as FSDP2 holds it)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    full = full.to(device)
    if placement == "plain":
        return full.clone()
    dm = device_mesh(kind, device)
    box = box_of(full, placement, kind, dist.get_rank(), dist.get_world_size()).clone()
    placements = [placement_of(code) for code in axis_codes(placement, kind, dist.get_world_size())]
    return DTensor.from_local(box, dm, placements, shape=full.shape, stride=full.stride())


def placement_of(code: str) -> Any:
    """The DTensor placement of a code: "R", "S<d>" or "S<d>:<f>" (_StridedShard)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if code == "R":
        return Replicate()
    dim, _, factor = code[1:].partition(":")
    return _StridedShard(int(dim), split_factor=int(factor)) if factor else Shard(int(dim))


def local(t: Tensor) -> Tensor:
    """A DTensor's local shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def gathers_through_c10d(t: Tensor) -> bool:
    """Whether `whole` gathers t with c10d's all_gather_into_tensor rather than DTensor.full_tensor: for DTensors of
    CUDA tensors on a gloo group. There torch's functional collectives, which full_tensor and redistribute go
    through, killed both ranks with SIGSEGV on torch 2.11.0+cu130 (an H200, even and uneven Shard(0), docs/gpu.md),
    while c10d's all_gather_into_tensor, all_gather and all_to_all_single ran on the same tensors."""
    if not hasattr(t, "device_mesh") or t.device.type != "cuda":
        return False
    import torch.distributed as dist

    return dist.get_backend(t.device_mesh.get_group()) == "gloo"


def whole(t: Tensor, through: str = "c10d") -> Tensor:
    """The whole tensor of a DTensor (every rank gets it), or t itself. through: "c10d", or "full_tensor"
    (DTensor.full_tensor, to compare with). The "c10d" gather does what DTensor's Shard(0) does, from the DTensor's
    own (logical) shape: each shard zero-padded to ceil(rows / W) rows when W does not divide rows, one
    all_gather_into_tensor on the mesh's group, then its first `rows` rows. Callers use it where
    gathers_through_c10d(t) and call full_tensor themselves elsewhere (so that a hang's report names their line).
    Contract: the same bits as full_tensor (a gather copies; tests/dist/test_whole.py). Where ranks disagree on the
    shape (a DTensor made with a global shape inferred from one rank's shard), the gather's sizes are those
    full_tensor's would be, by construction (not run in the tests: such a gather hangs on gloo).
    Layouts: a 1-D mesh with Shard(0) or Replicate; others raise ValueError on every rank (before any collective)."""
    if not hasattr(t, "device_mesh"):
        return t
    if through == "full_tensor":
        return t.full_tensor()
    if through != "c10d":
        raise ValueError(f"whole(): through={through!r}; valid: 'c10d', 'full_tensor'")
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = t.device_mesh, tuple(t.placements)
    if placements == (Replicate(),):
        return t.to_local()
    if mesh.ndim != 1 or placements != (Shard(0),):
        raise ValueError(
            f"whole(): placements={placements} on a {mesh.ndim}-D mesh; the c10d gather takes "
            "(Shard(0),) or (Replicate(),) on a 1-D mesh"
        )
    out, rows = padded_gather(t), t.shape[0]
    if out.shape[0] < rows:
        raise RuntimeError(f"whole(): gathered {out.shape[0]} rows of a DTensor of {rows}")
    return out[:rows].contiguous()


def padded_gather(t: Tensor) -> Tensor:
    """whole()'s c10d gather of a Shard(0) DTensor on a 1-D mesh before its rows are cut: every rank's shard,
    zero-padded to ceil(rows / W) rows where W does not divide rows (DTensor's pad_tensor: F.pad of dim 0), in rank
    order, from one all_gather_into_tensor on the mesh's group."""
    import torch.distributed as dist

    mesh, piece = t.device_mesh, t.to_local()
    parts, rows = mesh.size(), t.shape[0]
    if rows % parts:
        pad = [0, 0] * (piece.ndim - 1) + [0, -(-rows // parts) - piece.shape[0]]
        piece = torch.nn.functional.pad(piece, pad)
    piece = piece.contiguous()
    out = piece.new_empty((parts * piece.shape[0], *piece.shape[1:]))
    dist.all_gather_into_tensor(out, piece, group=mesh.get_group())
    return out


def count_kernel_flops(opt: Any) -> list[int]:
    """Replace a DistributedMuon's backend by one that adds the Newton-Schulz FLOPs of every matrix it orthogonalises
    (muon_dist.balance.ns_flops, 5 steps) to the returned one-element list, then runs the real one: the figure
    muon_dist.expected_flops predicts for a step. Both kernels are counted (muon_dist.kernels.with_kernels): a
    call's blocks through orthogonalize, each matrix of a stack [k, fan_out, fan_in] through the stack kernel,
    where the backend stacks calls (orthogonalize_many)."""
    from muon_dist.balance import ns_flops
    from muon_dist.kernels import with_kernels

    count = [0]

    def counted(kernel: Any) -> Any:
        def run(x: Tensor, *rest: Any) -> Tensor:
            if len(rest) == 2:  # orthogonalize(direction, layout, cfg)
                count[0] += sum(ns_flops(b.fan_out, b.fan_in) for b in rest[0].blocks)
            else:  # stack(stack, cfg)
                count[0] += x.shape[0] * ns_flops(*x.shape[1:])
            return kernel(x, *rest)

        return run

    opt.backend = with_kernels(opt.backend, counted)
    return count
