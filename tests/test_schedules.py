"""The schedule catalogue, its step policies, the exact band and the polar metrics."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import muon_ref
from muon_ref import (
    SCHEDULES,
    Schedule,
    max_singular_value_error,
    newton_schulz,
    orthogonality_error,
    polar_error,
    polar_factor,
    register_schedule,
    scalar_map,
    schedule_band,
    signed_singular_values,
)

CATALOGUE = {  # name: (number of listed steps, first triple) from docs/schedules.md
    "cubic": (1, (1.5, -0.5, 0.0)),
    "quintic": (1, (15 / 8, -10 / 8, 3 / 8)),
    "keller": (1, (3.4445, -4.7750, 2.0315)),
    "you5": (5, (4.0848, -6.8946, 2.9270)),
    "you6": (6, (3955 / 1024, -8306 / 1024, 5008 / 1024)),
    "polar_express_paper": (8, (8.28721201814563, -23.595886519098837, 17.300387312530933)),
    "polar_express": (
        8,
        (8.28721201814563 / 1.01, -23.595886519098837 / 1.01**3, 17.300387312530933 / 1.01**5),
    ),
    "polar_express_nemo": (8, (8.2051, -22.9019, 16.4607)),
    "polar_express_modded": (5, (8.156554524902461, -22.48329292557795, 15.878769915207462)),
    "polar_express_dao": (
        5,
        (8.28721201814563 / 1.05, -23.595886519098837 / 1.05**3, 17.300387312530933 / 1.05**5),
    ),
    "cans": (5, (8.4703, -25.1081, 18.6293)),
    "aol_old": (4, (4.0098, -7.0585, 2.4635)),
    "aol": (4, (4.6051, -9.6552, 5.6769)),
    "deepseekv4": (10, (3.4445, -4.7750, 2.0315)),
    "cubic5": (5, (3.3656576, -3.3420992, 0.0)),
}


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_every_catalogue_schedule_is_registered_with_its_published_coefficients(name):
    sched = SCHEDULES[name]
    count, first = CATALOGUE[name]
    assert len(sched.coefficients) == count and sched.coefficients[0] == first and sched.source


def test_polar_express_as_shipped_keeps_the_last_step_unscaled():
    assert SCHEDULES["polar_express"].coefficients[-1] == (1.875, -1.25, 0.375)
    assert SCHEDULES["deepseekv4"].coefficients[8:] == ((2.0, -1.5, 0.5),) * 2


def test_step_policies_cycle_repeat_last_and_fixed():
    you5, pe = SCHEDULES["you5"], SCHEDULES["polar_express"]
    assert you5.steps_for(7)[5:] == you5.coefficients[:2]
    assert pe.steps_for(10)[8:] == (pe.coefficients[-1],) * 2
    with pytest.raises(ValueError, match="exactly 4 steps"):
        SCHEDULES["aol"].steps_for(5)


MEASURED_BANDS = {  # fp64 scalar composition over [1e-3, 1], docs/schedules.md (4 decimals)
    "keller": (0.4705, 1.2024),
    "you5": (0.4750, 1.1450),
    "you6": (0.8663, 0.9993),
    "polar_express_modded": (0.8589, 1.1411),
    "cans": (0.8844, 1.1198),
    "aol_old": (-1.084, 1.084),
    "deepseekv4": (1.0000, 1.00054),
}


@pytest.mark.parametrize("name", sorted(MEASURED_BANDS))
def test_schedule_band_reproduces_the_measured_bands(name):
    band = schedule_band(name, 1e-3, 1.0)
    lo, hi = MEASURED_BANDS[name]
    assert band.min == pytest.approx(lo, abs=6e-4) and band.max == pytest.approx(hi, abs=6e-4)
    assert band.sign_flip == (name == "aol_old")


@given(name=st.sampled_from(sorted(SCHEDULES)), x=st.floats(1e-3, 1.0))
def test_the_scalar_map_stays_inside_the_band(name, x):
    band = schedule_band(name, 1e-3, 1.0)
    y = float(scalar_map(name, torch.tensor([x], dtype=torch.float64)))
    assert band.min - 1e-12 <= y <= band.max + 1e-12


def test_a_perturbed_schedule_leaves_the_original_band_negative_control():
    keller = SCHEDULES["keller"]
    broken = dataclasses.replace(
        keller, name="keller_broken", coefficients=((3.4445 * 1.05, -4.7750, 2.0315),)
    )
    xs = torch.linspace(1e-3, 1.0, 20001, dtype=torch.float64)
    band = schedule_band(keller, 1e-3, 1.0)
    ys = scalar_map(broken, xs)
    assert float(ys.max()) > band.max + 1e-3


def test_registered_schedules_are_usable_by_name_and_conflicts_are_refused():
    mine = Schedule(
        name="test_half_quintic",
        coefficients=((15 / 8, -10 / 8, 3 / 8),),
        source="test",
        policy="cycle",
        default_steps=3,
    )
    register_schedule(mine)
    try:
        assert torch.equal(
            newton_schulz(torch.ones(2, 3), "test_half_quintic"),
            newton_schulz(torch.ones(2, 3), "quintic", steps=3),
        )
        with pytest.raises(ValueError, match="different schedule"):
            register_schedule(dataclasses.replace(mine, default_steps=4))
    finally:
        SCHEDULES.pop("test_half_quintic")


def test_polar_factor_is_the_exact_orthogonal_factor():
    G = torch.randn(7, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    P = polar_factor(G)
    assert orthogonality_error(P) < 1e-12 and polar_error(P, G) < 1e-12
    assert max_singular_value_error(P, G) < 1e-12


def test_polar_factor_of_a_rank_deficient_matrix_is_the_partial_isometry():
    u = torch.randn(6, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    v = torch.randn(1, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    P = polar_factor(u @ v)
    torch.testing.assert_close(P, (u / u.norm()) @ (v / v.norm()), rtol=0, atol=1e-12)


def test_signed_singular_values_reveal_a_sign_flip_that_an_svd_hides():
    # aol_old on a rank-1 input (an expert that saw one token): its largest singular value comes out negative
    u = torch.randn(16, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    v = torch.randn(1, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    G = u @ v
    out = newton_schulz(G, "aol_old", precondition="none", dtype=torch.float64)
    d = signed_singular_values(out, G)
    assert float(d[0]) < -0.9 and float(torch.linalg.svdvals(out)[0]) > 0.9


def test_fixed_points_solve_p_of_x_equals_x():
    for name in ("keller", "you5", "quintic", "cubic"):
        for coefficients in set(SCHEDULES[name].coefficients):
            for x in muon_ref.fixed_points(coefficients):
                assert muon_ref.step_polynomial(x, coefficients) == pytest.approx(x, abs=1e-12)
    assert muon_ref.fixed_points((15 / 8, -10 / 8, 3 / 8)) == pytest.approx([1.0, (7 / 3) ** 0.5])


def test_the_band_with_safety_is_the_band_over_the_prescaled_interval():
    band = schedule_band("polar_express", 1e-3, safety=1.01)
    assert band.per_step == schedule_band("polar_express", 1e-3 / 1.01, 1 / 1.01).per_step


def test_headroom_exposes_schedules_without_room_above_one():
    # polar_express_paper and cans are fitted up to exactly 1: one bf16 rounding above it (2^-8) diverges
    assert schedule_band("polar_express_paper", 1e-3, headroom=2.0**-8).max > 1e3
    assert schedule_band("polar_express", 1e-3, headroom=2.0**-8).max < 1.1


def test_normalised_singular_values_are_what_the_polynomials_act_on():
    G = torch.randn(12, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    x = muon_ref.normalised_singular_values(G, "polar_express", eps_mode="add")
    s = torch.linalg.svdvals(G)
    torch.testing.assert_close(x, s / (s.square().sum().sqrt() * 1.01 + 1e-7), rtol=0, atol=1e-15)
    # and the kernel's output acts on them through the scalar map (float64, the shipped pipeline)
    d = signed_singular_values(
        newton_schulz(G, "polar_express", eps_mode="add", dtype=torch.float64), G
    )
    torch.testing.assert_close(d, scalar_map("polar_express", x), rtol=0, atol=1e-9)
