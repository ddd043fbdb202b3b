"""Communication accounting, exact: bytes per rank and path on gloo against closed-form formulas.

S = elements of one matrix, W = ranks, b = bytes per element (fp32 grads and fp32 updates: ns_dtype=None).
  all_to_all, even:       every rank sends (W - 1) S / W per matrix each way: 2 (W - 1) / W S per matrix
                          over all ranks, the lower bound (docs/distributed.md).
  agrs, R matrices:       every rank sends (W - 1) R S / W in the all-gather and as much in the reduce-scatter:
                          2 (W - 1) R S over all ranks each way, W times the bound for R matrices.
  padded_all_to_all, R:   the traffic of W matrices for R real ones: overhead W / R.
"""

from __future__ import annotations

import pytest

from .checks import run_case
from .workers import Case

FP32 = (("ns_dtype", None),)
BATCHED = (
    ("dispatch", "batched"),
)  # the batched paths' own accounting (global: test_global_dispatch.py)


def _moved(results: list[dict], path: str) -> tuple[int, int]:
    return sum(r["bytes"][path][0] for r in results), sum(r["bytes"][path][1] for r in results)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_even_all_to_all_moves_exactly_the_lower_bound(world_size: int) -> None:
    W, rows, cols = world_size, 2 * world_size, 3
    results = run_case(W, Case(((rows, cols),) * W, ("S0",) * W, overrides=FP32, options=BATCHED))
    S = rows * cols
    for r in results:  # its box of W - 1 other matrices out, W - 1 boxes of its own matrix back
        assert r["bytes"]["all_to_all"] == (2 * (W - 1) * S // W * 4,) * 2
    assert (
        _moved(results, "all_to_all")[0] == W * 2 * (W - 1) * S // W * 4
    )  # = W matrices x 2 (W-1)/W S x 4 B


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size, num_params", [(4, 1), (4, 3), (8, 5)])
def test_agrs_overhead_is_an_all_gather_of_every_matrix(world_size: int, num_params: int) -> None:
    W, R, S = world_size, num_params, 2 * world_size * 3
    results = run_case(W, Case(((2 * W, 3),) * R, ("S0",) * R, overrides=FP32, options=BATCHED))
    for r in results:
        assert r["bytes"]["agrs"] == (2 * (W - 1) * R * S // W * 4,) * 2
    bound = R * 2 * (W - 1) * S // W * 4
    assert _moved(results, "agrs") == (W * bound,) * 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size, num_params", [(4, 1), (4, 3), (6, 2)])
def test_padded_all_to_all_moves_the_traffic_of_w_matrices(
    world_size: int, num_params: int
) -> None:
    W, R, S = world_size, num_params, 2 * world_size * 3
    results = run_case(
        W,
        Case(
            ((2 * W, 3),) * R,
            ("S0",) * R,
            overrides=FP32,
            options=(("remainder", "padded_all_to_all"),),
        ),
    )
    assert _moved(results, "padded_all_to_all")[0] == W * 2 * (W - 1) * S // W * 4


@pytest.mark.timeout(60)
def test_uneven_all_to_all_moves_what_each_owner_lacks() -> None:
    """5 rows of 3 on 4 ranks: boxes of 6, 6, 3, 0 elements; owner k receives S - box_k and sends it back."""
    results = run_case(4, Case(((5, 3),) * 4, ("S0",) * 4, overrides=FP32, options=BATCHED))
    boxes, S = [6, 6, 3, 0], 15
    assert _moved(results, "all_to_all") == (2 * sum(S - b for b in boxes) * 4,) * 2
    for rank, r in enumerate(results):
        assert r["bytes"]["all_to_all"][0] == (3 * boxes[rank] + S - boxes[rank]) * 4
