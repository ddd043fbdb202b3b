"""Gram Newton-Schulz: muon_ref.gram_newton_schulz (the reference) and muon_dist.kernels.gram_ns (batched), each
test one property of their contracts; also muon_ref's public option resolver and stack normalisation they use."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import muon_ref.gram
from muon_check.fixtures import same_bits
from muon_dist.kernels.gram_ns import gram_newton_schulz_batched
from muon_dist.kernels.reference import onednn_takes
from muon_ref import (
    DAO_RESTARTS,
    SCHEDULES,
    gram_newton_schulz,
    newton_schulz,
    normalise,
    resolve_ns_options,
    restart_segments,
    signed_singular_values,
)
from tests.conftest import examples

dims = st.integers(1, 24)
F64 = dict(dtype=torch.float64)
# schedules normalised by the Frobenius norm (gram_newton_schulz refuses the AOL preconditioner)
FROBENIUS = sorted(name for name, s in SCHEDULES.items() if s.precondition is None)
# docs/schedules.md, "Gram Newton-Schulz": float64 gap to newton_schulz measured <= 2.4e-11 over 18,000 random cases (shapes
# up to 24 x 24, every Frobenius schedule, random restarts; largest for cans and deepseekv4 near-singular squares)
F64_IDENTITY_ATOL = 1e-9
# signed singular values of bf16 Gram NS (defaults) on Gaussians with aspect 2..8: measured [0.826, 1.188] over
# 1,500 cases (newton_schulz: [0.833, 1.126]); margin 4 bf16 ulps of 1 (2^-7 each) on both sides
BF16_BAND = (0.80, 1.22)
# muon_dist/kernels/gram_ns.py docstring: float32 gap to the reference measured <= 6.1e-5 over 7,000 stacks
BATCHED_F32_ATOL = 2e-4
# the same, bfloat16 with min(m, n) < 8 (ATen's small-matrix loop): measured <= 2.3e-2, 3 ulps of 1 (2^-7 each)
BATCHED_SMALL_BF16_ATOL = 2.0**-4


def gaussian(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def restarts_for(name: str, picks: list[bool]) -> tuple[int, ...]:
    """A restart after step r for each True among the first k - 1 picks (k: the schedule's default steps)."""
    k = len(SCHEDULES[name].steps_for())
    return tuple(r for r, pick in zip(range(1, k), picks) if pick)


def identity_gap(G: torch.Tensor, name: str, restarts: tuple[int, ...]) -> float:
    """max |gram_newton_schulz - newton_schulz| in float64, same schedule, eps and eps_mode."""
    got = gram_newton_schulz(G, name, restarts=restarts, **F64)
    return float((got - newton_schulz(G, name, eps_mode="add", **F64)).abs().max())


# muon_ref.resolve_ns_options and muon_ref.normalise: the public pieces fast kernels use


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_resolve_ns_options_takes_each_unset_option_from_the_schedule(name):
    sched = SCHEDULES[name]
    options = resolve_ns_options(name)
    assert options.coefficients == sched.steps_for()
    assert options.eps == (
        sched.eps if sched.eps is not None else 1e-7
    )  # DEFAULT_EPS, torch/optim/_muon.py
    assert (options.safety, options.precondition) == (sched.safety, sched.precondition)
    override = resolve_ns_options(name, None, 0.0, 2.0, "none")
    assert (override.eps, override.safety, override.precondition) == (0.0, 2.0, None)
    with pytest.raises(ValueError, match="precondition"):
        resolve_ns_options(name, precondition="turbo")


@pytest.mark.parametrize(
    "eps, safety, match",
    [
        (-1e-7, None, "eps"),
        (float("nan"), None, "eps"),
        (None, 0.0, "safety"),
        (None, float("inf"), "safety"),
    ],
)
def test_resolve_ns_options_refuses_a_negative_eps_and_a_safety_that_is_not_positive(
    eps, safety, match
):
    with pytest.raises(ValueError, match=match):
        resolve_ns_options("keller", eps=eps, safety=safety)


@settings(max_examples=examples(0.5))
@given(
    batch=st.integers(1, 4),
    m=dims,
    n=dims,
    transposed=st.booleans(),
    eps_mode=st.sampled_from(["add", "clamp"]),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_normalise_of_a_stack_equals_each_matrix_normalised_on_its_own_bitwise(
    batch, m, n, transposed, eps_mode, dtype, seed
):
    stack = gaussian((batch, m, n), seed, dtype)
    X = stack.mT if transposed else stack
    want = torch.stack([normalise(X[i], 1e-7, eps_mode, 1.05) for i in range(batch)])
    assert same_bits(normalise(X, 1e-7, eps_mode, 1.05), want)


# muon_ref.gram_newton_schulz: the exact identity with newton_schulz (proofs/newton_schulz.md#gram)


@example(
    name="cans", m=9, n=3, picks=[True, False, False, False], seed=32742
)  # 2.4e-11, the largest seen
@settings(max_examples=examples(1.0))
@given(
    name=st.sampled_from(FROBENIUS),
    m=dims,
    n=dims,
    picks=st.lists(st.booleans(), min_size=9, max_size=9),
    seed=st.integers(0, 2**16),
)
def test_gram_newton_schulz_equals_newton_schulz_in_float64_for_every_restart_schedule(
    name, m, n, picks, seed
):
    assert (
        identity_gap(gaussian((m, n), seed, torch.float64), name, restarts_for(name, picks))
        <= F64_IDENTITY_ATOL
    )


def test_updating_the_gram_as_p_a_instead_of_p_a_p_fails_the_identity_check(monkeypatch):
    monkeypatch.setattr(
        muon_ref.gram, "gram_update", lambda A, Z, a: torch.addmm(A, A, Z, beta=a)
    )  # A P only
    G = gaussian((16, 48), 0, torch.float64)
    # seed 0 verified: 1.1e30 apart (each Gram eigenvalue r becomes r z, not r z^2, and keeps growing)
    assert identity_gap(G, "polar_express_dao", DAO_RESTARTS) > 1e-2


@settings(max_examples=examples(0.5))
@given(
    name=st.sampled_from(FROBENIUS),
    m=dims,
    n=dims,
    eps_mode=st.sampled_from(["add", "clamp"]),
    before=st.booleans(),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_restarting_after_every_step_is_newton_schulz_in_addmm_form_bitwise(
    name, m, n, eps_mode, before, dtype, seed
):
    G = gaussian((m, n), seed)
    every_step = range(1, len(SCHEDULES[name].steps_for()))
    options = dict(dtype=dtype, eps_mode=eps_mode, normalize_before_cast=before)
    got = gram_newton_schulz(G, name, restarts=every_step, **options)
    assert same_bits(got, newton_schulz(G, name, step_form="addmm", **options))


def test_the_bitwise_check_tells_apart_a_step_form_that_is_the_same_map():
    G = gaussian((12, 20), 0)
    got = gram_newton_schulz(G, "keller", restarts=range(1, 5), eps_mode="clamp")
    assert not same_bits(
        got, newton_schulz(G, "keller", step_form="keller")
    )  # seed 0 verified: 2.7e-2 apart


# muon_ref.gram_newton_schulz: behaves as newton_schulz on the edges


@pytest.mark.parametrize("eps", [0.0, 1e-7])
@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (3, 7, 7)])
def test_a_zero_matrix_maps_to_zero_never_nan(shape, eps):
    out = gram_newton_schulz(torch.zeros(shape), eps=eps)
    assert torch.equal(out, torch.zeros_like(out))


@given(m=dims, n=dims, seed=st.integers(0, 2**16))
def test_zero_steps_return_newton_schulzs_normalised_input_bitwise(m, n, seed):
    G = gaussian((m, n), seed)
    assert same_bits(
        gram_newton_schulz(G, "keller", steps=0),
        newton_schulz(G, "keller", steps=0, eps_mode="add"),
    )


@example(m=5, n=3, seed=0)
@given(m=dims, n=dims, seed=st.integers(0, 2**16))
def test_transposing_the_input_transposes_the_output_bitwise_for_non_square_matrices(m, n, seed):
    if m == n:  # a square matrix is never transposed inside (proofs/newton_schulz.md#transpose)
        return
    G = gaussian((m, n), seed)
    assert same_bits(gram_newton_schulz(G.mT), gram_newton_schulz(G).mT)


def test_leading_dims_are_independent_matrices_bitwise():
    G = gaussian((2, 3, 7, 5), 0)
    out = gram_newton_schulz(G)
    assert all(
        same_bits(out[i, j], gram_newton_schulz(G[i, j])) for i in range(2) for j in range(3)
    )


def test_the_input_is_never_written():
    G = gaussian(
        (9, 4), 0, torch.bfloat16
    )  # bf16: the cast is a no-op, an in-place op would write G
    before = G.clone()
    gram_newton_schulz(G)
    assert torch.equal(G, before)


@pytest.mark.parametrize("shape", [(2, 0, 3), (0, 4, 3), (0, 5), (4, 0)])
def test_empty_matrices_and_empty_stacks_map_to_empty_outputs(shape):
    for kernel in (gram_newton_schulz, gram_newton_schulz_batched):
        out = kernel(torch.zeros(shape))
        assert out.shape == shape and out.dtype == torch.bfloat16


def test_restarts_split_the_steps_and_a_restart_after_the_last_step_changes_nothing():
    assert restart_segments(5, (2,)) == ((0, 2), (2, 5))
    assert restart_segments(5, (3, 1, 3, 5, 9)) == ((0, 1), (1, 3), (3, 5))
    assert restart_segments(0, DAO_RESTARTS) == ()
    G = gaussian((6, 20), 0)
    assert same_bits(
        gram_newton_schulz(G, restarts=(2, 5, 7)), gram_newton_schulz(G, restarts=(2,))
    )


def test_bad_arguments_raise_value_errors_naming_them():
    for kernel in (gram_newton_schulz, gram_newton_schulz_batched):
        with pytest.raises(ValueError, match="shape"):
            kernel(torch.zeros(5))
        with pytest.raises(ValueError, match="dtype"):
            kernel(torch.zeros(3, 3, dtype=torch.int64))
        with pytest.raises(ValueError, match="eps_mode"):
            kernel(torch.zeros(3, 3), eps_mode="max")
        with pytest.raises(ValueError, match="restarts"):
            kernel(torch.zeros(3, 3), restarts=(0, 2))
        with pytest.raises(ValueError, match="preconditioner"):
            kernel(torch.zeros(3, 3), "aol")
        with pytest.raises(ValueError, match="exactly 5 steps"):
            kernel(torch.zeros(3, 3), steps=6)


# muon_ref.gram_newton_schulz: measured bf16 behaviour against the exact polar factor


@settings(max_examples=examples(0.5))
@given(
    m=st.integers(4, 32), aspect=st.floats(2.0, 8.0), tall=st.booleans(), seed=st.integers(0, 2**16)
)
def test_bf16_singular_values_of_gaussians_stay_inside_the_measured_band(m, aspect, tall, seed):
    n = max(m + 1, round(m * aspect))
    G = gaussian((n, m) if tall else (m, n), seed)
    d = signed_singular_values(gram_newton_schulz(G), G)
    assert BF16_BAND[0] <= float(d.min()) and float(d.max()) <= BF16_BAND[1]


def test_bf16_without_restarts_leaves_the_band_on_a_low_rank_input():
    G = gaussian((32, 4), 0) @ gaussian(
        (4, 128), 1
    )  # rank 4: the Gram's null space is bf16 rounding noise
    d = signed_singular_values(gram_newton_schulz(G, restarts=()), G)
    assert (
        float(d.abs().max()) > 10 * BF16_BAND[1]
    )  # seeds 0, 1 verified: 1.1e7; restart after step 2: 1.13


# muon_dist.kernels.gram_ns: the batched tier against the reference


@settings(max_examples=examples(0.5))
@given(
    batch=st.integers(1, 4),
    m=st.integers(1, 32),
    n=st.integers(1, 32),
    name=st.sampled_from(["polar_express_dao", "you5"]),
    seed=st.integers(0, 2**16),
)
def test_batched_float32_is_within_the_measured_tolerance_of_the_reference(batch, m, n, name, seed):
    G = gaussian((batch, m, n), seed)
    got = gram_newton_schulz_batched(G, name, dtype=torch.float32)
    want = gram_newton_schulz(G, name, dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=0, atol=BATCHED_F32_ATOL)


@settings(max_examples=examples(0.25))
@given(
    leading=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    m=st.integers(8, 20),
    n=st.integers(8, 20),
    restarts=st.sampled_from([(), DAO_RESTARTS, (1, 3)]),
    seed=st.integers(0, 2**16),
)
# a stack whose batched bf16 products round otherwise where oneDNN takes them (an Intel Xeon with AMX)
@example(leading=[2], m=20, n=16, restarts=(), seed=466)
# torch's mkldnn.flags() warns of TF32 on CPU builds
@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
def test_batched_bfloat16_equals_the_reference_bitwise_from_eight_rows_and_columns_where_aten_runs_them(
    leading, m, n, restarts, seed
):
    """Contract 1 of muon_dist/kernels/gram_ns.py, bf16 with min(m, n) >= 8: bitwise where ATen's own kernel runs
    the bf16 products (one addmm_ per matrix, the reference's call): with oneDNN off on every CPU, and as the
    process comes where oneDNN does not take bf16 matmuls; where it does, its batched and single products round
    some inputs otherwise (the example: 0.033 at most over the module's 1,235 such stacks on an Intel Xeon with
    AMX), and the kernel is held to the small stacks' bound."""
    G = gaussian((*leading, m, n), seed)
    with torch.backends.mkldnn.flags(
        enabled=False, deterministic=torch.backends.mkldnn.deterministic
    ):
        assert same_bits(
            gram_newton_schulz_batched(G, restarts=restarts),
            gram_newton_schulz(G, restarts=restarts),
        )
    got, want = (
        gram_newton_schulz_batched(G, restarts=restarts),
        gram_newton_schulz(G, restarts=restarts),
    )
    if onednn_takes(torch.bfloat16):
        torch.testing.assert_close(got, want, rtol=0, atol=BATCHED_SMALL_BF16_ATOL)
    else:
        assert same_bits(got, want)


@settings(max_examples=examples(0.25))
@given(
    batch=st.integers(1, 4),
    short=st.integers(1, 7),
    long=st.integers(1, 32),
    tall=st.booleans(),
    restarts=st.sampled_from([(), DAO_RESTARTS, (1, 3)]),
    seed=st.integers(0, 2**16),
)
def test_batched_bfloat16_is_within_the_measured_tolerance_below_eight_rows_or_columns(
    batch, short, long, tall, restarts, seed
):
    G = gaussian((batch, long, short) if tall else (batch, short, long), seed)
    got, want = (
        gram_newton_schulz_batched(G, restarts=restarts),
        gram_newton_schulz(G, restarts=restarts),
    )
    torch.testing.assert_close(got, want, rtol=0, atol=BATCHED_SMALL_BF16_ATOL)


def test_batched_float32_is_not_bitwise_on_small_matrices_on_this_cpu():
    # ATen's baddbmm loops in its own kernel below m * m * m < 400 (aten/src/ATen/native/LinearAlgebra.cpp)
    G = gaussian((3, 5, 10), 0)
    got = gram_newton_schulz_batched(G, dtype=torch.float32)
    assert not same_bits(
        got, gram_newton_schulz(G, dtype=torch.float32)
    )  # seed 0 verified: 2.0e-5 apart
