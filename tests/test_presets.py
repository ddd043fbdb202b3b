"""Each preset reproduces the public implementation it names, bit for bit (params after every step and the
momentum), checked through the conformance machinery (muon_check/adapters/origins.py), in this process."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from muon_check import conformance
from muon_check.adapters.cases import Case
from muon_check.adapters.origins import ORIGINS, KellerOrigin
from muon_ref import PRESETS, Muon
from tests.conftest import examples, require


def conforms(preset: str, shape: tuple[int, ...], steps: int = 5, **options: object) -> bool:
    """The preset's origin and muon_ref under the preset, from the same params on the same gradients, with the
    check's hyperparameters (lr 0.02, weight decay 0.1, momentum 0.9, Nesterov) and `options` over them."""
    if preset == "keller":
        require("muon", "muon-optimizer")
    case = Case("drawn", "single", 1, (tuple(shape),), steps=steps, options=tuple(options.items()))
    return conformance.run_here(ORIGINS[preset](), case).status == "bitwise"


dims = st.integers(1, 48)
shapes_2d = st.one_of(
    st.tuples(dims, dims),  # tall, wide, square
    st.tuples(st.just(1), dims),  # 1 x n
)


@example(shape=(64, 32), nesterov=True, lr_scale="original", weight_decay=0.1)
@example(shape=(1, 7), nesterov=False, lr_scale="match_rms_adamw", weight_decay=0.0)
@settings(max_examples=examples(1.0))
@given(
    shape=shapes_2d,
    nesterov=st.booleans(),
    lr_scale=st.sampled_from(["original", "match_rms_adamw"]),
    weight_decay=st.sampled_from([0.0, 0.1]),
)
def test_torch_preset_equals_torch_optim_muon_bitwise(shape, nesterov, lr_scale, weight_decay):
    assert conforms("torch", shape, nesterov=nesterov, lr_scale=lr_scale, weight_decay=weight_decay)


def _per_matrix(batched):
    """KellerJordan's zeropower_via_newtonschulz5 with a stack's products run one matrix at a time (its own 2-D
    call on each), the result laid out as the batched call lays it out (a tall stack's transposed view)."""

    def run(G, steps):
        if G.ndim == 2:
            return batched(G, steps)
        flat = G.reshape(-1, *G.shape[-2:])
        tall = G.size(-2) > G.size(-1)
        outs = [batched(m, steps) for m in flat]
        stack = torch.stack([o.mT for o in outs]).mT if tall else torch.stack(outs)
        return stack.reshape(G.shape)

    return run


class KellerPerMatrix(KellerOrigin):
    """KellerJordan's SingleDeviceMuon claimed with preset "keller" alone (ns_stack "per_matrix")."""

    overrides: dict = {}


@settings(max_examples=examples(0.5))
@given(
    shape=st.one_of(shapes_2d, st.tuples(st.integers(1, 5), dims, dims)),
    weight_decay=st.sampled_from([0.0, 0.05]),
)
# a stack whose batched products round otherwise than its single ones (an Intel Xeon, oneDNN on and off)
@example(shape=(3, 2, 34), weight_decay=0.0)
def test_keller_preset_equals_kellerjordan_single_device_muon_bitwise_on_2d_and_3d(
    shape, weight_decay
):
    """Preset "keller" against KellerJordan's SingleDeviceMuon, bit for bit, with no tolerance and no rounding
    named. On a 3-D stack its `@` is a batched product: the origin as it ships against the claim with ns_stack
    "batched" (KellerOrigin's), and the origin with its stack's products run per matrix (its own 2-D call on each
    matrix) against "keller" alone, where each matrix is orthogonalised alone (docs/conventions.md, "Stacks")."""
    muon = require("muon", "muon-optimizer")
    case = Case(
        "drawn", "single", 1, (tuple(shape),), steps=5, options=(("weight_decay", weight_decay),)
    )
    outcome = conformance.run_here(KellerOrigin(), case)
    assert outcome.status == "bitwise" and outcome.elementwise is None, outcome.summary()
    if len(shape) == 3:
        with pytest.MonkeyPatch.context() as mp:
            ns = muon.zeropower_via_newtonschulz5
            mp.setattr(muon, "zeropower_via_newtonschulz5", _per_matrix(ns))
            outcome = conformance.run_here(KellerPerMatrix(), case)
            assert outcome.status == "bitwise" and outcome.elementwise is None, outcome.summary()


def test_kellerjordan_muon_fails_on_4d_conv_weights_and_the_reference_handles_them():
    muon = require("muon", "muon-optimizer")

    p = torch.nn.Parameter(torch.randn(8, 3, 3, 3))
    p.grad = torch.randn_like(p)
    with pytest.raises(
        RuntimeError
    ):  # its update is viewed (8, 27) and cannot be added to (8, 3, 3, 3)
        muon.SingleDeviceMuon([p]).step()
    q = torch.nn.Parameter(torch.randn(8, 3, 3, 3))
    q.grad = torch.randn_like(q)
    Muon([q], preset="keller", flatten=True).step()
    assert torch.isfinite(q).all()


@settings(max_examples=examples(0.5))
@given(
    preset=st.sampled_from(["moonlight", "dion", "xtuner", "emerging"]),
    shape=shapes_2d,
    nesterov=st.booleans(),
)
def test_presets_equal_their_written_out_origins_bitwise(preset, shape, nesterov):
    assert conforms(preset, shape, steps=4, nesterov=nesterov)


@pytest.mark.parametrize(
    "preset, shape, options",
    [("dion", (3, 16, 24), {}), ("xtuner", (4 * 12, 20), {"num_experts": 4})],
)
def test_expert_presets_equal_their_origins_bitwise(preset, shape, options):
    assert conforms(preset, shape, **options)


def test_the_origins_check_exits_zero_and_covers_every_preset(capsys):
    require("muon", "muon-optimizer")  # the keller preset's origin
    assert conformance.main(["--origins", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert set(ORIGINS) == set(PRESETS)
    for preset in PRESETS:
        assert f"(claims preset {preset!r}" in out
    assert (
        "(claims preset 'keller', ns_stack='batched')" in out
    )  # its origin batches a stack's products
    assert "6/6 adapters conform to their claims" in out


# Negative controls: one wrong convention each, and the equivalence check must catch it.
WRONG = [
    (
        "torch",
        dict(momentum_style="sum", nesterov_form="add_alpha"),
        (37, 23),
    ),  # sum instead of EMA
    ("torch", dict(step_form="keller"), (37, 23)),  # separate ops instead of torch.addmm
    ("keller", dict(step_form="addmm"), (37, 23)),  # torch.addmm instead of separate ops
    ("moonlight", dict(step_form="dion"), (37, 23)),  # c * (A @ A) instead of (c * A) @ A
    ("dion", dict(momentum_style="ema", nesterov_form="lerp"), (37, 23)),  # EMA instead of sum
    ("xtuner", dict(scale_apply="update_lr"), (37, 23)),  # lr * s kept in fp32, not rounded to bf16
    ("emerging", dict(normalize_before_cast=False), (37, 23)),  # normalise after the bf16 cast
]


@pytest.mark.parametrize(
    "preset, wrong, shape", WRONG, ids=[f"{p}-{next(iter(w))}" for p, w, _ in WRONG]
)
def test_a_wrong_convention_breaks_the_bitwise_equivalence(preset, wrong, shape, monkeypatch):
    assert conforms(preset, shape, steps=3)  # the control: right convention, same case
    monkeypatch.setitem(PRESETS, preset, {**PRESETS[preset], **wrong})
    assert not conforms(preset, shape, steps=3)


def test_sqrt_and_pow_shape_scales_differ_in_the_last_bit_for_some_shapes():
    from muon_ref import lr_scale

    # (145, 9): math.sqrt(145 / 9) != (145 / 9) ** 0.5; in fp32 parameters the difference rounds away,
    # in fp64 parameters it reaches the update, so the origin's evaluation is configuration (scale_sqrt).
    assert lr_scale("original", 145, 9, "sqrt") != lr_scale("original", 145, 9, "pow")
    assert lr_scale("original", 64, 32, "sqrt") == lr_scale("original", 64, 32, "pow")


def test_torch_muon_normalises_its_bf16_momentum_buffer_in_place_until_fixed_and_the_reference_never_does():
    # torch.optim.Muon up to 2.14 (_zeropower_via_newtonschulz): grad.bfloat16() returns the bf16 buffer itself,
    # then div_ normalises it in place; pytorch/pytorch#194664 copies it first (torch 2.15.0: the buffer is not
    # written). Which one this torch does is measured; either way its buffer is one of exactly two values. The
    # reference never writes its inputs; the torch preset's bitwise contract is stated for fp32 parameters (and
    # for nesterov=True in any dtype).
    g = torch.randn(16, 8, generator=torch.Generator().manual_seed(0)).bfloat16()
    p = torch.nn.Parameter(torch.zeros(16, 8, dtype=torch.bfloat16))
    q = torch.nn.Parameter(torch.zeros(16, 8, dtype=torch.bfloat16))
    torch_opt, ref_opt = (
        torch.optim.Muon([p], nesterov=False),
        Muon([q], preset="torch", nesterov=False),
    )
    p.grad, q.grad = g.clone(), g.clone()
    torch_opt.step()
    ref_opt.step()
    expected = torch.zeros(16, 8, dtype=torch.bfloat16).lerp(g, 0.05)
    assert torch.equal(ref_opt.state[q]["momentum_buffer"], expected)
    buffer = torch_opt.state[p]["momentum_buffer"]
    # the aliasing: X = buffer; X.div_(X.norm() + eps)
    normalised = expected / (expected.norm() + 1e-7)
    assert torch.equal(buffer, expected) or torch.equal(buffer, normalised), (
        f"torch {torch.__version__}'s Muon left its bf16 buffer neither untouched nor normalised in place"
    )


def _bf16_add_rounds_by_layout() -> bool:
    """Whether the running CPU's bf16 `P.add(O, alpha=...)` gives other bits when O is a transposed view than when it is
    contiguous (measured: the vectorised and the scalar loop round differently on some CPUs, not on all)."""
    gen = torch.Generator().manual_seed(0)
    P = torch.randn(64, 16, generator=gen).bfloat16()
    O_t = torch.randn(16, 64, generator=gen).bfloat16()
    return not torch.equal(P.add(O_t.T, alpha=-0.0283), P.add(O_t.T.contiguous(), alpha=-0.0283))


def test_the_torch_preset_needs_the_kernels_update_layout_where_the_cpu_rounds_by_layout():
    # Negative control of the bitwise tests over bf16 (tests/test_torch_dropin.py): where the running CPU rounds the two
    # memory orders of the update differently, update_layout="contiguous" (muon_dist's) leaves torch.optim.Muon's
    # bits on bf16 tall matrices and "kernel" (the preset's) keeps them; where it does not, both keep them.
    gen = torch.Generator().manual_seed(0)
    p0, grads = (
        torch.randn(64, 16, generator=gen).bfloat16(),
        [torch.randn(64, 16, generator=gen).bfloat16() for _ in range(3)],
    )

    def run(make) -> torch.Tensor:
        p = torch.nn.Parameter(p0.clone())
        opt = make([p])
        for g in grads:
            p.grad = g.clone()
            opt.step()
        return p.detach()

    want = run(lambda ps: torch.optim.Muon(ps, lr=0.02))
    assert torch.equal(run(lambda ps: Muon(ps, preset="torch", lr=0.02)), want)
    contiguous = run(lambda ps: Muon(ps, preset="torch", lr=0.02, update_layout="contiguous"))
    assert torch.equal(contiguous, want) == (not _bf16_add_rounds_by_layout())
