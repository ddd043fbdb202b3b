"""Contracts of muon_ref.newton_schulz that the rest of the suite left unchecked (found by `make mutation`: README,
"Mutation testing"): AOL's fused first step in each step form's operation order, normalise on a stack (each matrix
its own norm), eps_mode read by value, and NSOptions as an immutable value."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from muon_check.fixtures import same_bits
from muon_ref import NSOptions, newton_schulz, normalise, resolve_ns_options
from muon_ref.newton_schulz import STEP_FORMS, newton_schulz_matrix
from tests.conftest import examples

ABC = (3.4445, -4.7750, 2.0315)  # KellerJordan's quintic


def aol_first_step(X: torch.Tensor, step_form: str, eps: float) -> torch.Tensor:
    """The equation of AOL's fused first step, written out in each step form's operation order:
        A = X X^T,  s_i = 1 / sqrt(max(sum_j |A_ij|, eps)),  X' = diag(s) X,  A' = diag(s) A diag(s)
        X_1 = a X' + B X'  with  B = b A' + c A'^2 in the form's order:
            addmm   B = addmm(A', A', A', beta=b, alpha=c),  X_1 = addmm(X', B, X', beta=a)
            keller  B = b A' + (c A') @ A'           (KellerJordan/Muon's parse of c * A @ A)
            dion    B = b A' + c (A' @ A')
    (no row of these Gaussian matrices is zero, so the zero-row guard never acts)."""
    a, b, c = ABC
    A = X @ X.mT
    s = torch.rsqrt(A.abs().sum(dim=-1).clamp_min(eps))
    Xs, As = X * s[:, None], A * s[:, None] * s[None, :]
    if step_form == "addmm":
        return torch.addmm(Xs, torch.addmm(As, As, As, beta=b, alpha=c), Xs, beta=a)
    B = b * As + (c * As) @ As if step_form == "keller" else b * As + c * (As @ As)
    return a * Xs + B @ Xs


@example(step_form="keller", m=5, n=7, seed=0)
@example(step_form="dion", m=5, n=7, seed=0)
@settings(max_examples=examples(0.5))
@given(
    step_form=st.sampled_from(STEP_FORMS),
    m=st.integers(1, 9),
    n=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_aols_fused_first_step_is_its_equation_in_each_step_forms_order_bitwise(
    step_form, m, n, seed
):
    G = torch.randn(m, n, generator=torch.Generator().manual_seed(seed))
    got = newton_schulz_matrix(
        G,
        (ABC,),
        eps=1e-7,
        dtype=torch.float32,
        step_form=step_form,
        eps_mode="clamp",
        safety=1.0,
        normalize_before_cast=False,
        precondition="aol",
    )
    X = G.mT if m > n else G
    want = aol_first_step(X, step_form, 1e-7)
    assert same_bits(got, want.mT if m > n else want)


def test_the_step_forms_of_aols_first_step_are_told_apart_bitwise():
    """Negative control: keller's and dion's orders are the same map, yet this check tells them apart on the
    example above (so a swap of the two forms cannot pass it)."""
    X = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(
        aol_first_step(X, "keller", 1e-7), aol_first_step(X, "dion", 1e-7), atol=1e-5
    )
    assert not same_bits(aol_first_step(X, "keller", 1e-7), aol_first_step(X, "dion", 1e-7))


@settings(max_examples=examples(0.5))
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 6), st.integers(1, 6)),
    eps_mode=st.sampled_from(["add", "clamp"]),
    seed=st.integers(0, 2**16),
)
def test_normalise_on_a_stack_divides_each_matrix_by_its_own_norm(shape, eps_mode, seed):
    """Reference equation (normalise's docstring): X / d for each trailing matrix, d from that matrix's norm. The
    matrices are scaled apart (1, 10, 100, ...), so a norm over any other dims gives another answer; to rounding,
    since the stack's batched reduction is not promised bitwise (its docstring)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(shape, dtype=torch.float64, generator=g)
    X = X * 10.0 ** torch.arange(shape[0] * shape[1], dtype=torch.float64).reshape(
        shape[0], shape[1], 1, 1
    )
    got = normalise(X, 1e-7, eps_mode, 1.0)
    for i in range(shape[0]):
        for j in range(shape[1]):
            torch.testing.assert_close(
                got[i, j], normalise(X[i, j], 1e-7, eps_mode, 1.0), rtol=1e-12, atol=0
            )


@pytest.mark.parametrize("eps_mode", ["add", "clamp"])
def test_eps_mode_is_read_by_value_not_by_identity(eps_mode):
    """A name read from a file or a state dict is a new str object: it must select what the literal selects."""
    G = torch.zeros(3, 4)
    G[0, 0] = 1e-8  # a norm below eps: "add" and "clamp" give different X_0
    built = "".join(list(eps_mode))
    assert built == eps_mode and built is not eps_mode
    want = newton_schulz(G, eps_mode=eps_mode, dtype=torch.float32)
    assert same_bits(newton_schulz(G, eps_mode=built, dtype=torch.float32), want)
    other = "clamp" if eps_mode == "add" else "add"
    assert not same_bits(
        newton_schulz(G, eps_mode=other, dtype=torch.float32), want
    )  # the two modes differ here


def test_ns_options_are_an_immutable_value():
    """NSOptions checks itself once, at construction: a field changed afterwards would skip the check (and it is
    cached by resolve_ns_options, so a change would leak into every later call). Frozen: equal by fields, hashable,
    and assignment raises."""
    options = resolve_ns_options("keller")
    assert options == NSOptions(
        options.coefficients, options.eps, options.safety, options.precondition
    )
    assert hash(options) == hash(dataclasses.replace(options))
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.eps = -1.0  # type: ignore[misc]
    assert resolve_ns_options("keller").eps >= 0


@pytest.mark.parametrize("eps_mode", ["add", "clamp"])
@pytest.mark.parametrize("safety", [1.0, 1.05, 0.5])
def test_normalise_is_its_reference_equation_with_the_safety_factor(eps_mode, safety):
    """X / d, d = ||X||_F * safety + eps or max(||X||_F * safety, eps), on one matrix and on each of a stack."""
    gen = torch.Generator().manual_seed(3)
    X = torch.randn(3, 5, 4, generator=gen, dtype=torch.float64)
    for eps in (1e-7, 10.0):  # 10: above every norm here, so that the clamp decides
        for i in range(3):
            norm = X[i].norm() * safety
            d = norm + eps if eps_mode == "add" else norm.clamp(min=eps)
            want = X[i] / d
            torch.testing.assert_close(
                normalise(X[i], eps, eps_mode, safety), want, rtol=1e-15, atol=0
            )
            torch.testing.assert_close(
                normalise(X, eps, eps_mode, safety)[i], want, rtol=1e-15, atol=0
            )


@pytest.mark.parametrize("safety", [0.0, -1.0, float("inf"), float("nan")])
def test_a_safety_factor_that_is_not_positive_and_finite_is_refused(safety):
    """NSOptions: safety must be finite and > 0 (0, -1, inf and NaN refused by name)."""
    with pytest.raises(ValueError, match=r"^safety must be finite and > 0, got"):
        NSOptions(coefficients=((3.0, -3.0, 1.0),), eps=1e-7, safety=safety, precondition=None)


def test_precondition_none_is_read_by_value_as_a_config_file_gives_it():
    """resolve_ns_options reads precondition by value: a 'none' or 'aol' built at runtime resolves as the literals
    do."""
    from muon_ref.newton_schulz import _resolved

    _resolved.cache_clear()  # a string equal to "none" but not the interned literal
    assert resolve_ns_options("keller", precondition="".join(["no", "ne"])).precondition is None
    assert resolve_ns_options("keller", precondition="".join(["a", "ol"])).precondition == "aol"
