"""muon_ref.Muon and its functional core: experts, state, purity, bad input, the Muon + AdamW split."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muon_ref import PRESETS, Muon, matrix_layout, muon_step
from muon_ref.split import MuonWithAdamW, split_params
from tests.conftest import examples


def gaussians(shape, seed, count):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(count)]


def train(params, opt, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()


@settings(max_examples=examples(0.5))
@given(
    E=st.integers(1, 6),
    m=st.integers(1, 12),
    n=st.integers(1, 12),
    preset=st.sampled_from(sorted(PRESETS)),
    seed=st.integers(0, 2**16),
)
def test_fused_experts_equal_3d_experts_equal_a_loop_over_experts_bitwise(E, m, n, preset, seed):
    init, *grads = gaussians((E, m, n), seed, 4)
    p3 = torch.nn.Parameter(init.clone())
    pf = torch.nn.Parameter(init.reshape(E * m, n).clone())
    loop = [torch.nn.Parameter(init[e].clone()) for e in range(E)]
    train([p3], Muon([p3], preset=preset), [[g] for g in grads])
    train([pf], Muon([pf], preset=preset, num_experts=E), [[g.reshape(E * m, n)] for g in grads])
    train(loop, Muon(loop, preset=preset), [list(g) for g in grads])
    assert torch.equal(p3.detach().reshape(E * m, n), pf.detach())
    assert torch.equal(p3.detach(), torch.stack([q.detach() for q in loop]))


def test_num_experts_one_on_a_3d_parameter_is_refused_not_merged():
    # a known failure in the field: viewing (E, m, n) as (1, -1, n) orthogonalises all experts as one matrix
    with pytest.raises(ValueError, match=r"num_experts=1 differs from dim 0 \(4\)"):
        Muon([torch.nn.Parameter(torch.zeros(4, 3, 2))], num_experts=1)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_state_dict_save_and_load_resumes_bitwise(preset):
    init, *grads = gaussians((12, 7), 0, 7)
    a = torch.nn.Parameter(init.clone())
    opt_a = Muon([a], preset=preset)
    train([a], opt_a, [[g] for g in grads])  # 6 uninterrupted steps
    b = torch.nn.Parameter(init.clone())
    opt_b = Muon([b], preset=preset)
    train([b], opt_b, [[g] for g in grads[:3]])
    buffer = io.BytesIO()
    torch.save({"param": b.detach().clone(), "opt": opt_b.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    c = torch.nn.Parameter(saved["param"])
    opt_c = Muon([c], preset=preset)
    opt_c.load_state_dict(saved["opt"])
    train([c], opt_c, [[g] for g in grads[3:]])
    assert torch.equal(a.detach(), c.detach())
    assert torch.equal(opt_a.state[a]["momentum_buffer"], opt_c.state[c]["momentum_buffer"])


def test_the_state_holds_only_the_momentum_buffer():
    p = torch.nn.Parameter(torch.randn(5, 3))
    p.grad = torch.randn(5, 3)
    opt = Muon([p])
    opt.step()
    assert set(opt.state[p]) == {"momentum_buffer"}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_muon_step_is_pure(preset):
    from muon_ref.optim import group_config

    cfg = group_config(Muon([torch.nn.Parameter(torch.zeros(2, 2))], preset=preset).param_groups[0])
    param, grad, buf = gaussians((6, 4), 1, 3)
    copies = [t.clone() for t in (param, grad, buf)]
    new_param, new_buf = muon_step(param, grad, buf, cfg, matrix_layout(param.shape))
    assert all(torch.equal(t, c) for t, c in zip((param, grad, buf), copies))
    assert not torch.equal(new_param, param) and not torch.equal(new_buf, buf)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_zero_gradient_gives_a_zero_update_and_no_nan(preset):
    init = torch.randn(6, 4)
    p = torch.nn.Parameter(init.clone())
    opt = Muon([p], preset=preset, weight_decay=0.0, eps=0.0)
    for _ in range(3):
        p.grad = torch.zeros(6, 4)
        opt.step()
    assert (
        torch.equal(p.detach(), init) and torch.count_nonzero(opt.state[p]["momentum_buffer"]) == 0
    )


def test_params_whose_grad_is_none_are_skipped():
    p, q = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4, 4))
    before = q.detach().clone()
    p.grad = torch.randn(4, 4)
    opt = Muon([p, q])
    opt.step()
    assert torch.equal(q.detach(), before) and q not in opt.state


@pytest.mark.parametrize(
    "bad, message",
    [
        (torch.zeros(5), r"param 0 of its group of shape \(5,\) is not a matrix"),
        (torch.zeros(4, 4, dtype=torch.int32), r"dtype torch.int32"),
        (torch.zeros(4, 4).to_sparse(), r"sparse"),
        (torch.zeros(2, 3, 3, 3), r"pass flatten=True"),
    ],
)
def test_bad_params_raise_a_value_error_naming_the_parameter_and_its_shape(bad, message):
    with pytest.raises(ValueError, match=message):
        Muon([torch.nn.Parameter(bad, requires_grad=False)])


def test_a_complex_param_is_refused_at_its_first_step_naming_it_as_torch_refuses_it():
    # torch.optim.Muon refuses a complex param at the step (its OptimizerInfo: STEP_ERROR), not at construction
    p = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.complex64))
    opt = Muon([p])
    p.grad = torch.ones_like(p)
    with pytest.raises(
        ValueError, match=r"param 0 of its group of shape \(4, 4\) has dtype torch.complex64"
    ):
        opt.step()
    assert torch.equal(p.detach(), torch.zeros(4, 4, dtype=torch.complex64)) and p not in opt.state


def test_named_params_are_named_in_errors():
    with pytest.raises(ValueError, match=r"bias of shape \(3,\)"):
        Muon(
            [
                ("weight", torch.nn.Parameter(torch.zeros(3, 3))),
                ("bias", torch.nn.Parameter(torch.zeros(3))),
            ]
        )


def test_num_experts_that_does_not_divide_the_rows_is_refused():
    with pytest.raises(ValueError, match=r"shape \(10, 4\): num_experts=3 does not divide 10 rows"):
        Muon([torch.nn.Parameter(torch.zeros(10, 4))], num_experts=3)


def test_unknown_options_and_presets_are_refused():
    with pytest.raises(ValueError, match="unknown Muon options"):
        Muon([torch.nn.Parameter(torch.zeros(3, 3))], momentun=0.9)
    with pytest.raises(ValueError, match="unknown preset"):
        Muon([torch.nn.Parameter(torch.zeros(3, 3))], preset="adam")
    with pytest.raises(ValueError, match="nesterov_form"):
        Muon([torch.nn.Parameter(torch.zeros(3, 3))], momentum_style="sum")  # "lerp" is EMA's form


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_gradient_raises_before_anything_is_written(value):
    p, q = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4, 4))
    before = (p.detach().clone(), q.detach().clone())
    p.grad, q.grad = torch.randn(4, 4), torch.randn(4, 4)
    q.grad[1, 2] = value
    opt = Muon([p, q])
    with pytest.raises(
        ValueError, match=r"param 1 of its group of shape \(4, 4\) has a non-finite gradient"
    ):
        opt.step()
    assert (
        torch.equal(p.detach(), before[0]) and torch.equal(q.detach(), before[1]) and not opt.state
    )


def test_the_skip_policy_leaves_a_non_finite_parameter_and_its_momentum_unchanged():
    p, q = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4, 4))
    before = q.detach().clone()
    p.grad, q.grad = torch.randn(4, 4), torch.full((4, 4), float("nan"))
    opt = Muon([p, q], nonfinite="skip")
    opt.step()
    assert torch.equal(q.detach(), before) and q not in opt.state and p in opt.state


def test_conv_weights_are_orthogonalised_as_out_by_in_times_kernel():
    init, grad = gaussians((8, 3, 3, 3), 2, 2)
    conv = torch.nn.Parameter(init.clone())
    flat = torch.nn.Parameter(init.reshape(8, 27).clone())
    conv.grad, flat.grad = grad.clone(), grad.reshape(8, 27).clone()
    Muon([conv], flatten=True).step()
    Muon([flat]).step()
    assert torch.equal(conv.detach().reshape(8, 27), flat.detach())


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.hidden = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, 10, bias=False)

    def forward(self, x):
        return self.lm_head(self.norm(torch.relu(self.hidden(self.embed(x)))))


def test_split_routes_hidden_matrices_to_muon_and_the_rest_to_adamw():
    muon, adamw = split_params(TinyNet())
    assert [n for n, _ in muon] == ["hidden.weight"]
    assert sorted(n for n, _ in adamw) == [
        "embed.weight",
        "hidden.bias",
        "lm_head.weight",
        "norm.bias",
        "norm.weight",
    ]


def _loss(model, seed):
    x = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(seed))
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())


def test_the_adamw_side_equals_torch_adamw_and_the_muon_side_equals_muon_bitwise():
    torch.manual_seed(0)
    model = TinyNet()
    ref = copy.deepcopy(model)
    opt = MuonWithAdamW(model, preset="torch", adamw=dict(lr=3e-3))
    muon_named, adamw_named = split_params(ref)
    ref_muon = Muon([p for _, p in muon_named], preset="torch")
    ref_adamw = torch.optim.AdamW(
        [p for _, p in adamw_named], lr=3e-3, weight_decay=0.01, foreach=False
    )
    for step in range(4):
        for m, o in ((model, [opt]), (ref, [ref_muon, ref_adamw])):
            _loss(m, step).backward()
            for x in o:
                x.step()
                x.zero_grad()
    for (name, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(a, b), name


def test_the_combined_optimizer_state_dict_round_trips_and_resumes_bitwise():
    torch.manual_seed(1)
    model = TinyNet()
    twin = copy.deepcopy(model)
    opt = MuonWithAdamW(model, preset="keller", adamw=dict(lr=1e-3))
    for step in range(2):
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()
    twin.load_state_dict(model.state_dict())
    opt_twin = MuonWithAdamW(twin, preset="keller", adamw=dict(lr=1e-3))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    opt_twin.load_state_dict(torch.load(buffer, weights_only=False))
    for step in range(2, 4):
        for m, o in ((model, opt), (twin, opt_twin)):
            _loss(m, step).backward()
            o.step()
            o.zero_grad()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_a_preset_runs_the_chosen_schedules_own_step_count():
    # presets do not pin ns_steps: keller's preset with polar_express runs its 8 steps, not 5
    init, grad = gaussians((16, 8), 3, 2)
    p, q = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    p.grad, q.grad = grad.clone(), grad.clone()
    Muon([p], preset="keller", schedule="polar_express").step()
    Muon([q], preset="keller", schedule="polar_express", ns_steps=8).step()
    assert torch.equal(p, q)
