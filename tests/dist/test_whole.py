"""muon_check.fixtures.whole: the gather that the gather control and the planted gather-style Muons use. On gloo over
CUDA tensors it gathers through c10d (torch's functional collectives, under DTensor.full_tensor, killed the ranks
there: docs/gpu.md); its contract is the same bits as DTensor.full_tensor. Checked here on gloo CPU ranks, where both paths run."""

from __future__ import annotations

import pytest

from tests.dist.conftest import get_pool
from tests.dist.workers import whole_against_full_tensor

# even, uneven, fewer rows than ranks (empty boxes), one row, a 3-D stack
SHAPES = ((4, 3), (3, 5), (1, 4), (5, 2), (3, 2, 2), (7, 1))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_c10d_gather_has_full_tensors_bits_and_its_control_does_not(world_size, dtype) -> None:
    """Contract: for every shape, whole(t, "c10d") is bitwise DTensor.full_tensor() and the seeded tensor, on every
    rank. Control: the same gather with its rows taken from the end of the
    buffer differs from full_tensor on some shape with padding (so the comparison can fail)."""
    answers = get_pool(world_size).run(whole_against_full_tensor, SHAPES, dtype, timeout=90)
    for rank, rows in enumerate(answers):
        assert [same for same, _ in rows] == [True] * len(SHAPES), (rank, rows)
        assert not all(control for _, control in rows), (rank, rows)
