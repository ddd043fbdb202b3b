"""Contracts of muon_ref.functional that the rest of the suite left unchecked (found by `make mutation`: README,
"Mutation testing"): the scale factor in every update form, Emerging's decay at weight_decay 0, Block's invariants,
and the refusals of a lone split_dim and of a gradient of another shape."""

from __future__ import annotations

import re
from typing import get_args

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from muon_check import restatements
from muon_ref import PRESETS, Block, MatrixLayout, Muon, MuonConfig, matrix_layout, muon_step
from muon_ref.config import ScaleApply
from muon_ref.functional import check_gradient, decay
from tests.conftest import examples

SCALE_APPLIES = get_args(ScaleApply)


def gaussians(shape: tuple[int, ...], seed: int, count: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(count)]


# A power of two c scales a float exactly (no rounding, away from overflow and subnormals), so a scale factor c
# and the learning rate times c (weight decay over c, keeping lr * wd) give the same bits in every update form.
@example(preset="torch", scale_apply="update", factor=0.5, shape=(6, 4), seed=0)
@settings(max_examples=examples(0.5))
@given(
    preset=st.sampled_from(sorted(PRESETS)),
    scale_apply=st.sampled_from(SCALE_APPLIES),
    factor=st.sampled_from([0.25, 0.5, 2.0, 4.0]),
    shape=st.tuples(st.integers(1, 12), st.integers(1, 12)),
    seed=st.integers(0, 2**16),
)
def test_a_power_of_two_scale_factor_steps_like_the_learning_rate_times_it_bitwise(
    preset, scale_apply, factor, shape, seed
):
    base = MuonConfig(**{**PRESETS[preset], "scale_apply": scale_apply})
    scaled = base.replace(scale_factor=factor)
    faster = base.replace(lr=base.lr * factor, weight_decay=base.weight_decay / factor)
    P, G, M = gaussians(shape, seed, 3)
    layout = matrix_layout(shape)
    got, want = muon_step(P, G, M, scaled, layout), muon_step(P, G, M, faster, layout)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# README, shape-scale table: Emerging's "spectral" with extra_scale_factor=0.2 is 0.2 sqrt(max(fo, fi))
@settings(max_examples=examples(0.25))
@given(shape=st.tuples(st.integers(1, 16), st.integers(1, 16)), seed=st.integers(0, 2**16))
def test_the_emerging_preset_with_a_scale_factor_equals_emerging_with_that_extra_scale_factor_bitwise(
    shape, seed
):
    init, *grads = gaussians(shape, seed, 4)
    p, q = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    opt, state = Muon([p], preset="emerging", scale_factor=0.2), {}
    for g in grads:
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        restatements.emerging_step([q], state, extra_scale_factor=0.2)
    assert torch.equal(p.detach(), q.detach())


@settings(max_examples=examples(0.25))
@given(
    preset=st.sampled_from(sorted(PRESETS)),
    scale_apply=st.sampled_from(SCALE_APPLIES),
    shape=st.tuples(st.integers(1, 12), st.integers(1, 12)),
    seed=st.integers(0, 2**16),
)
def test_with_a_zero_scale_factor_a_step_is_the_weight_decay_alone(
    preset, scale_apply, shape, seed
):
    cfg = MuonConfig(**{**PRESETS[preset], "scale_apply": scale_apply, "scale_factor": 0.0})
    P, G, M = gaussians(shape, seed, 3)
    new_p, _ = muon_step(P, G, M, cfg, matrix_layout(shape))
    assert torch.equal(new_p, decay(P, cfg))


# Emerging-Optimizers skips the decay op at weight_decay 0 (`if weight_decay > 0.0`); applied with alpha -0.0 it
# would turn an infinite element into NaN (inf + -0.0 * inf), which no finite param shows
@settings(max_examples=examples(0.25))
@given(shape=st.tuples(st.integers(1, 12), st.integers(1, 12)), seed=st.integers(0, 2**16))
def test_the_emerging_preset_without_weight_decay_equals_emerging_bitwise_on_an_infinite_param(
    shape, seed
):
    init, grad = gaussians(shape, seed, 2)
    init[0, 0] = float("inf")
    p, q = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    p.grad, q.grad = grad.clone(), grad.clone()
    Muon([p], preset="emerging", weight_decay=0.0).step()
    restatements.emerging_step([q], {}, weight_decay=0.0)
    assert torch.equal(p.detach().view(torch.int32), q.detach().view(torch.int32))


# Block's docstring: len(offsets) == len(shape) >= 2; offsets >= 0; sizes >= 1; prod(shape) == fan_out * fan_in
@pytest.mark.parametrize(
    "offsets, shape, fan_out, fan_in",
    [
        ((0,), (2, 3), 2, 3),  # offsets and shape of different lengths
        ((0,), (6,), 6, 1),  # one dim
        ((-1, 0), (2, 3), 2, 3),  # a negative offset
        ((0, 0), (0, 3), 0, 3),  # an empty box
        ((0, 0), (2, 3), 3, 3),  # fewer elements than the matrix
        ((0, 0), (2, 3), 1, 3),  # more elements than the matrix
    ],
    ids=["lengths", "1d", "negative-offset", "empty", "too-few", "too-many"],
)
def test_a_block_that_breaks_its_invariants_cannot_be_built(offsets, shape, fan_out, fan_in):
    with pytest.raises(AssertionError):
        Block(offsets, shape, fan_out, fan_in)


@example(split_dim=-1)
@given(split_dim=st.integers(-3, 3).filter(lambda d: d != 0))
def test_a_split_dim_other_than_zero_without_split_sizes_or_num_heads_is_refused(split_dim):
    with pytest.raises(
        ValueError,
        match=rf"w of shape \(4, 6\): split_dim={split_dim} needs split_sizes or num_heads",
    ):
        matrix_layout((4, 6), name="w", split_dim=split_dim)


# torch refuses to assign a .grad of another shape, so Muon never sees one; muon_dist's step checks gradients that
# callers hand it, through this function
@example(param_shape=(4, 4), grad_shape=(3, 4))  # a smaller gradient: (3, 4) < (4, 4) as tuples
@given(
    param_shape=st.tuples(st.integers(1, 5), st.integers(1, 5)),
    grad_shape=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple),
)
def test_a_gradient_of_another_shape_is_refused_naming_the_parameter_and_both_shapes(
    param_shape, grad_shape
):
    assume(grad_shape != param_shape)
    message = rf"w of shape {re.escape(str(param_shape))} has a gradient of shape {re.escape(str(grad_shape))}"
    with pytest.raises(ValueError, match=message):
        check_gradient(torch.zeros(grad_shape), torch.zeros(param_shape), "w")


def test_a_shared_layout_refuses_equal_blocks_out_of_order():
    """The batch view reads block i as flat range i of the param: equal slabs of dim 0, in order (MatrixLayout's
    invariant). Two equal (2, 3) slabs tiling (4, 3), listed bottom first: equal shapes alone are not enough."""
    blocks = (Block((2, 0), (2, 3), 2, 3), Block((0, 0), (2, 3), 2, 3))
    assert MatrixLayout(2, 2, 3, blocks[::-1]).shape == (4, 3)  # in order: a valid layout
    with pytest.raises(AssertionError):
        MatrixLayout(2, 2, 3, blocks)


def test_a_layout_that_breaks_its_invariants_cannot_be_built():
    """MatrixLayout's invariants, each broken alone next to a valid layout that differs in that one thing: the
    blocks cover the param, a separate layout has no batch view, a shared layout's blocks are its batch matrix."""
    top, bottom = Block((0, 0), (2, 3), 2, 3), Block((2, 0), (2, 3), 2, 3)
    assert MatrixLayout(2, None, None, (top, bottom), separate=True).shape == (4, 3)
    gap = Block((4, 0), (2, 3), 2, 3)  # rows 2:4 of the (6, 3) box belong to no block
    with pytest.raises(AssertionError):
        MatrixLayout(2, None, None, (top, gap), separate=True)
    with pytest.raises(AssertionError):  # a separate layout counts every block and has no fan
        MatrixLayout(1, None, None, (top, bottom), separate=True)
    assert MatrixLayout(1, 2, 3, (top,)).matrices_shape == (1, 2, 3)
    for fans in ((3, 3), (2, 4), (1, 3)):  # the batch view's fans are the blocks'
        with pytest.raises(AssertionError):
            MatrixLayout(1, *fans, (top,))
