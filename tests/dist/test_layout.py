"""ParamLayout read from real DTensors agrees with DTensor's own shard boxes (torch.chunk semantics)."""

from __future__ import annotations

import pytest

from .conftest import get_pool
from .workers import layouts_of_distributed


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "shape, placement", [((5, 3), "S0"), ((3, 5), "S1"), ((2, 9), "S0"), ((6, 6), "S1")]
)
@pytest.mark.parametrize("world_size, mesh", [(4, "fsdp"), (3, "fsdp"), (4, "hsdp"), (8, "hsdp")])
def test_layout_boxes_equal_dtensor_local_shapes_and_offsets(
    shape, placement, world_size, mesh
) -> None:
    for ours, torchs, local in get_pool(world_size).run(
        layouts_of_distributed, shape, placement, mesh, timeout=30
    ):
        assert ours == torchs and ours[0] == local, (ours, torchs, local)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "placement, kind, world_size, shape",
    [
        ("S0:2,S0", "tp2", 4, (11, 7)),  # FSDP2 over ColwiseParallel: _StridedShard, uneven
        ("S0:2,S0", "tp2", 8, (11, 7)),  # an empty box at dp rank 3
        ("S1:4,S1", "tp4", 4, (3, 13)),
        ("S0,S1", "tp2", 4, (5, 9)),  # FSDP2 over RowwiseParallel
        ("S0,S0", "tp2", 4, (11, 7)),  # left to right
        ("R,S0:2,S0", "grid2x2x2", 8, (7, 9)),  # HSDP over ColwiseParallel
        ("R,S0,S1", "grid2x2x2", 8, (7, 9)),
        ("S0,S1,S0", "grid2x2x2", 8, (13, 9)),
        ("S0:3,S0", "tp3", 9, (11, 1)),  # FSDP2's rows, not torch's computed shape (below)
    ],
)
def test_tensor_parallel_boxes_equal_dtensors_local_shards(
    placement: str, kind: str, world_size: int, shape: tuple[int, ...]
) -> None:
    """Each rank's local shard, as FSDP2 over tensor parallelism or distribute_tensor places it, is the fixtures'
    box of the full tensor and has the shape of read_layout's box; and that box is torch's
    compute_local_shape_and_global_offset's, except on (11, 1) over a 3 x 3 mesh with (_StridedShard(0, sf=3),
    Shard(0)): there torch 2.13's function gives row 10 to rank 6 (dp 2, tp 0) and nothing to rank 8, while
    FSDP2 places row 10 on rank 8, inside tp 2's rows 8-10 (read from the ranks' shards), as read_layout's boxes do
    (a torch whose function agrees passes too)."""
    from .workers import tp_layout_against_dtensor

    torch_departs = (placement, kind, shape) == ("S0:3,S0", "tp3", (11, 1))
    results = get_pool(world_size).run(
        tp_layout_against_dtensor, placement, kind, shape, timeout=60
    )
    for rank, (local_is_box, box_is_local, box_is_torchs) in enumerate(results):
        assert local_is_box and box_is_local, (rank, local_is_box, box_is_local)
        assert box_is_torchs or torch_departs, rank
