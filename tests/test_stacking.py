"""Calls stacked across params (muon_dist.kernels.orthogonalize_many) and the "batched" backend's contract.

Reference equation (orthogonalize_many), for every call i of a list of calls (direction, layout, cfg):
    orthogonalize_many(B, calls)[i] == B.orthogonalize(*calls[i])
bitwise for the torch backend (its stack kernel loops, or batches where its probe shows the loop's bits), within
the backend's tolerance for the others. The "batched" backend against muon_ref.newton_schulz: its module's
contract (muon_dist/kernels/batched.py), per matrix whatever else its stack holds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muon_dist.kernels import STACK_MAX_ELEMENTS, Backend, backend, orthogonalize_many, stacks
from muon_dist.kernels.contracts import KINDS, contract_inputs, measure
from muon_ref import MuonConfig, matrix_layout, newton_schulz
from tests.conftest import examples
from tests.test_kernels import BF16_ULP, within

CPU = torch.device("cpu")


def always(matrix, dtype, device, cfg) -> bool:
    return True


# the torch backend's stack kernel on every stack: it loops where its probe does not show the batch bitwise, so the
# stacked calls keep muon_ref's bits on every CPU, and the stacking itself is what these tests exercise
STACKING = dataclasses.replace(backend("torch"), batches=always)

LAYOUTS = {  # name -> (shape, matrix_layout keywords)
    "matrix": ((6, 10), {}),
    "tall": ((10, 6), {}),
    "stack": ((3, 6, 10), {}),
    "experts": ((12, 10), {"num_experts": 2}),
    "split": ((10, 10), {"split_sizes": (6, 4)}),
    "heads": ((10, 12), {"num_heads": 2, "split_dim": 1}),
    "small": ((3, 10), {}),
}
CONFIGS = {
    "keller": MuonConfig(schedule="keller"),
    "polar_express": MuonConfig(schedule="polar_express"),
    "keller_fp32": MuonConfig(schedule="keller", ns_dtype=torch.float32),
}


def calls_of(draws: list[tuple[str, str, int]], dtype: torch.dtype) -> list[tuple]:
    """(direction, layout, cfg) per draw (layout name, config name, seed)."""
    out = []
    for name, config, seed in draws:
        shape, keys = LAYOUTS[name]
        D = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
        out.append((D, matrix_layout(shape, **keys), CONFIGS[config]))
    return out


draws = st.lists(
    st.tuples(
        st.sampled_from(sorted(LAYOUTS)), st.sampled_from(sorted(CONFIGS)), st.integers(0, 99)
    ),
    min_size=1,
    max_size=7,
)


@settings(max_examples=examples(1.0), deadline=None)
@given(draws=draws, dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_stacked_calls_give_each_call_its_own_bits_with_the_torch_backend(draws, dtype):
    """Every layout kind (2-D wide and tall, 3-D stacks, fused experts, split_sizes and heads blocks), configs that
    share a stack or not, inputs in fp32 or bf16: each stacked call equals muon_ref.orthogonalize's result for it."""
    calls = calls_of(draws, dtype)
    got = orthogonalize_many(STACKING, calls)
    for (D, layout, cfg), result in zip(calls, got):
        assert result.shape == D.shape
        assert torch.equal(result, STACKING.orthogonalize(D, layout, cfg)), (layout, cfg)


def test_same_shape_matrices_of_several_calls_share_one_stack_kernel_call():
    """Five calls, two matrix shapes (one of them in a 3-D stack and a fused bundle too), one config: two stack kernel
    calls, each on every matrix of its shape, in call order."""
    seen = []

    def stack(S, cfg):
        seen.append(tuple(S.shape))
        return backend("torch").stack(S, cfg)

    counting = dataclasses.replace(STACKING, stack=stack)
    calls = calls_of(
        [
            ("matrix", "keller", 1),
            ("stack", "keller", 2),
            ("small", "keller", 3),
            ("matrix", "keller", 4),
            ("small", "keller", 5),
        ],
        torch.float32,
    )
    orthogonalize_many(counting, calls)
    assert seen == [(1 + 3 + 1, 6, 10), (2, 3, 10)]


def test_the_flop_counter_counts_every_matrix_of_stacked_and_single_calls():
    """muon_check.fixtures.count_kernel_flops (which the distributed tests hold against muon_dist.expected_flops)
    counts both kernels (muon_dist.kernels.with_kernels): each matrix of calls that orthogonalize_many stacks, and
    each block of a call made alone, muon_dist.balance.ns_flops apiece. Control: a counter of orthogonalize alone
    counts none of the stacked matrices."""
    from types import SimpleNamespace

    from muon_check.fixtures import count_kernel_flops
    from muon_dist.balance import ns_flops

    names = [("matrix", "keller", 1), ("stack", "keller", 2), ("split", "polar_express", 3)]
    calls = calls_of(names, torch.bfloat16)
    single = calls_of([("heads", "keller", 4)], torch.bfloat16)[0]
    want = sum(ns_flops(b.fan_out, b.fan_in) for _, lay, _ in [*calls, single] for b in lay.blocks)
    holder = SimpleNamespace(backend=STACKING)
    count = count_kernel_flops(holder)
    orthogonalize_many(holder.backend, calls)
    holder.backend.orthogonalize(*single)
    assert count[0] == want > 0
    # the control: orthogonalize alone wrapped
    seen = [0]

    def counted(direction, layout, cfg):
        seen[0] += sum(ns_flops(b.fan_out, b.fan_in) for b in layout.blocks)
        return STACKING.orthogonalize(direction, layout, cfg)

    orthogonalize_many(dataclasses.replace(STACKING, orthogonalize=counted), calls)
    assert seen[0] == 0 < want


def test_a_backend_without_a_stack_kernel_takes_the_one_call_path():
    """Backend.stack None: stacks() admits nothing and orthogonalize_many is each call's own orthogonalize."""
    calls = calls_of([("matrix", "keller", 1), ("split", "keller", 2)], torch.float32)
    plain = dataclasses.replace(STACKING, stack=None)
    assert not stacks(plain, calls[0][1], torch.float32, CPU, CONFIGS["keller"])
    for (D, layout, cfg), got in zip(calls, orthogonalize_many(plain, calls)):
        assert torch.equal(got, plain.orthogonalize(D, layout, cfg))


def test_only_small_matrices_the_backend_batches_join_a_stack():
    """kernels.stacks: a backend with a stack kernel, every matrix at most STACK_MAX_ELEMENTS, and the backend's own
    batches() for the matrix; the torch backend's batches() is its rule's static parts (so on CPUs where oneDNN takes
    bf16 matmuls the bitwise backend stacks nothing)."""
    cfg = CONFIGS["keller"]
    assert stacks(STACKING, matrix_layout((6, 10)), torch.float32, CPU, cfg)
    side = int(STACK_MAX_ELEMENTS**0.5)
    assert stacks(STACKING, matrix_layout((side, side)), torch.float32, CPU, cfg)
    assert not stacks(STACKING, matrix_layout((side + 1, side)), torch.float32, CPU, cfg)
    never = dataclasses.replace(STACKING, batches=lambda *a: False)
    assert not stacks(never, matrix_layout((6, 10)), torch.float32, CPU, cfg)
    from muon_dist.kernels import reference

    torch_backend = backend("torch")
    assert stacks(
        torch_backend, matrix_layout((16, 32)), torch.float32, CPU, cfg
    ) == reference.in_rule((2, 16, 32), torch.float32, CPU, **cfg.ns_kwargs())


def test_negative_control_a_stack_kernel_that_mixes_matrices_is_caught():
    """A planted stack kernel that normalises every matrix by the first one's norm (a stack-wide decision, as a
    kernel sharing one scale across a megabatch would): the stacked calls then differ from each call's own result."""

    def coupled(S, cfg):
        scale = S[0].float().norm() / S.float().flatten(1).norm(dim=1).clamp_min(1e-12)
        return backend("torch").stack(S * scale[:, None, None].to(S.dtype), cfg)

    planted = Backend(
        "torch", backend("torch").orthogonalize, True, True, stack=coupled, batches=always
    )
    calls = calls_of([("matrix", "keller", 1), ("matrix", "keller", 2)], torch.float32)
    calls[1] = (calls[1][0] * 1e-3, calls[1][1], calls[1][2])  # another norm than the first's
    got = orthogonalize_many(planted, calls)
    assert not torch.equal(got[1], planted.orthogonalize(*calls[1]))


# the "batched" backend: muon_dist/kernels/batched.py's contract

BATCHED_DIFFERENCE = {torch.float32: 1e-5, torch.float16: 8e-3, torch.bfloat16: 2.0**-6}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("schedule", ["keller", "you5", "polar_express"])
def test_the_batched_backend_is_within_its_difference_and_muon_refs_bf16_bands(schedule, dtype):
    """batched.py's contract on the first 8 contract inputs of every kind: max |difference| from muon_ref within the
    bound, and in bf16 the signed singular values within muon_ref's own band on the same inputs, 2 ulps wider."""
    cfg = MuonConfig(schedule=schedule, ns_dtype=dtype)
    for kind in KINDS:
        r = measure("batched", cfg, kind, range(8), 64, CPU)
        assert r["difference"] <= BATCHED_DIFFERENCE[dtype], (kind, r)
        if dtype == torch.bfloat16:
            assert within((r["ref_low"], r["ref_high"]), r["low"], r["high"], 2 * BF16_ULP), (
                kind,
                r,
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_matrix_inside_a_stack_of_others_is_within_the_batched_contract(dtype):
    """Per matrix, whatever else the stack holds: each of the contract's inputs alone and stacked with the others of
    its shape (the step's stacks change from step to step), against muon_ref.newton_schulz."""
    cfg = MuonConfig(schedule="polar_express", ns_dtype=dtype)
    inputs = [
        contract_inputs(kind, seed, 48) for kind in KINDS for seed in range(3)
    ]  # [k, m, n], two shapes
    calls = [(G, matrix_layout(tuple(G.shape)), cfg) for G in inputs]
    stacked = orthogonalize_many(backend("batched"), calls)
    for (G, layout, _), got in zip(calls, stacked):
        want = newton_schulz(G, **cfg.ns_kwargs())
        alone = backend("batched").orthogonalize(G, layout, cfg)
        for result in (got, alone):
            assert float((result.double() - want.double()).abs().max()) <= BATCHED_DIFFERENCE[dtype]


def test_a_config_the_batched_kernel_does_not_implement_runs_muon_refs_kernel_bitwise():
    """step_form "keller" and the AOL preconditioner: newton_schulz itself (no batched product)."""
    G = torch.randn(3, 8, 20, generator=torch.Generator().manual_seed(0))
    for cfg in (MuonConfig(step_form="keller"), MuonConfig(schedule="aol")):
        got = backend("batched").orthogonalize(G, matrix_layout(tuple(G.shape)), cfg)
        assert torch.equal(got, newton_schulz(G, **cfg.ns_kwargs()))


def test_negative_control_another_algorithm_is_outside_the_batched_bound():
    """The bound can fail: the gram backend (Gram Newton-Schulz, a restart) on the same inputs is far outside it."""
    cfg = MuonConfig(schedule="polar_express_dao", ns_dtype=torch.bfloat16)
    worst = max(measure("gram", cfg, kind, range(8), 64, CPU)["difference"] for kind in KINDS)
    assert worst > BATCHED_DIFFERENCE[torch.bfloat16]
