"""Contracts of muon_ref.config that the rest of the suite left unchecked (found by `make mutation`: README,
"Mutation testing"): the shape-scale table and its refusals, MuonConfig's defaults and its bounds."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from muon_ref import PRESETS, MuonConfig, lr_scale

ROOTS = {"sqrt": math.sqrt, "pow": lambda x: x**0.5}
# docs/conventions.md: the shape-scale formulas, each under every library's name for it
FORMULAS = {
    "original": lambda fo, fi, root: root(max(1, fo / fi)),
    "match_rms_adamw": lambda fo, fi, root: 0.2 * root(max(fo, fi)),
    "spectral_norm": lambda fo, fi, root: root(fo / fi),
    "spectral": lambda fo, fi, root: root(max(fo, fi)),
    "none": lambda fo, fi, root: 1.0,
}
NAMES = {
    "original": "original",
    "shape_scaling": "original",
    "match_rms_adamw": "match_rms_adamw",
    "rms_norm": "match_rms_adamw",
    "spectral_norm": "spectral_norm",
    "unit_rms_norm": "spectral_norm",
    "spectral": "spectral",
    "none": "none",
}


@example(name="original", fan_out=3, fan_in=7, sqrt="sqrt")  # wide: max(1, .) keeps the scale at 1
@example(
    name="original", fan_out=145, fan_in=9, sqrt="sqrt"
)  # math.sqrt(145 / 9) != (145 / 9) ** 0.5
@example(name="original", fan_out=145, fan_in=9, sqrt="pow")
@given(
    name=st.sampled_from(sorted(NAMES)),
    fan_out=st.integers(1, 8192),
    fan_in=st.integers(1, 8192),
    sqrt=st.sampled_from(sorted(ROOTS)),
)
def test_each_shape_scale_name_evaluates_the_formula_of_the_readme_table(
    name, fan_out, fan_in, sqrt
):
    # names as a loaded state dict or a config file gives them: new str objects, not this module's interned literals
    fresh_name, fresh_sqrt = "".join(name), "".join(sqrt)
    assert lr_scale(fresh_name, fan_out, fan_in, fresh_sqrt) == FORMULAS[NAMES[name]](
        fan_out, fan_in, ROOTS[sqrt]
    )


@pytest.mark.parametrize(
    "name, sqrt, message",
    [
        (
            "spectrall",
            "sqrt",
            r"unknown lr_scale 'spectrall'; known: \['match_rms_adamw', 'none', 'original'",
        ),
        ("spectral", "cbrt", r"sqrt must be 'sqrt' or 'pow', got 'cbrt'"),
    ],
)
def test_an_unknown_shape_scale_or_root_raises_a_value_error_naming_it(name, sqrt, message):
    with pytest.raises(ValueError, match=message):
        lr_scale(name, 4, 2, sqrt)


def test_muon_configs_defaults_are_the_torch_preset():
    assert MuonConfig() == MuonConfig(**PRESETS["torch"])


@example(field="lr", magnitude=1e-3)
@example(field="weight_decay", magnitude=1e-3)
@example(field="momentum", magnitude=1e-3)
@example(field="eps", magnitude=1e-3)
@given(
    field=st.sampled_from(["lr", "weight_decay", "momentum", "eps"]),
    magnitude=st.floats(min_value=1e-9, max_value=10.0),
)
def test_each_bounded_option_accepts_zero_and_refuses_a_negative_value_naming_itself(
    field, magnitude
):
    assert getattr(MuonConfig(**{field: 0.0}), field) == 0.0
    with pytest.raises(ValueError, match=rf"^{field} must be >= 0, got -"):
        MuonConfig(**{field: -magnitude})


def test_a_tensor_lr_has_one_element_or_is_refused_naming_its_shape():
    """MuonConfig: a Tensor lr of one element (any shape) is accepted; any other numel raises torch.optim's message
    with its shape."""
    import torch

    for one in (torch.tensor(0.02), torch.tensor([0.02]), torch.tensor([[0.02]])):
        assert float(MuonConfig(lr=one).lr) == pytest.approx(0.02)
    for shape in ((2,), (0,), (1, 3)):
        with pytest.raises(
            ValueError, match=rf"^Tensor lr must be 1-element, got lr of shape \({shape[0]},"
        ):
            MuonConfig(lr=torch.full(shape, 0.02))
