"""Where a parameter's pieces live: its shard groups and the box of the global tensor that each member holds.

A DTensor's placements, applied in mesh-axis order, cut the tensor: Shard(d) on axis a splits the current piece's
dim d into mesh.size(a) chunks as torch.chunk does (a dim of size s gives chunks of ceil(s / n), trailing ones
empty: 5 rows on 4 ranks are 2, 2, 1, 0). Several axes may cut the same dim, left to right ((Shard(0), Shard(0))
on an (ep, fsdp) mesh: EP cuts the dim, FSDP each EP block), or different dims (Shard(0) on dp, Shard(1) on tp).
_StridedShard(d, split_factor=f) on an axis marks right-to-left sharding (FSDP2 over tensor parallelism): the
later axes that cut dim d (their sizes multiply to f) cut first, then this axis cuts each of their pieces. So every
member holds one box (a hyperrectangle: offsets and sizes per dim), and the boxes tile the tensor.

The shard group of a rank is the set of ranks that differ from it only along the axes that shard (in mesh order,
row-major): they hold disjoint boxes; the other (replicating) axes index the replicas, each its own group with the
same boxes. Everything here is a pure function of the layout, identical on every rank, computed once per layout.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from muon_ref.functional import Block, MatrixLayout


def chunk_bounds(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """(offset, length) of chunk `index` of a dim of `size` split as torch.chunk does (trailing chunks may be empty)."""
    chunk = math.ceil(size / num_chunks)
    offset = min(index * chunk, size)
    return offset, min(chunk, size - offset)


@dataclass(frozen=True)
class Box:
    """A hyperrectangle of a tensor's index space: offsets[d] <= i_d < offsets[d] + shape[d] along every dim."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def index(self) -> tuple[slice, ...]:
        """t[box.index] is the box's part of t."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.shape))

    def intersect(self, other: Box | Block) -> Box | None:
        """The common part of two boxes (None when it is empty)."""
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(
            min(a + s, b + t)
            for a, s, b, t in zip(self.offsets, self.shape, other.offsets, other.shape)
        )
        return (
            None
            if any(h <= low for low, h in zip(lo, hi))
            else Box(lo, tuple(h - low for low, h in zip(lo, hi)))
        )

    def within(self, outer: Box | Block) -> Box:
        """This box in the coordinates of `outer` (which contains it)."""
        return Box(tuple(o - p for o, p in zip(self.offsets, outer.offsets)), self.shape)


def whole(shape: Sequence[int]) -> Box:
    return Box((0,) * len(shape), tuple(shape))


def blocks_in(matrices: MatrixLayout, box: Box) -> MatrixLayout:
    """The layout of the whole blocks inside `box`, in the box's coordinates (the box holds whole blocks)."""
    if box.shape == matrices.shape:  # the whole param
        return matrices
    inside = [b for b in matrices.blocks if box.intersect(b) == Box(b.offsets, b.shape)]
    shifted = tuple(
        type(b)(tuple(o - q for o, q in zip(b.offsets, box.offsets)), b.shape, b.fan_out, b.fan_in)
        for b in inside
    )
    if matrices.separate:
        return MatrixLayout(len(shifted), None, None, shifted, separate=True)
    return MatrixLayout(len(shifted), matrices.fan_out, matrices.fan_in, shifted)


@dataclass(frozen=True)
class Geometry:
    """A parameter's shards: `groups` (every shard group of its mesh, each in member order; one group when no axis
    replicates), `boxes` (member j's box, the same in every group), the mesh axes that shard (`axes`) and the
    param's blocks (muon_ref's independent matrices). Invariants: all groups have len(boxes) members; the groups
    partition the mesh's ranks; the boxes tile global_shape when some axis shards, and are all the whole tensor
    when none does (every rank of the mesh is then one group holding a replica)."""

    global_shape: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    boxes: tuple[Box, ...]
    axes: tuple[int, ...]
    blocks: tuple[Block, ...]

    def __post_init__(self) -> None:
        assert all(len(g) == len(self.boxes) for g in self.groups), self
        if self.axes:
            assert sum(b.numel for b in self.boxes) == math.prod(self.global_shape), self
        else:
            assert all(b == whole(self.global_shape) for b in self.boxes), self

    @property
    def group_size(self) -> int:
        return len(self.boxes)

    @property
    def sharded(self) -> bool:
        return bool(self.axes)

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        """Elements of each member's box."""
        return tuple(b.numel for b in self.boxes)

    @functools.cached_property
    def _where(self) -> dict[int, tuple[tuple[int, ...], int]]:
        """rank -> (its shard group, its index there), for every rank of the mesh."""
        return {r: (g, j) for g in self.groups for j, r in enumerate(g)}

    def group_of(self, rank: int) -> tuple[int, ...]:
        return self._where[rank][0]

    def member(self, rank: int) -> int:
        """This rank's index in its shard group."""
        return self._where[rank][1]

    @functools.cached_property
    def components(self) -> tuple[tuple[int, ...], ...]:
        """The members joined wherever two hold pieces of the same block (member indices, ascending): each
        component's boxes hold whole blocks between them, so it can orthogonalise them without the others.
        Members with an empty box are components alone."""
        parent = list(range(self.group_size))

        def root(j: int) -> int:
            while parent[j] != j:
                j = parent[j]
            return j

        for block in self.blocks:
            holders = [j for j, box in enumerate(self.boxes) if box.numel and box.intersect(block)]
            for j in holders[1:]:
                parent[root(j)] = root(holders[0])
        found: dict[int, list[int]] = {}
        for j in range(self.group_size):
            found.setdefault(root(j), []).append(j)
        return tuple(tuple(c) for c in sorted(found.values()))

    def blocks_of(self, component: tuple[int, ...]) -> tuple[int, ...]:
        """Indices of the blocks that the component's members hold pieces of."""
        return tuple(
            i
            for i, block in enumerate(self.blocks)
            if any(self.boxes[j].numel and self.boxes[j].intersect(block) for j in component)
        )


def mesh_groups(mesh_ranks: Sequence, axes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The groups of global ranks that vary along `axes` of the mesh (all axes when empty), in mesh order."""
    import torch

    mesh = torch.tensor(mesh_ranks)
    axes = axes or tuple(range(mesh.ndim))
    rest = tuple(a for a in range(mesh.ndim) if a not in axes)
    rows = mesh.permute(*rest, *axes).reshape(-1, math.prod(mesh.shape[a] for a in axes))
    return tuple(tuple(row) for row in rows.tolist())


def parse_placement(code: str) -> tuple[str, int | None, int]:
    """("R", None, 1) | ("S", dim, 1) | ("S", dim, split_factor) for "R", "S<d>", "S<d>:<split_factor>"."""
    if code == "R":
        return "R", None, 1
    dim, _, factor = code[1:].partition(":")
    return "S", int(dim), int(factor or 1)


def boxes_of(
    global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[str, ...]
) -> tuple[Box, ...]:
    """Every shard-group member's box, in member order (module docstring). ValueError for a _StridedShard whose
    split factor is not the product of the later axes that shard its dim (no such sharding is derived here)."""
    parsed = [parse_placement(p) for p in placements]
    axes = tuple(a for a, (kind, _, _) in enumerate(parsed) if kind == "S")
    order = {}  # dim -> the axes that cut it, outermost first
    for dim in {parsed[a][1] for a in axes}:
        cutting = [a for a in axes if parsed[a][1] == dim]
        strided = [a for a in cutting if parsed[a][2] > 1]
        if strided:
            first, later = cutting[0], cutting[1:]
            if strided != [first] or parsed[first][2] != math.prod(mesh_shape[a] for a in later):
                raise ValueError(
                    f"placements {placements} on a mesh of shape {mesh_shape}: a _StridedShard must be "
                    f"the first axis to shard dim {dim}, with split_factor equal to the product of the "
                    f"later axes' sizes that shard it (FSDP2 over tensor parallelism)"
                )
            cutting = later + [first]  # right to left: the later axes cut first
        order[dim] = cutting
    sizes = [mesh_shape[a] for a in axes]
    out = []
    for j in range(math.prod(sizes)):
        coords = dict(zip(axes, _unravel(j, sizes)))
        offsets, shape = [0] * len(global_shape), list(global_shape)
        for dim, cutting in order.items():
            for a in cutting:
                inner, shape[dim] = chunk_bounds(shape[dim], mesh_shape[a], coords[a])
                offsets[dim] += inner
        out.append(Box(tuple(offsets), tuple(shape)))
    return tuple(out)


def _unravel(index: int, sizes: list[int]) -> list[int]:
    coords = []
    for size in reversed(sizes):
        index, c = divmod(index, size)
        coords.append(c)
    return coords[::-1]


@functools.lru_cache(maxsize=None)
def geometry(
    global_shape: tuple[int, ...],
    mesh_ranks: tuple,
    placements: tuple[str, ...],
    blocks: tuple[Block, ...],
) -> Geometry:
    """The Geometry of a param (cached: every call with the same layout returns the same object)."""
    import torch

    mesh_shape = tuple(torch.tensor(mesh_ranks).shape)
    axes = tuple(a for a, p in enumerate(placements) if p != "R")
    groups = mesh_groups(mesh_ranks, axes)
    boxes = (
        boxes_of(global_shape, mesh_shape, placements)
        if axes
        else (whole(global_shape),) * len(groups[0])
    )
    return Geometry(global_shape, groups, boxes, axes, blocks)
