"""ParamLayout read from real DTensors agrees with DTensor's own shard boxes (torch.chunk semantics)."""

from __future__ import annotations

import pytest

from .conftest import get_pool
from .workers import layouts_of_distributed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape, placement", [((5, 3), "S0"), ((3, 5), "S1"), ((2, 9), "S0"), ((6, 6), "S1")])
@pytest.mark.parametrize("world_size, mesh", [(4, "fsdp"), (3, "fsdp"), (4, "hsdp"), (8, "hsdp")])
def test_layout_boxes_equal_dtensor_local_shapes_and_offsets(shape, placement, world_size, mesh) -> None:
    for ours, torchs, local in get_pool(world_size).run(layouts_of_distributed, shape, placement, mesh, timeout=30):
        assert ours == torchs and ours[0] == local, (ours, torchs, local)
