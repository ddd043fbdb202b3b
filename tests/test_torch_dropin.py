"""muon_ref.Muon and DistributedMuon as drop-ins for torch.optim.Muon, driven by torch's own test
inputs.

torch ships its Muon test inputs in torch.testing._internal.common_optimizers (the Muon
OptimizerInfo: optim inputs and error inputs; it imports `expecttest`). Each input runs on
torch.optim.Muon (the control), muon_ref.Muon, DistributedMuon without a process group (W = 1) and
DistributedMuon on gloo (W = 2, plain replicated tensors); the optimizers must agree bitwise in
float32 and float64. The generic checks torch runs for every optimizer (test/test_optim.py:
state_dict round trip, load after deepcopy, add_param_group, hooks, closure, zero_grad, Tensor lr,
params with and without grads, param names) are restated here, since test/ is not in torch's wheel.
Intended differences: docs/torch-dropin.md.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any, Callable

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import muon_ref
import muon_ref.optim
import muon_ref.presets
from muon_check.launch import RankPool
from muon_dist import DistributedMuon
from tests.conftest import examples

common_optimizers = pytest.importorskip("torch.testing._internal.common_optimizers")

MUON_INFO = next(info for info in common_optimizers.optim_db if info.optim_cls is torch.optim.Muon)
OPTIM_INPUTS = MUON_INFO.optim_inputs_func(device="cpu")
ERROR_INPUTS = MUON_INFO.optim_error_inputs_func(device="cpu", dtype=torch.float32)
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "muon_ref": muon_ref.Muon,
    "DistributedMuon": DistributedMuon,
}
SHAPES = ((8, 5), (4, 6), (6, 6))  # tall, wide, square: torch transposes tall matrices inside NS
# torch's error inputs whose outcome differs on purpose (docs/torch-dropin.md, "Intended
# differences")
INTENDED = {"only support 2D parameters": "3-D params are stacks of matrices here"}


def make_params(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in SHAPES]


def set_grads(params: list[torch.Tensor], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)


def run_steps(
    params: list[torch.Tensor], opt: torch.optim.Optimizer, steps: range
) -> list[torch.Tensor]:
    for t in steps:
        set_grads(params, t)
        opt.step()
    return [p.detach().clone() for p in params]


def fresh_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Each optimizer gets its own copy of a Tensor lr (torch's inputs share one object)."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def trajectory(
    factory: Callable[..., torch.optim.Optimizer],
    kwargs: dict[str, Any],
    dtype: torch.dtype,
    steps: int = 3,
) -> list[torch.Tensor]:
    params = make_params(dtype)
    return run_steps(params, factory(params, **fresh_kwargs(kwargs)), range(steps))


def assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"param {i}: max |d| {(g - w).abs().max().item():.3e}"


DTYPES = [torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("optim_input", OPTIM_INPUTS, ids=lambda i: i.desc)
def test_every_torch_optim_input_steps_bitwise_like_torch(
    optim_input: Any, name: str, dtype: torch.dtype
) -> None:
    """muon_ref.Muon is torch.optim.Muon bit for bit in every dtype. DistributedMuon implements the
    contiguous update layout (muon_dist/optim.py: UPDATE_LAYOUT): its contract is muon_ref's with
    that option, which is torch's in fp32 and fp64 and may differ in bf16 (CPU rounding by layout)."""
    want = trajectory(torch.optim.Muon, optim_input.kwargs, dtype)
    if name == "DistributedMuon" and dtype == torch.bfloat16:
        kwargs = {**optim_input.kwargs, "update_layout": "contiguous"}
        want = trajectory(muon_ref.Muon, kwargs, dtype)
    assert_bitwise(trajectory(OPTIMIZERS[name], optim_input.kwargs, dtype), want)


@example(fan_out=24, fan_in=8, dtype=torch.bfloat16, nesterov=True, seed=0)  # tall bf16: layout
@example(fan_out=1, fan_in=9, dtype=torch.bfloat16, nesterov=True, seed=1)
@settings(max_examples=examples(1.0))
@given(
    fan_out=st.integers(1, 40),
    fan_in=st.integers(1, 40),
    dtype=st.sampled_from(DTYPES),
    nesterov=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_torch_preset_is_torch_optim_muon_bitwise_on_any_shape_and_dtype(
    fan_out: int, fan_in: int, dtype: torch.dtype, nesterov: bool, seed: int
) -> None:
    """Tall, wide and square matrices in bf16, fp32 and fp64: params and momentum after every step.
    nesterov=False with bf16 params is torch's own defect up to 2.14 (its bf16 buffer normalised in
    place, pytorch/pytorch#194664; tests/test_presets.py measures it): there the torch that does it
    is left out, the torch that does not is held to the same contract."""
    if not nesterov and dtype == torch.bfloat16 and torch_normalises_its_bf16_buffer():
        nesterov = True
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(fan_out, fan_in, generator=gen).to(dtype)
    grads = [torch.randn(fan_out, fan_in, generator=gen).to(dtype) for _ in range(3)]
    p, q = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    theirs = torch.optim.Muon([p], lr=0.02, nesterov=nesterov)
    ours = muon_ref.Muon([q], preset="torch", lr=0.02, nesterov=nesterov)
    for g in grads:
        p.grad, q.grad = g.clone(), g.clone()
        theirs.step()
        ours.step()
        assert torch.equal(p, q), f"params: max |d| {(p - q).abs().max().item():.3e}"
    assert torch.equal(theirs.state[p]["momentum_buffer"], ours.state[q]["momentum_buffer"])


def torch_normalises_its_bf16_buffer() -> bool:
    """Whether the installed torch.optim.Muon writes its bf16 momentum buffer during NS (nesterov=False)."""
    p = torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.bfloat16))
    opt = torch.optim.Muon([p], nesterov=False)
    p.grad = torch.ones(4, 2, dtype=torch.bfloat16)
    opt.step()
    return not torch.equal(opt.state[p]["momentum_buffer"], torch.full((4, 2), 0.05).bfloat16())


def test_a_translation_that_drops_ns_coefficients_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Negative control: a planted from_torch_keys that ignores ns_coefficients (the silent bug
    torch's keyword names used to meet) changes the trajectory, and the bitwise check sees it."""
    kwargs = {"ns_coefficients": (3.4, -4.7, 2.0)}
    want = trajectory(torch.optim.Muon, kwargs, torch.float32)
    real = muon_ref.presets.from_torch_keys
    monkeypatch.setattr(
        muon_ref.presets,
        "from_torch_keys",
        lambda keys: real({k: v for k, v in keys.items() if k != "ns_coefficients"}),
    )
    got = trajectory(muon_ref.Muon, kwargs, torch.float32)
    assert not all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize(
    "key, value", [("adjust_lr_fn", "match_rms_adamw"), ("ns_coefficients", (3.4, -4.7, 2.0))]
)
def test_torch_keys_in_a_param_group_apply_as_in_torch(name: str, key: str, value: Any) -> None:
    def run(factory: Callable[..., torch.optim.Optimizer]) -> list[torch.Tensor]:
        params = make_params(torch.float32)
        groups = [{"params": params[:2], key: value}, {"params": params[2:]}]
        return run_steps(params, factory(groups), range(3))

    assert_bitwise(run(OPTIMIZERS[name]), run(torch.optim.Muon))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_torch_key_edited_between_steps_applies_as_in_torch(name: str) -> None:
    def run(factory: Callable[..., torch.optim.Optimizer]) -> list[torch.Tensor]:
        params = make_params(torch.float32)
        opt = factory(params)
        run_steps(params, opt, range(1))
        opt.param_groups[0]["adjust_lr_fn"] = "match_rms_adamw"
        opt.param_groups[0]["ns_coefficients"] = (3.4, -4.7, 2.0)
        return run_steps(params, opt, range(1, 3))

    assert_bitwise(run(OPTIMIZERS[name]), run(torch.optim.Muon))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_bad_torch_key_edited_between_steps_is_an_error_naming_it(name: str) -> None:
    params = make_params(torch.float32)
    opt = OPTIMIZERS[name](params)
    opt.param_groups[0]["adjust_lr_fn"] = "arbitrary"
    set_grads(params, 0)
    with pytest.raises(ValueError, match="adjust_lr_fn='arbitrary'"):
        opt.step()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_torch_positional_arguments_mean_what_they_mean_in_torch(name: str) -> None:
    args = (0.01, 0.2, 0.9, False, (3.4, -4.7, 2.0), 1e-7, 4, "match_rms_adamw")
    params, control = make_params(torch.float64), make_params(torch.float64)
    got = run_steps(params, OPTIMIZERS[name](params, *args), range(2))
    assert_bitwise(got, run_steps(control, torch.optim.Muon(control, *args), range(2)))


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize(
    "group",
    [
        {"adjust_lr_fn": "match"},
        {"ns_coefficients": (1.0, 2.0)},
        {"betas": (0.9, 0.99)},
        {"lr_scale": "spectral", "adjust_lr_fn": None},
    ],
)
def test_a_group_key_muon_does_not_apply_is_an_error_naming_it(
    name: str, group: dict[str, Any]
) -> None:
    params = make_params(torch.float32)
    with pytest.raises(ValueError, match=list(group)[-1]):
        OPTIMIZERS[name]([{"params": params, **group}])


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("error_input", ERROR_INPUTS, ids=lambda e: e.optimizer_error_input.desc)
def test_torch_error_inputs_raise_torch_errors_where_torch_raises_them(
    error_input: Any, name: str
) -> None:
    """The error type and wording torch's OptimizerInfo asks for, raised where it says torch raises
    it: at construction (error_on CONSTRUCTION_ERROR) or at the first step (STEP_ERROR), never
    later or earlier."""
    optim_input = error_input.optimizer_error_input
    params = optim_input.params if optim_input.params is not None else make_params(torch.float32)
    at_step = error_input.error_on == common_optimizers.OptimizerErrorEnum.STEP_ERROR
    if optim_input.params is None:
        set_grads(params, 0)
    if optim_input.desc in INTENDED:
        OPTIMIZERS[name](params, **optim_input.kwargs).step()  # accepted on purpose
        return
    if issubclass(error_input.error_type, Warning):
        raises = pytest.warns(error_input.error_type, match=error_input.error_regex)
    else:
        raises = pytest.raises(error_input.error_type, match=error_input.error_regex)
    if not at_step:
        with raises:
            OPTIMIZERS[name](params, **optim_input.kwargs)
        return
    opt = OPTIMIZERS[name](params, **optim_input.kwargs)  # no error before the step
    with raises:
        opt.step()


def test_torch_raises_its_own_error_inputs_where_its_optimizer_info_says() -> None:
    """The control of the test above: torch.optim.Muon itself, on the same inputs and the same
    rule (a drifted OptimizerInfo or a torch that moved an error shows here first)."""
    for error_input in ERROR_INPUTS:
        optim_input = error_input.optimizer_error_input
        if error_input.error_on == common_optimizers.OptimizerErrorEnum.STEP_ERROR:
            opt = torch.optim.Muon(optim_input.params, **optim_input.kwargs)
            with pytest.raises(error_input.error_type, match=error_input.error_regex):
                opt.step()
        elif not issubclass(error_input.error_type, Warning):
            params = optim_input.params
            if params is None:
                params = make_params(torch.float32)
            with pytest.raises(error_input.error_type, match=error_input.error_regex):
                torch.optim.Muon(params, **optim_input.kwargs)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch", "ours_to_ours"])
def test_a_state_dict_crosses_between_torch_and_ours_and_continues_bitwise(
    name: str, direction: str
) -> None:
    ours = OPTIMIZERS[name]
    first, second = {
        "torch_to_ours": (torch.optim.Muon, ours),
        "ours_to_torch": (ours, torch.optim.Muon),
        "ours_to_ours": (ours, ours),
    }[direction]
    params = make_params(torch.float32)
    opt = first(params, lr=0.02)
    run_steps(params, opt, range(2))
    saved = copy.deepcopy(opt.state_dict())
    resumed = second(params, lr=0.02)
    resumed.load_state_dict(saved)
    got = run_steps(params, resumed, range(2, 4))
    control = make_params(torch.float32)
    assert_bitwise(got, run_steps(control, torch.optim.Muon(control, lr=0.02), range(4)))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_state_dict_with_a_key_muon_does_not_apply_is_a_one_line_error(name: str) -> None:
    params = make_params(torch.float32)
    opt = OPTIMIZERS[name](params)
    saved = opt.state_dict()
    saved["param_groups"][0]["amsgrad"] = True
    with pytest.raises(
        ValueError, match="state dict param group 0: unknown Muon options \\['amsgrad'\\]"
    ):
        opt.load_state_dict(saved)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_optimizer_keeps_stepping_bitwise(name: str, how: str) -> None:
    params = make_params(torch.float32)
    opt = OPTIMIZERS[name](params)
    run_steps(params, opt, range(2))
    copier = copy.deepcopy if how == "deepcopy" else (lambda o: pickle.loads(pickle.dumps(o)))
    clone = copier({"params": params, "opt": opt})
    public = {k for k in vars(opt) if not k.startswith("_")}
    assert public <= set(vars(clone["opt"])), "torch's test_deepcopy_copies_all_public_attrs"
    want = run_steps(params, opt, range(2, 4))
    assert_bitwise(run_steps(clone["params"], clone["opt"], range(2, 4)), want)


@pytest.mark.parametrize("name", ["torch", *OPTIMIZERS])
def test_generic_optimizer_contract(name: str) -> None:
    """torch's generic checks, each a few lines: add_param_group, hooks, closure, zero_grad, Tensor
    lr, params with and without grads, param names; results compared with torch.optim.Muon's."""
    factory = torch.optim.Muon if name == "torch" else OPTIMIZERS[name]
    params = make_params(torch.float32)
    opt = factory([("w0", params[0]), ("w1", params[1])], lr=torch.tensor(0.01))
    opt.add_param_group({"params": [params[2]], "param_names": ["w2"], "lr": 0.02})
    calls: list[str] = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    set_grads(params, 0)
    params[1].grad = None  # a param without a grad neither moves nor gains momentum
    before = params[1].detach().clone()
    assert opt.step(lambda: torch.tensor(3.0)).item() == 3.0
    assert calls == ["pre", "post"]
    assert torch.equal(params[1], before)
    assert opt.state_dict()["param_groups"][0]["param_names"] == ["w0", "w1"]
    if (
        name == "DistributedMuon"
    ):  # zero buffers for every param from construction (docs/torch-dropin.md)
        assert not torch.count_nonzero(opt.state[params[1]]["momentum_buffer"])
    else:
        assert params[1] not in opt.state
    opt.zero_grad()
    assert all(p.grad is None for p in params)


def gloo_trajectories(world_size: int) -> list[bool]:
    """On every rank: DistributedMuon over the default gloo group against torch.optim.Muon, for each
    of torch's optim inputs in float32 and float64, and a torch checkpoint resumed; bitwise
    flags."""
    flags = []
    for optim_input in OPTIM_INPUTS:
        for dtype in (torch.float32, torch.float64):
            want = trajectory(torch.optim.Muon, optim_input.kwargs, dtype)
            got = trajectory(DistributedMuon, optim_input.kwargs, dtype)
            flags.append(all(torch.equal(g, w) for g, w in zip(got, want)))
    params, control = make_params(torch.float32), make_params(torch.float32)
    opt = torch.optim.Muon(params)
    run_steps(params, opt, range(2))
    resumed = DistributedMuon(params)
    resumed.load_state_dict(opt.state_dict())
    got = run_steps(params, resumed, range(2, 4))
    want = run_steps(control, torch.optim.Muon(control), range(4))
    flags.append(all(torch.equal(g, w) for g, w in zip(got, want)))
    return flags


@pytest.mark.timeout(180)
def test_distributed_muon_on_gloo_w2_steps_torchs_inputs_bitwise_like_torch() -> None:
    pool = RankPool(2)
    try:
        results = pool.run(gloo_trajectories, 2, timeout=120)
    finally:
        pool.close()
    assert results == [[True] * (2 * len(OPTIM_INPUTS) + 1)] * 2


def test_a_keller_muon_checkpoint_resumes_bitwise_in_the_keller_preset() -> None:
    keller = pytest.importorskip("muon")  # KellerJordan/Muon, PyPI muon-optimizer 0.1.0
    params, control = make_params(torch.float32), make_params(torch.float32)
    opt = keller.SingleDeviceMuon(params, lr=0.02)
    run_steps(params, opt, range(2))
    resumed = muon_ref.Muon(params, "keller")
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    got = run_steps(params, resumed, range(2, 4))
    assert_bitwise(got, run_steps(control, keller.SingleDeviceMuon(control, lr=0.02), range(4)))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_torch_preset_group_carries_every_key_torch_writes(name: str) -> None:
    """torch.optim.Muon reads its own keys from a loaded group; preset "torch" adds use_addmm (read
    by the torch versions that have it) beside the repo's fields (intended difference 4)."""
    params = make_params(torch.float32)
    ours = OPTIMIZERS[name](params).param_groups[0]
    theirs = torch.optim.Muon(params).param_groups[0]
    assert set(theirs) <= set(ours)
    assert {k: ours[k] for k in theirs if k not in ("params", "adjust_lr_fn")} == {
        k: v for k, v in theirs.items() if k not in ("params", "adjust_lr_fn")
    }
    assert ours["use_addmm"] is True and ours["adjust_lr_fn"] == "original"  # torch: None, the same


def test_loading_a_torch_checkpoint_without_the_group_mapping_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Negative control: a planted torch_state_dict_groups that passes torch's groups unchanged
    loses the repo's fields, and loading or the next step fails (the bug the mapping removes)."""
    monkeypatch.setattr(muon_ref.optim, "torch_state_dict_groups", lambda sd, defaults: sd)
    params = make_params(torch.float32)
    opt = torch.optim.Muon(params)
    run_steps(params, opt, range(1))
    resumed = muon_ref.Muon(params)
    set_grads(params, 1)
    with pytest.raises(KeyError):
        resumed.load_state_dict(opt.state_dict())
        resumed.step()


def test_distributed_muon_states_and_keeps_the_update_layout_it_implements() -> None:
    """DistributedMuon implements update_layout="contiguous" (docs/distributed.md, "Update layout"): its groups
    say so, an explicit "kernel" is a one-line ValueError naming the option (constructor, added group, a group
    edited before a step), and a muon_ref state dict's "kernel" groups load as "contiguous"."""
    params = make_params(torch.float32)
    opt = DistributedMuon(params)
    assert opt.param_groups[0]["update_layout"] == "contiguous"
    with pytest.raises(
        ValueError, match="update_layout='kernel' is not implemented by DistributedMuon"
    ):
        DistributedMuon(params, update_layout="kernel")
    with pytest.raises(ValueError, match="param group: update_layout='kernel'"):
        opt.add_param_group(
            {"params": [torch.randn(3, 3, requires_grad=True)], "update_layout": "kernel"}
        )
    reference = muon_ref.Muon(params, preset="torch")
    assert reference.param_groups[0]["update_layout"] == "kernel"
    opt.load_state_dict(reference.state_dict())
    assert opt.param_groups[0]["update_layout"] == "contiguous"
    opt.param_groups[0]["update_layout"] = "kernel"
    set_grads(params, 0)
    with pytest.raises(ValueError, match="param group 0: update_layout='kernel'"):
        opt.step()


def test_distributed_muon_refuses_a_batched_stack_mode_by_name() -> None:
    """DistributedMuon orthogonalises each matrix of a stack alone (ns_stack "per_matrix"): "batched" is a one-line
    ValueError naming the option, its value and the valid one (constructor, added group, a group edited before a
    step, raised before any collective), where muon_ref.Muon takes it."""
    stack = [torch.randn(3, 4, 5, requires_grad=True)]
    assert DistributedMuon(stack).param_groups[0]["ns_stack"] == "per_matrix"
    refusal = r"ns_stack='batched' is not implemented by DistributedMuon; valid: 'per_matrix'"
    with pytest.raises(ValueError, match=refusal):
        DistributedMuon(stack, ns_stack="batched")
    opt = DistributedMuon(stack)
    with pytest.raises(ValueError, match="param group: " + refusal):
        opt.add_param_group(
            {"params": [torch.randn(2, 3, 3, requires_grad=True)], "ns_stack": "batched"}
        )
    opt.param_groups[0]["ns_stack"] = "batched"
    set_grads(stack, 0)
    before = stack[0].detach().clone()
    with pytest.raises(ValueError, match="param group 0: " + refusal):
        opt.step()
    assert torch.equal(stack[0], before)  # nothing written
    muon_ref.Muon(stack, ns_stack="batched").step()  # the reference has it
