"""Blocks: every layout's independent matrices as boxes of the param, and split_sizes / num_heads params
stepped as separate params (proofs/blocks.md)."""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from muon_ref import (
    PRESETS,
    Block,
    Muon,
    MuonConfig,
    apply_update,
    functional,
    matrix_layout,
    momentum_direction,
    muon_step,
    orthogonalize,
    read_block,
)
from muon_ref.split import MuonWithAdamW
from tests.conftest import examples

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@st.composite
def split_cases(draw: st.DrawFn) -> tuple[tuple[int, int], dict, tuple[int, ...], int]:
    """(shape, layout keys, block sizes along split_dim, split_dim) of a small split or per-head 2-D param."""
    split_dim = draw(st.sampled_from([0, 1]))
    other = draw(st.integers(1, 10))
    if draw(st.booleans()):
        sizes = tuple(draw(st.lists(st.integers(1, 8), min_size=1, max_size=4)))
        keys = {"split_sizes": sizes}
    else:
        num_heads, head = draw(st.integers(1, 4)), draw(st.integers(1, 5))
        sizes, keys = (head,) * num_heads, {"num_heads": num_heads}
    if split_dim:
        keys["split_dim"] = 1
    shape = (sum(sizes), other) if split_dim == 0 else (other, sum(sizes))
    return shape, keys, sizes, split_dim


def gaussians(shape, seed, count, dtype):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(count)]


def train(params, opt, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()


def fused_and_separate(shape, keys, sizes, split_dim, preset, dtype, seed, steps=3):
    """(fused param and buffer, the separate params and buffers joined back) after the same steps."""
    init, *grads = gaussians(shape, seed, steps + 1, dtype)
    fused = torch.nn.Parameter(init.clone())
    opt = Muon([{"params": [fused], **keys}], preset=preset)
    train([fused], opt, [[g] for g in grads])
    parts = [torch.nn.Parameter(b.contiguous().clone()) for b in init.split(sizes, split_dim)]
    opt_parts = Muon(parts, preset=preset)
    train(parts, opt_parts, [[b.contiguous() for b in g.split(sizes, split_dim)] for g in grads])
    joined = torch.cat([p.detach() for p in parts], split_dim)
    joined_buf = torch.cat([opt_parts.state[p]["momentum_buffer"] for p in parts], split_dim)
    return (fused.detach(), opt.state[fused]["momentum_buffer"]), (joined, joined_buf)


def bitwise(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


# (16, 7, 1) rows of 8 columns: "original" scales the blocks by sqrt(2), 1, 1 and the whole matrix by sqrt(3)
@example(
    case=((24, 8), {"split_sizes": (16, 7, 1)}, (16, 7, 1), 0), preset="torch", dtype="bf16", seed=0
)
@example(
    case=((6, 12), {"num_heads": 3, "split_dim": 1}, (4, 4, 4), 1),
    preset="moonlight",
    dtype="bf16",
    seed=1,
)
@settings(max_examples=examples(1.0))
@given(
    case=split_cases(),
    preset=st.sampled_from(sorted(PRESETS)),
    dtype=st.sampled_from(sorted(DTYPES)),
    seed=st.integers(0, 2**16),
)
def test_a_split_or_per_head_param_equals_its_blocks_given_as_separate_params_bitwise(
    case, preset, dtype, seed
):
    shape, keys, sizes, split_dim = case
    fused, separate = fused_and_separate(shape, keys, sizes, split_dim, preset, DTYPES[dtype], seed)
    assert bitwise(fused, separate)


@settings(max_examples=examples(0.5))
@given(
    case=split_cases(),
    preset=st.sampled_from(sorted(PRESETS)),
    dtype=st.sampled_from(sorted(DTYPES)),
)
def test_each_functional_stage_of_a_separate_layout_is_that_stage_on_each_block_alone(
    case, preset, dtype
):
    shape, keys, _, _ = case
    layout, cfg = matrix_layout(shape, **keys), MuonConfig(**PRESETS[preset])
    P, G, M = gaussians(shape, 7, 3, DTYPES[dtype])
    inputs = [t.clone() for t in (P, G, M)]
    O = orthogonalize(G, layout, cfg)
    new_p, step = apply_update(P, O, layout, cfg), muon_step(P, G, M, cfg, layout)
    for b in layout.blocks:
        own, (p, g, m, o) = b.as_param(), (read_block(t, b) for t in (P, G, M, O))
        assert torch.equal(o, orthogonalize(g, own, cfg))
        assert torch.equal(read_block(new_p, b), apply_update(p, o, own, cfg))
        assert all(
            torch.equal(read_block(x, b), y) for x, y in zip(step, muon_step(p, g, m, cfg, own))
        )
    assert all(torch.equal(t, c) for t, c in zip((P, G, M), inputs))  # pure: no input written


def whole_matrix_lr_scale(monkeypatch, shape):
    real = functional.lr_scale
    monkeypatch.setattr(
        functional, "lr_scale", lambda name, fo, fi, sqrt: real(name, shape[0], shape[1], sqrt)
    )


def layout_keys_ignored(monkeypatch, shape):  # NS and one scale on the whole matrix
    monkeypatch.setattr(
        Muon, "layout_of", staticmethod(lambda p, group, name="param": matrix_layout(p.shape))
    )


def momentum_on_the_whole_tensor(monkeypatch, shape):
    def step(param, grad, buf, cfg, layout):  # the shared pipeline, with per-block NS and scales
        new_buf, direction = momentum_direction(grad, buf, cfg)
        return apply_update(param, orthogonalize(direction, layout, cfg), layout, cfg), new_buf

    monkeypatch.setattr("muon_ref.optim.muon_step", step)


# Planted bugs in the split param's step only (the separate params are stepped before the patch). The third
# needs bf16 and a block size off the 64-element vector body: moonlight's bf16 G.add(M, alpha=mu) rounds by
# position in the call (muon_dist/elementwise.py; measured here: 5 of 1,702 momentum and direction elements).
PLANTED = [
    (whole_matrix_lr_scale, "torch", "fp32", (24, 8), (16, 7, 1)),
    (layout_keys_ignored, "dion", "fp32", (24, 8), (16, 7, 1)),
    (momentum_on_the_whole_tensor, "moonlight", "bf16", (37, 23), (20, 10, 7)),
]


@pytest.mark.parametrize(
    "plant, preset, dtype, shape, sizes", PLANTED, ids=[p[0].__name__ for p in PLANTED]
)
def test_a_planted_bug_in_the_split_step_fails_the_equality_check(
    plant, preset, dtype, shape, sizes, monkeypatch
):
    keys = {"split_sizes": sizes}
    fused, separate = fused_and_separate(shape, keys, sizes, 0, preset, DTYPES[dtype], seed=3)
    assert bitwise(fused, separate)  # the control: no bug, same case
    plant(monkeypatch, shape)
    buggy, _ = fused_and_separate(shape, keys, sizes, 0, preset, DTYPES[dtype], seed=3)
    assert not bitwise(buggy, separate)


layouts = st.one_of(
    st.tuples(st.integers(1, 6), st.integers(1, 6)).map(lambda s: (s, {})),
    st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 5)).map(
        lambda s: ((s[0] * s[1], s[2]), {"num_experts": s[0]})
    ),
    st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 5)).map(lambda s: (s, {})),
    st.lists(st.integers(1, 3), min_size=3, max_size=4).map(
        lambda s: (tuple(s), {"flatten": True})
    ),
    split_cases().map(lambda c: (c[0], c[1])),
)


@settings(max_examples=examples(1.0))
@given(layout_case=layouts)
def test_the_blocks_of_every_layout_tile_the_param_exactly(layout_case):
    shape, keys = layout_case
    layout = matrix_layout(shape, **keys)
    cover = torch.zeros(shape, dtype=torch.int64)
    for b in layout.blocks:
        cover[b.index] += 1
        assert len(b.offsets) == len(shape) and math.prod(b.shape) == b.fan_out * b.fan_in
    assert layout.shape == shape and bool((cover == 1).all())


@settings(max_examples=examples(0.5))
@given(layout_case=layouts.filter(lambda c: "split_sizes" not in c[1] and "num_heads" not in c[1]))
def test_a_shared_layouts_batch_view_stacks_its_blocks_in_order(layout_case):
    shape, keys = layout_case
    layout = matrix_layout(shape, **keys)
    t = torch.arange(math.prod(shape)).reshape(shape)
    assert not layout.separate and layout.num_matrices == len(layout.blocks)
    assert torch.equal(
        t.reshape(layout.matrices_shape), torch.stack([read_block(t, b) for b in layout.blocks])
    )


@pytest.mark.parametrize(
    "shape, keys, blocks, separate",
    [
        ((5, 3), {}, [((0, 0), (5, 3), 5, 3)], False),
        ((6, 3), {"num_experts": 2}, [((0, 0), (3, 3), 3, 3), ((3, 0), (3, 3), 3, 3)], False),
        ((2, 4, 3), {}, [((0, 0, 0), (1, 4, 3), 4, 3), ((1, 0, 0), (1, 4, 3), 4, 3)], False),
        ((4, 2, 3, 3), {"flatten": True}, [((0, 0, 0, 0), (4, 2, 3, 3), 4, 18)], False),
        (
            (7, 3),
            {"split_sizes": (4, 2, 1)},
            [((0, 0), (4, 3), 4, 3), ((4, 0), (2, 3), 2, 3), ((6, 0), (1, 3), 1, 3)],
            True,
        ),
        ((4, 3), {"num_heads": 2}, [((0, 0), (2, 3), 2, 3), ((2, 0), (2, 3), 2, 3)], True),
        (
            (3, 4),
            {"num_heads": 2, "split_dim": 1},
            [((0, 0), (3, 2), 3, 2), ((0, 2), (3, 2), 3, 2)],
            True,
        ),
    ],
    ids=[
        "matrix",
        "fused-experts",
        "3d-experts",
        "flatten",
        "split_sizes",
        "heads-dim0",
        "heads-dim1",
    ],
)
def test_each_layout_has_its_documented_blocks(shape, keys, blocks, separate):
    layout = matrix_layout(shape, **keys)
    assert layout.blocks == tuple(Block(*b) for b in blocks) and layout.separate == separate
    if separate:
        assert (layout.num_matrices, layout.fan_out, layout.fan_in) == (len(blocks), None, None)
        with pytest.raises(ValueError, match="no batch view"):
            layout.matrices_shape


@pytest.mark.parametrize(
    "shape, keys, message",
    [
        (
            (10, 4),
            {"split_sizes": (3, 3)},
            r"\(10, 4\): split_sizes \(3, 3\) sum to 6, not to dim 0 \(10\)",
        ),
        (
            (4, 10),
            {"split_sizes": (3, 3), "split_dim": 1},
            r"\(4, 10\): split_sizes \(3, 3\) sum to 6, not to dim 1",
        ),
        (
            (10, 4),
            {"split_sizes": (10, 0)},
            r"\(10, 4\): split_sizes must be a non-empty tuple of positive ints",
        ),
        (
            (10, 4),
            {"split_sizes": ()},
            r"\(10, 4\): split_sizes must be a non-empty tuple of positive ints",
        ),
        ((10, 4), {"num_heads": 3}, r"\(10, 4\): num_heads=3 does not divide dim 0 \(10\)"),
        (
            (4, 10),
            {"num_heads": 4, "split_dim": 1},
            r"\(4, 10\): num_heads=4 does not divide dim 1 \(10\)",
        ),
        ((10, 4), {"num_heads": True}, r"\(10, 4\): num_heads must be a positive int, got True"),
        (
            (10, 4),
            {"num_heads": 2, "split_sizes": (5, 5)},
            r"\(10, 4\): split_sizes and num_heads are exclusive",
        ),
        ((2, 10, 4), {"num_heads": 2}, r"\(2, 10, 4\): num_heads needs a 2-D param, got ndim 3"),
        (
            (10, 4),
            {"num_heads": 2, "num_experts": 2},
            r"\(10, 4\): num_heads is exclusive with num_experts",
        ),
        (
            (10, 4),
            {"split_sizes": (5, 5), "flatten": True},
            r"\(10, 4\): split_sizes is exclusive with .* flatten",
        ),
        (
            (10, 4),
            {"num_heads": 2, "split_dim": 2},
            r"\(10, 4\): split_dim must be 0 \(rows\) or 1 \(columns\)",
        ),
        ((10, 4), {"split_dim": 1}, r"\(10, 4\): split_dim=1 needs split_sizes or num_heads"),
    ],
)
def test_bad_layout_keys_raise_a_value_error_naming_the_parameter_and_its_shape(
    shape, keys, message
):
    with pytest.raises(ValueError, match=r"qkv of shape " + message):
        Muon([{"params": [("qkv", torch.nn.Parameter(torch.zeros(shape)))], **keys}])


def test_map_blocks_refuses_a_tensor_that_is_not_the_whole_param():
    layout = matrix_layout((6, 4), split_sizes=(4, 2))
    with pytest.raises(
        ValueError, match=r"whole tensors of the param's shape \(6, 4\), got \(3, 4\)"
    ):
        functional.map_blocks(lambda b, t: (t,), layout, torch.zeros(3, 4))


def test_a_non_finite_gradient_in_one_block_skips_that_block_alone_as_separate_params_would():
    init, *grads = gaussians((7, 5), 4, 3, torch.float32)
    grads[1][5, 2] = float("nan")  # step 2, head 2 of rows 4..7
    fused, separate = (
        (torch.nn.Parameter(init.clone()),),
        [torch.nn.Parameter(h.clone()) for h in init.split((4, 3))],
    )
    train(
        fused,
        Muon([{"params": fused, "split_sizes": (4, 3)}], nonfinite="skip"),
        [[g] for g in grads],
    )
    train(separate, Muon(separate, nonfinite="skip"), [list(g.split((4, 3))) for g in grads])
    assert torch.equal(fused[0].detach(), torch.cat([p.detach() for p in separate]))


def test_the_state_dict_round_trips_the_layout_keys_and_resumes_bitwise():
    init, *grads = gaussians((6, 8), 5, 6, torch.float32)
    keys = {"num_heads": 4, "split_dim": 1}
    a, b = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    opt_a, opt_b = (
        Muon([{"params": [a], **keys}], preset="dion"),
        Muon([{"params": [b], **keys}], preset="dion"),
    )
    train([a], opt_a, [[g] for g in grads])  # 5 uninterrupted steps
    train([b], opt_b, [[g] for g in grads[:2]])
    buffer = io.BytesIO()
    torch.save({"param": b.detach().clone(), "opt": opt_b.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    c = torch.nn.Parameter(saved["param"])
    opt_c = Muon([c], preset="dion")  # no layout keys: they come back with the param groups
    opt_c.load_state_dict(saved["opt"])
    assert {k: opt_c.param_groups[0][k] for k in keys} == keys
    train([c], opt_c, [[g] for g in grads[2:]])
    assert torch.equal(a.detach(), c.detach())
    assert torch.equal(opt_a.state[a]["momentum_buffer"], opt_c.state[c]["momentum_buffer"])


def test_muon_with_adamw_groups_and_constructor_overrides_take_the_layout_keys():
    init, *grads = gaussians((6, 4), 6, 3, torch.float32)
    in_group, override = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    heads = [torch.nn.Parameter(h.clone()) for h in init.split(2)]
    opt = MuonWithAdamW([{"params": [in_group], "algorithm": "muon", "num_heads": 3}])
    train([in_group], opt, [[g] for g in grads])
    train([override], Muon([override], num_heads=3), [[g] for g in grads])
    train(heads, Muon(heads), [list(g.split(2)) for g in grads])
    joined = torch.cat([h.detach() for h in heads])
    assert torch.equal(in_group.detach(), joined) and torch.equal(override.detach(), joined)
