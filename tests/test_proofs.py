"""proofs/: the mechanical certificates pass, the proofs' index links existing tests, and the lemmas hold."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muon_ref import (
    PRESETS,
    SCHEDULES,
    MuonConfig,
    momentum_direction,
    newton_schulz,
    orthogonality_error,
    polar_error,
    scalar_map,
    schedule_band,
)
from proofs import check
from proofs.band import certified_band
from tests.conftest import examples

ROOT = Path(__file__).resolve().parent.parent
PROOFS = ROOT / "proofs"
NODE_ID = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")
F64 = dict(dtype=torch.float64)
# schedules normalised by the Frobenius norm (AOL rescales rows instead: its band is not for ||G||_F inputs)
FROBENIUS = sorted(name for name, s in SCHEDULES.items() if s.precondition is None)


def gaussian(shape, seed, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def missing_tests(text: str) -> list[str]:
    """Node ids named in text whose file does not exist or does not define the test function."""
    missing = []
    for path, name in NODE_ID.findall(text):
        file = ROOT / path
        if not file.exists() or not re.search(rf"^def {name}\(", file.read_text(), re.M):
            missing.append(f"{path}::{name}")
    return missing


def lemma_rows() -> list[tuple[str, str]]:
    """(lemma id, row) for each row of proofs/README.md's lemma tables (first cell like NS1, M2, LR1)."""
    rows = []
    for line in (PROOFS / "README.md").read_text().splitlines():
        match = re.match(r"^\|\s*([A-Z]+\d+)\s*\|", line)
        if match:
            rows.append((match.group(1), line))
    return rows


# (a), (b): the certificates


def test_the_mechanical_certificates_pass(capsys):
    assert check.main() == 0, capsys.readouterr().out


def test_a_failing_or_raising_check_makes_main_return_non_zero(capsys):
    def raises() -> list[str]:
        raise ArithmeticError("enclosure too wide")

    assert check.main([("holds", lambda: []), ("fails", lambda: ["a reason"])]) == 1
    assert check.main([("raises", raises)]) == 1
    out = capsys.readouterr().out
    assert "FAIL: a reason" in out and "FAIL: raised ArithmeticError: enclosure too wide" in out


def test_broken_schedule_claims_are_rejected_and_true_ones_accepted():
    for label, sched, claimed in check.broken_claims():
        assert check.check_schedule_claim(sched, claimed, check.LOWER), label
    assert (
        check.check_schedule_claim("keller", schedule_band("keller", check.LOWER), check.LOWER)
        == []
    )


# (c): the index


def row_problems(lemma: str, row: str) -> list[str]:
    """What is wrong with one lemma row: no proof link, a missing anchor, no test, or a test that does not exist."""
    problems = []
    proofs = re.findall(r"\(([\w./-]+\.md)#([\w-]+)\)", row)
    if not proofs:
        problems.append(f"{lemma}: no proof link")
    for file, anchor in proofs:
        path = PROOFS / file
        if not path.exists() or f'id="{anchor}"' not in path.read_text():
            problems.append(f"{lemma}: no anchor {file}#{anchor}")
    if not NODE_ID.search(row):
        problems.append(f"{lemma}: no test linked")
    problems += [f"{lemma}: {node} does not exist" for node in missing_tests(row)]
    return problems


def test_every_lemma_in_the_index_links_its_proof_and_existing_tests():
    rows = lemma_rows()
    assert len(rows) >= 14  # NS1..NS10, M1, M2, LR1, LR2
    assert [p for lemma, row in rows for p in row_problems(lemma, row)] == []


def test_the_index_check_rejects_a_lemma_without_a_test_or_with_a_missing_one():
    proof = "[newton_schulz.md#transpose](newton_schulz.md#transpose)"
    assert row_problems("X1", f"| X1 | s | {proof} | none |") == ["X1: no test linked"]
    assert row_problems(
        "X2", f"| X2 | s | {proof} | `tests/test_proofs.py::test_that_does_not_exist` |"
    )
    no_anchor = "[newton_schulz.md#no-such-lemma](newton_schulz.md#no-such-lemma)"
    assert row_problems(
        "X3", f"| X3 | s | {no_anchor} | `tests/test_proofs.py::row_problems` |"
    ) == ["X3: no anchor newton_schulz.md#no-such-lemma"]


@pytest.mark.parametrize(
    "file", ["newton_schulz.md", "momentum.md", "lr_scale.md", "sharding.md", "paths.md"]
)
def test_every_anchored_section_has_a_checked_by_line_naming_existing_tests(file):
    sections = re.split(r'(?=<a id=")', (PROOFS / file).read_text())[1:]
    assert sections
    for section in sections:
        anchor = re.match(r'<a id="([\w-]+)"', section).group(1)
        checked = [line for line in section.splitlines() if line.startswith("Checked by:")]
        assert checked and NODE_ID.search(section), f"{file}#{anchor}: no Checked by line"
        assert missing_tests(section) == [], f"{file}#{anchor}"


def test_the_lr_scale_table_is_muon_refs_formula_table():
    assert check.check_lr_scale_table() == []


def test_math_sqrt_is_correctly_rounded_and_pow_is_one_ulp_off_at_145_over_9():
    assert check.check_sqrt_vs_pow() == []


# proofs/newton_schulz.md


@settings(max_examples=examples(0.5))
@given(
    name=st.sampled_from(FROBENIUS),
    m=st.integers(1, 12),
    n=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_newton_schulz_acts_on_each_singular_value_through_the_scalar_map(name, m, n, seed):
    G = gaussian((m, n), seed)
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    out = newton_schulz(G, name, eps=0.0, **F64)
    safety = SCHEDULES[name].safety
    f = scalar_map(name, S / (S.square().sum().sqrt() * safety))
    # U^T NS(G) V = f(S / d): diagonal (off-diagonal 0); float64 rounding through <= 10 steps: 1e-9
    torch.testing.assert_close(U.mT @ out @ Vh.mT, torch.diag(f), rtol=0, atol=1e-9)


@given(
    m=st.integers(1, 12), n=st.integers(1, 12), rank=st.integers(1, 12), seed=st.integers(0, 2**16)
)
def test_frobenius_normalisation_puts_the_largest_singular_value_between_one_over_sqrt_rank_and_one(
    m, n, rank, seed
):
    r = min(rank, m, n)
    G = gaussian((m, r), seed) @ gaussian((r, n), seed + 1)
    s = torch.linalg.svdvals(G)
    top = float(s[0] / G.norm())
    assert (1 / r**0.5) * (1 - 1e-12) <= top <= 1 + 1e-12


@settings(max_examples=examples(0.5))
@given(
    name=st.sampled_from(FROBENIUS),
    m=st.integers(2, 12),
    n=st.integers(2, 12),
    seed=st.integers(0, 2**16),
)
def test_polar_and_orthogonality_errors_are_read_off_the_scalar_map(name, m, n, seed):
    G = gaussian((m, n), seed)  # full rank almost surely
    S = torch.linalg.svdvals(G)
    f = scalar_map(name, S / (S.square().sum().sqrt() * SCHEDULES[name].safety))
    out = newton_schulz(G, name, eps=0.0, **F64)
    assert polar_error(out, G) == pytest.approx(float((f - 1).abs().max()), abs=1e-9)
    assert orthogonality_error(out) == pytest.approx(float((f.square() - 1).abs().max()), abs=1e-9)


@settings(max_examples=examples(0.25))
@given(name=st.sampled_from(sorted(SCHEDULES)))
def test_the_sampled_scalar_map_fills_the_certified_band(name):
    enc = certified_band(name, check.LOWER)
    ys = scalar_map(name, torch.linspace(check.LOWER, 1.0, 200_001, dtype=torch.float64))
    lo, hi = float(ys.min()), float(ys.max())
    assert (
        float(enc.m_lo) - 1e-12 <= lo and hi <= float(enc.M_hi) + 1e-12
    )  # inside (float rounding: 1e-12)
    assert (
        lo - float(enc.m_hi) < 1e-3 and float(enc.M_lo) - hi < 1e-3
    )  # and reaching its ends (grid 5e-6)


@settings(max_examples=examples(0.5))
@given(
    m=st.integers(1, 10),
    n=st.integers(1, 10),
    rows=st.integers(0, 3),
    cols=st.integers(0, 3),
    form=st.sampled_from(["addmm", "keller", "dion"]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_padding_stays_exactly_zero_in_every_step_form_and_dtype(
    m, n, rows, cols, form, dtype, seed
):
    padded = torch.zeros(m + rows, n + cols)
    padded[:m, :n] = gaussian((m, n), seed, torch.float32)
    out = newton_schulz(padded, step_form=form, dtype=dtype)
    assert torch.count_nonzero(out[m:, :]) == 0 and torch.count_nonzero(out[:, n:]) == 0


def test_padding_that_flips_the_transpose_decision_keeps_the_math_but_not_the_bits():
    # (29, 30) padded to (32, 30): Dion's uneven shard on 4 ranks (docs/conventions.md)
    G = gaussian((29, 30), 0)
    padded = torch.cat([G, torch.zeros(3, 30, dtype=torch.float64)])
    torch.testing.assert_close(
        newton_schulz(padded, **F64)[:29], newton_schulz(G, **F64), rtol=0, atol=1e-12
    )
    bf16 = newton_schulz(padded.float())
    assert torch.count_nonzero(bf16[29:]) == 0
    assert not torch.equal(
        bf16[:29], newton_schulz(G.float())
    )  # seed 0 verified: differs by up to 1.7e-2


# proofs/momentum.md

EMA_SUM_PAIRS = [
    ("torch", "moonlight"),
    ("emerging", "dion"),
]  # (EMA, sum) presets: with Nesterov, then without


def directions(preset: str, grads: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """NS of each step's momentum direction under the preset's momentum convention, one shared kernel."""
    cfg = MuonConfig(**PRESETS[preset])
    buf, out = torch.zeros_like(grads[0]), []
    for g in grads:
        buf, d = momentum_direction(g, buf, cfg)
        out.append(newton_schulz(d, "keller", eps=0.0, dtype=dtype))
    return out


@pytest.mark.parametrize("ema, total", EMA_SUM_PAIRS)
def test_ema_and_sum_presets_give_the_same_direction_in_float64_with_eps_zero(ema, total):
    grads = [gaussian((16, 8), seed) for seed in range(5)]
    for a, b in zip(directions(ema, grads, torch.float64), directions(total, grads, torch.float64)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)  # measured: <= 2e-15


@pytest.mark.parametrize("ema, total", EMA_SUM_PAIRS)
def test_ema_and_sum_presets_differ_in_bf16_bits(ema, total):
    grads = [gaussian((16, 8), seed, torch.float32) for seed in range(5)]
    # seed 0..4 verified: not bitwise on any of the 5 steps (max difference 2.3e-2); shown, not a bound
    a, b = directions(ema, grads, torch.bfloat16), directions(total, grads, torch.bfloat16)
    assert not any(torch.equal(x, y) for x, y in zip(a, b))


def test_the_exact_ema_sum_identity_holds_and_its_controls_fail():
    assert check.check_momentum_identity() == []


@pytest.mark.parametrize("eps_mode", ["add", "clamp"])
def test_eps_separates_ema_from_sum_only_where_it_is_not_negligible_against_the_norm(eps_mode):
    mu, eps = 0.95, 1e-7
    D = (
        gaussian((16, 8), 0) * 1e-7
    )  # ||D||_F = 1.15e-6: eps = 1e-7 is not negligible, and > (1 - mu) ||D||_F

    def ns(x):
        return newton_schulz(x, "keller", eps=eps, eps_mode=eps_mode, **F64)

    far = (ns((1 - mu) * D) - ns(D)).abs().max()
    assert far > 1e-3  # measured: 0.17 (add), 0.30 (clamp)
    big = D * 1e9  # (1 - mu) ||D||_F = 58 >> eps
    near = (ns((1 - mu) * big) - ns(big)).abs().max()
    # clamp: exact once (1 - mu) ||D|| >= eps, rounding only (measured 8.9e-16); add: eps / ||D|| ~ 1e-9 remains
    assert near < (1e-12 if eps_mode == "clamp" else 1e-7)  # add measured: 1.6e-9
