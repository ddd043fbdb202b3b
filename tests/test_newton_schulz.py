"""Newton-Schulz properties: each test is one property of muon_ref.newton_schulz, with its contract."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from muon_check.fixtures import same_bits
from muon_ref import (
    SCHEDULES,
    newton_schulz,
    polar_error,
    schedule_band,
    signed_singular_values,
)
from tests.conftest import examples

dims = st.integers(1, 24)
F64 = dict(dtype=torch.float64)


def gaussian(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@example(m=5, n=3, seed=0)
@given(m=dims, n=dims, seed=st.integers(0, 2**16))
def test_transposing_the_input_transposes_the_output_bitwise_for_non_square_matrices(m, n, seed):
    if m == n:  # a square matrix is never transposed inside; covered in float64 below
        return
    G = gaussian((m, n), seed)
    assert torch.equal(newton_schulz(G.mT), newton_schulz(G).mT)


@given(n=dims, seed=st.integers(0, 2**16))
def test_square_transpose_equivariance_holds_in_float64_to_rounding(n, seed):
    # bf16 differs by up to 1.2e-2 here (conventions.md): the product order differs, not the math
    G = gaussian((n, n), seed, torch.float64)
    torch.testing.assert_close(
        newton_schulz(G.mT, **F64), newton_schulz(G, **F64).mT, rtol=0, atol=1e-12
    )


@given(
    m=dims,
    n=dims,
    zero_rows=st.integers(0, 4),
    zero_cols=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_zero_rows_and_columns_stay_zero_and_leave_the_rest_unchanged(
    m, n, zero_rows, zero_cols, seed
):
    G = gaussian((m, n), seed, torch.float64)
    padded = torch.zeros(m + zero_rows, n + zero_cols, dtype=torch.float64)
    padded[:m, :n] = G
    out = newton_schulz(padded, **F64)
    assert (
        torch.count_nonzero(out[m:, :]) == 0 and torch.count_nonzero(out[:, n:]) == 0
    )  # exactly zero
    # the rest agrees to rounding; the transpose decision may differ between the two shapes
    torch.testing.assert_close(out[:m, :n], newton_schulz(G, **F64), rtol=0, atol=1e-10)


@given(m=dims, n=dims, seed=st.integers(0, 2**16))
def test_orthogonal_invariance_holds_in_float64(m, n, seed):
    # NS(Q G R) = Q NS(G) R exactly in real arithmetic; float64 rounding of the extra products: 1e-10
    G = gaussian((m, n), seed, torch.float64)
    Q, _ = torch.linalg.qr(gaussian((m, m), seed + 1, torch.float64))
    R, _ = torch.linalg.qr(gaussian((n, n), seed + 2, torch.float64))
    torch.testing.assert_close(
        newton_schulz(Q @ G @ R, **F64), Q @ newton_schulz(G, **F64) @ R, rtol=0, atol=1e-10
    )


@given(m=dims, n=dims, seed=st.integers(0, 2**16), power=st.integers(-20, 20))
def test_scaling_by_a_power_of_two_leaves_the_output_bitwise_unchanged_with_eps_zero(
    m, n, seed, power
):
    G = gaussian((m, n), seed)
    assert torch.equal(newton_schulz(G * 2.0**power, eps=0.0), newton_schulz(G, eps=0.0))


@given(m=dims, n=dims, seed=st.integers(0, 2**16), scale=st.floats(1e-3, 1e3))
def test_scale_invariance_holds_in_float64_with_eps_zero(m, n, seed, scale):
    G = gaussian((m, n), seed, torch.float64)
    torch.testing.assert_close(
        newton_schulz(G * scale, eps=0.0, **F64),
        newton_schulz(G, eps=0.0, **F64),
        rtol=0,
        atol=1e-12,
    )


@settings(max_examples=20)
@given(
    name=st.sampled_from(sorted(SCHEDULES)),
    m=st.integers(2, 16),
    n=st.integers(2, 16),
    seed=st.integers(0, 2**16),
)
def test_float64_singular_values_lie_inside_the_schedules_exact_band(name, m, n, seed):
    G = gaussian((m, n), seed, torch.float64)
    if (
        SCHEDULES[name].precondition is not None
    ):  # AOL rescales rows, not by ||G||_F: the band is for its input
        return
    sched = SCHEDULES[name]
    safety = sched.safety
    s = torch.linalg.svdvals(G)
    lower = float(s.min() / (s.square().sum().sqrt() * safety))
    band = schedule_band(name, lower, 1.0 / safety)
    d = signed_singular_values(newton_schulz(G, name, eps=0.0, **F64), G)
    assert float(d.min()) >= band.min - 1e-9 and float(d.max()) <= band.max + 1e-9


@pytest.mark.parametrize("name, steps", [("polar_express", 12), ("quintic", 30), ("cubic", 60)])
def test_float64_newton_schulz_with_a_converging_schedule_approaches_the_polar_factor(name, steps):
    G = gaussian((24, 16), 0, torch.float64) + 3 * torch.eye(
        24, 16, dtype=torch.float64
    )  # condition ~ 5
    assert polar_error(newton_schulz(G, name, steps=steps, **F64), G) < 1e-9


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("eps", [0.0, 1e-7])
def test_a_zero_matrix_maps_to_zero_never_nan(name, eps):
    out = newton_schulz(torch.zeros(3, 6, 5), name, eps=eps)
    assert out.shape == (3, 6, 5) and torch.count_nonzero(out) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("eps_mode", ["add", "clamp"])
@pytest.mark.parametrize("eps", [1e-15, 1e-30, 1e-7])
def test_a_zero_matrix_maps_to_zero_when_eps_rounds_to_zero_in_the_compute_dtype(
    dtype, eps_mode, eps
):
    # regression (found by notebooks/ns_numerics.py): 1e-15 is 0 in fp16, so d = 0 for a zero matrix although
    # eps > 0; the zero guard must depend on eps in the compute dtype, not on eps == 0
    out = newton_schulz(torch.zeros(6, 5), "polar_express", eps=eps, eps_mode=eps_mode, dtype=dtype)
    assert torch.count_nonzero(out) == 0 and bool(torch.isfinite(out).all())


def test_leading_dims_are_independent_matrices_bitwise():
    G = gaussian((2, 3, 7, 5), 0)
    out = newton_schulz(G)
    for i in range(2):
        for j in range(3):
            assert torch.equal(out[i, j], newton_schulz(G[i, j]))


def _batched_restatement(G, coefficients, step_form, eps=1e-7):
    """The kernel on a [B, m, n] stack as one batch, written out with torch's batched ops alone (no muon_ref code):
    bf16, each matrix's norm clamped at eps, one transposition for the stack, then each step's batched products."""
    X = G.to(torch.bfloat16)
    tall = X.size(-2) > X.size(-1)
    X = X.mT if tall else X
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for a, b, c in coefficients:
        A = X @ X.mT
        if step_form == "addmm":
            X = torch.baddbmm(X, torch.baddbmm(A, A, A, beta=b, alpha=c), X, beta=a)
        else:
            B = b * A + c * A @ A if step_form == "keller" else b * A + c * (A @ A)
            X = a * X + B @ X
    return X.mT if tall else X


KELLER5 = SCHEDULES["keller"].steps_for(None)


def _memory_order(t):
    """The strides of the dims that have more than one element (a dim of one element has any stride)."""
    return tuple(stride for stride, size in zip(t.stride(), t.shape) if size > 1)


@example(B=3, m=2, n=34, seed=0, step_form="keller")
@example(B=2, m=37, n=6, seed=0, step_form="addmm")
@example(
    B=1, m=3, n=2, seed=0, step_form="addmm"
)  # a stack of one: its dim 0 has any stride (thorough profile)
@settings(max_examples=examples(0.5))
@given(
    B=st.integers(1, 4),
    m=dims,
    n=dims,
    seed=st.integers(0, 2**16),
    step_form=st.sampled_from(["addmm", "keller", "dion"]),
)
def test_a_batched_stack_is_the_kernel_on_the_whole_stack_bitwise(B, m, n, seed, step_form):
    """stack="batched": the kernel's equations on the whole [B, m, n] stack, each product one batched product, each
    matrix its own norm (the restatement above, as an origin writes it on a 3-D tensor), bit for bit and in its
    memory order. The per-matrix default keeps each matrix's bits those of the matrix alone on any stack."""
    G = gaussian((B, m, n), seed)
    batched = newton_schulz(G, step_form=step_form, stack="batched")
    want = _batched_restatement(G, KELLER5, step_form)
    assert same_bits(batched, want) and _memory_order(batched) == _memory_order(want)
    per_matrix = newton_schulz(G, step_form=step_form)
    assert all(
        torch.equal(per_matrix[i], newton_schulz(G[i], step_form=step_form)) for i in range(B)
    )
    # equal values: a batched product rounds some inputs otherwise, never by more than bf16's rounding grows
    torch.testing.assert_close(batched.float(), per_matrix.float(), atol=0.1, rtol=0)


def test_the_batched_restatement_tells_each_step_form_from_the_others():
    """Control for the test above: the restatement is not vacuous; under each step form, the restatement of another
    step form differs from stack="batched" on some stack of these (the forms group their products otherwise)."""
    stacks = [gaussian((3, 8, 16), seed) for seed in range(8)]
    for form in ("addmm", "keller", "dion"):
        for other in {"addmm", "keller", "dion"} - {form}:
            assert any(
                not same_bits(
                    newton_schulz(G, step_form=form, stack="batched"),
                    _batched_restatement(G, KELLER5, other),
                )
                for G in stacks
            ), (form, other)


@pytest.mark.parametrize("shape", [(6, 5), (2, 0, 3), (0, 4, 3)])
def test_a_matrix_and_an_empty_stack_are_the_same_batched_or_not(shape):
    """No stack to batch: the per-matrix code runs (a stack of one is a batched product of one, which a backend may
    round otherwise than the single product: not asserted)."""
    G = gaussian(shape, 0)
    assert torch.equal(newton_schulz(G, stack="batched"), newton_schulz(G))


def test_the_input_is_never_written():
    for form in ("addmm", "keller", "dion"):
        G = gaussian(
            (9, 4), 0, torch.bfloat16
        )  # bf16: the cast is a no-op, an in-place op would write G
        before = G.clone()
        newton_schulz(G, step_form=form)
        assert torch.equal(G, before)


def test_aol_preconditioning_replaces_normalisation_and_stays_bounded():
    G = gaussian((32, 16), 0, torch.float64) * 1e3  # no Frobenius normalisation: AOL must bound it
    out = newton_schulz(G, "aol", **F64)
    assert float(torch.linalg.matrix_norm(out, ord=2)) < 1.2


def test_bad_arguments_raise_value_errors_naming_them():
    with pytest.raises(ValueError, match="shape"):
        newton_schulz(torch.zeros(5))
    with pytest.raises(ValueError, match="dtype"):
        newton_schulz(torch.zeros(3, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="step_form"):
        newton_schulz(torch.zeros(3, 3), step_form="fused")
    with pytest.raises(ValueError, match="unknown schedule"):
        newton_schulz(torch.zeros(3, 3), "nope")
    with pytest.raises(ValueError, match="exactly 5 steps"):
        newton_schulz(torch.zeros(3, 3), "polar_express_modded", steps=6)
    with pytest.raises(
        ValueError, match=r"stack must be one of \('per_matrix', 'batched'\), got 'stacked'"
    ):
        newton_schulz(torch.zeros(2, 3, 3), stack="stacked")


@pytest.mark.parametrize("shape", [(2, 0, 3), (0, 4, 3), (0, 5), (4, 0)])
def test_empty_matrices_and_empty_stacks_map_to_empty_outputs(shape):
    out = newton_schulz(torch.zeros(shape))
    assert out.shape == shape and out.dtype == torch.bfloat16


@example(m=5, n=3, k=1, seed=0, schedule="keller", precondition=None, dtype=torch.bfloat16)
@example(
    m=1, n=1, k=1, seed=0, schedule="polar_express_paper", precondition=None, dtype=torch.bfloat16
)
@settings(max_examples=40, deadline=None)
@given(
    m=dims,
    n=dims,
    k=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    schedule=st.sampled_from(sorted(SCHEDULES)),
    precondition=st.sampled_from([None, "aol"]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
)
def test_the_input_cast_gives_the_kernel_the_same_bits_where_input_cast_names_it(
    m, n, k, seed, schedule, precondition, dtype
):
    """muon_ref.newton_schulz.input_cast: a direction cast to its dtype first gives newton_schulz's bits (what
    lets muon_dist send directions in the narrower dtype). Bits, NaN's too: `polar_express_paper`, unscaled, runs a
    rank-one input to NaN in bf16 (its schedule's note), and the cast must give the same NaN."""
    from muon_ref.newton_schulz import input_cast

    G = gaussian((k, m, n), seed)
    assert input_cast(G.dtype, dtype, False) == dtype
    kwargs = dict(schedule=schedule, dtype=dtype, precondition=precondition)
    assert same_bits(newton_schulz(G.to(dtype), **kwargs), newton_schulz(G, **kwargs))


def test_input_cast_names_no_dtype_where_the_kernel_normalises_before_casting() -> None:
    """The negative control: with normalize_before_cast the kernel reads the fp32 input itself, input_cast says
    None, and a cast first does change the bits on some input."""
    from muon_ref.newton_schulz import input_cast

    assert input_cast(torch.float32, torch.bfloat16, True) is None
    assert input_cast(torch.float32, None, False) is None
    assert input_cast(torch.bfloat16, torch.float32, False) is None  # not narrower: nothing to gain
    kwargs = dict(dtype=torch.bfloat16, normalize_before_cast=True)
    assert any(
        not torch.equal(newton_schulz(G.to(torch.bfloat16), **kwargs), newton_schulz(G, **kwargs))
        for G in (gaussian((7, 5), seed) for seed in range(20))
    )
