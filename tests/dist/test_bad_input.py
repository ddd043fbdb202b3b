"""Caller mistakes raise a clear ValueError on EVERY rank before any data collective, never a hang."""

from __future__ import annotations

import pytest

from .conftest import get_pool
from .workers import bad_step

DISAGREE = "disagree with rank 0 on the step's plan"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["shape_differs", "grad_none_on_one_rank", "mesh_mixed"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_that_disagree_on_the_params_all_raise_naming_the_disagreement(
    kind: str, world_size: int
) -> None:
    errors = get_pool(world_size).run(bad_step, kind, timeout=30)
    assert all(DISAGREE in e for e in errors), errors


@pytest.mark.timeout(60)
def test_a_local_error_on_one_rank_raises_there_and_stops_every_other_rank() -> None:
    errors = get_pool(3).run(bad_step, "grad_placement_differs_on_one_rank", timeout=30)
    assert "gradient placements (Replicate(),) differ" in errors[0], errors[0]
    assert all(DISAGREE in e for e in errors[1:]), errors


@pytest.mark.timeout(60)
def test_a_nan_in_one_rank_shard_raises_on_every_rank_naming_the_param() -> None:
    errors = get_pool(4).run(bad_step, "nonfinite_on_one_shard", timeout=30)
    assert all(
        "param 0 of its group of shape (6, 4) has a non-finite gradient" in e for e in errors
    ), errors


@pytest.mark.timeout(60)
def test_a_nan_in_one_rank_shard_skips_the_param_on_every_rank_when_asked() -> None:
    assert get_pool(4).run(bad_step, "nonfinite_skip", timeout=30) == ["unchanged"] * 4
