"""The elementwise stages on a shard give the bits the reference gets on the whole tensor (muon_dist/elementwise.py)."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muon_dist import Box
from muon_dist.elementwise import run_stage, runs_as_is
from muon_ref.functional import apply_update, matrix_layout, momentum_direction
from muon_ref.optim import group_config
from muon_ref.presets import PRESETS, preset_defaults

from muon_check.fixtures import bits
from tests.conftest import examples

from .batches import layout_1d
from .checks import timeout_for

pytestmark = pytest.mark.timeout(timeout_for(60))


def shard_box(shape: tuple[int, int], placement: str, rank: int, W: int) -> Box:
    geometry = layout_1d(shape, placement, W, "torch.bfloat16").geometry
    return geometry.boxes[geometry.member(rank)]


def assert_every_shard_equals_the_whole(shape, placement, W, preset, dtype, seed) -> None:
    cfg = group_config(preset_defaults(preset, {}))
    gen = torch.Generator().manual_seed(seed)
    grad, buf, param = (torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
    update = torch.randn(shape, generator=gen).to(torch.bfloat16)
    mlayout = matrix_layout(shape)
    momentum = functools.partial(momentum_direction, cfg=cfg)
    apply = lambda p, u: (apply_update(p, u, mlayout, cfg),)  # noqa: E731
    whole = momentum(grad, buf) + apply(param, update)
    for rank in range(W):
        mine = shard_box(shape, placement, rank, W)
        on = lambda t: t[mine.index].contiguous()  # noqa: E731
        got = run_stage(momentum, [on(grad), on(buf)], shape, mine) + run_stage(
            apply, [on(param), on(update)], shape, mine
        )
        for g, w in zip(got, whole):
            assert torch.equal(bits(g), bits(on(w))), (rank, mine)
        if runs_as_is(
            [on(param), on(update)], shape, mine
        ):  # the update written into the shard itself
            own = on(param)
            apply_update(own, on(update), mlayout, cfg, out=own)
            assert torch.equal(bits(own), bits(on(whole[-1]))), (rank, mine)


@settings(max_examples=examples(2.0))
@given(
    shape=st.tuples(st.integers(1, 70), st.integers(1, 70)),
    placement=st.sampled_from(["S0", "S1"]),
    W=st.integers(1, 8),
    preset=st.sampled_from(sorted(PRESETS)),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 999),
)
def test_momentum_and_update_on_every_shard_equal_the_whole_tensor_bitwise(
    shape, placement, W, preset, dtype, seed
) -> None:
    assert_every_shard_equals_the_whole(shape, placement, W, preset, dtype, seed)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, W",
    [((256, 64), 2), ((256, 64), 4), ((96, 64), 4), ((130, 64), 4), ((129, 65), 2), ((129, 63), 2)],
)
def test_shards_of_whole_blocks_run_unpadded_with_the_same_bits(shape, W, preset, dtype) -> None:
    """Boxes of a multiple of BLOCK elements outside the tail take run_stage's unpadded call; the last box of
    (129, 65) and of (129, 63) holds the global tail and takes the padded one (negative control: without the tail
    condition, (129, 63)'s last box of 64 x 63 elements runs its 63 tail elements in the body and differs in
    bf16)."""
    assert_every_shard_equals_the_whole(shape, "S0", W, preset, dtype, seed=sum(shape) + W)


def test_bf16_add_alpha_depends_on_the_position_in_the_call_on_this_cpu() -> None:
    """Why run_stage exists (measured on an x86 CPU with AVX-512, torch 2.13): the vector body and the scalar tail differ."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(4096, generator=gen).to(torch.bfloat16) for _ in range(2))
    whole = a.add(b, alpha=0.95)
    one_by_one = torch.cat([a[i : i + 1].add(b[i : i + 1], alpha=0.95) for i in range(4096)])
    differing = int((whole != one_by_one).sum())
    if differing == 0:
        pytest.skip(
            "the CPU build running the test gives bf16 add(alpha) position-independent bits"
        )
    assert differing > 0


@pytest.mark.parametrize(
    "shape, W",
    [
        ((256, 64), 4),
        ((130, 64), 4),
        ((129, 65), 2),
        ((129, 63), 2),
        ((7, 32), 2),
        ((5, 3), 1),
        ((5, 3), 3),
    ],
)
@pytest.mark.parametrize("placement", ["S0", "S1"])
def test_runs_as_is_says_whether_run_stage_calls_the_stage_once_on_the_shard_as_it_is(
    shape, W, placement
) -> None:
    """runs_as_is is run_stage's rule: True exactly where run_stage makes one call of the stage, on the shard's own
    storage (no padded copy, no tail call); on a non-contiguous shard it is False unless the box is the whole
    tensor."""
    x = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
    for rank in range(W):
        mine = shard_box(shape, placement, rank, W)
        calls: list[tuple[int, int]] = []
        stage = lambda t: (calls.append((t.numel(), t.data_ptr())), (t + 1,))[1]  # noqa: E731
        for shard in (x[mine.index].contiguous(), x[mine.index]):
            calls.clear()
            (y,) = run_stage(stage, [shard], shape, mine)
            assert torch.equal(y, shard + 1)
            as_is = calls == [(shard.numel(), shard.data_ptr())]
            assert runs_as_is([shard], shape, mine) == as_is, (rank, mine, calls)
            if not shard.is_contiguous():
                assert runs_as_is([shard], shape, mine) == (tuple(mine.shape) == shape)


@pytest.mark.parametrize(
    "global_shape, box, calls",
    [
        # 130 elements: the body ends at 128, two elements in the tail; the box holds 65, the tail's two among them
        ((10, 13), Box((5, 0), (5, 13)), [128, 2]),
        # 128 elements, no tail; a box of 48 is padded to one BLOCK of 64 all the same
        ((8, 16), Box((0, 0), (3, 16)), [64]),
        # a box of 64 in the body of a tensor without a tail runs as it is
        ((8, 16), Box((0, 0), (4, 16)), [64]),
    ],
)
def test_a_stage_runs_once_on_the_box_padded_to_whole_blocks_and_once_on_the_tensors_tail(
    global_shape, box, calls
) -> None:
    """run_stage's calls, by the length of their inputs: the box padded to the next multiple of BLOCK (64), no
    further; then, where the box holds elements of the whole tensor's tail (its last numel % 64), the tail alone."""
    seen = []

    def stage(x: torch.Tensor) -> tuple[torch.Tensor]:
        seen.append(x.numel())
        return (x * 2,)

    x = torch.arange(box.numel, dtype=torch.float32).reshape(box.shape)
    (out,) = run_stage(stage, [x], global_shape, box)
    assert seen == calls and torch.equal(out, x * 2)
