"""The kernel registry (muon_dist.kernels) and each backend's contract, as stated in its module's docstring.

The "triton" backend's own tests are tests/test_triton_kernel.py (Triton's interpreter); the Gram kernel against
muon_ref.gram_newton_schulz is tests/test_gram.py; the same contracts on CUDA are tests/gpu/test_kernels_gpu.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import muon_dist.kernels.reference as reference
from muon_dist.kernels import BACKENDS, backend
from muon_dist.kernels.contracts import KINDS, measure
from muon_ref import MuonConfig, matrix_layout, newton_schulz, orthogonalize
from tests.conftest import examples
from tests.test_gram import gaussian, same_bits

CPU = torch.device("cpu")
LOW_PRECISION = [torch.bfloat16, torch.float16]


# the registry


def test_every_registered_backend_is_named_as_registered_and_only_torch_claims_bits():
    for name in ("torch", "gram"):  # "triton" imports triton: its module is checked in tests/test_triton_kernel.py
        assert backend(name).name == name
    assert BACKENDS["triton"] == "muon_dist.kernels.triton_ns"
    assert [backend(name).bitwise for name in ("torch", "gram")] == [True, False]


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_module_states_its_reference_equation_and_contract(name):
    source = importlib.util.find_spec(BACKENDS[name]).loader.get_source(BACKENDS[name])  # read: triton not imported
    docstring = source.split('"""')[1]
    assert "Reference equation" in docstring and "Contract" in docstring


# "torch": the batched path's rule (muon_dist/kernels/reference.py docstring)


@settings(max_examples=examples(0.5))
@given(num_matrices=st.integers(2, 4), short=st.integers(8, 24), long=st.integers(8, 40), tall=st.booleans(),
       dtype=st.sampled_from(LOW_PRECISION), same_input_dtype=st.booleans(),
       schedule=st.sampled_from(["keller", "you5", "polar_express"]), eps_mode=st.sampled_from(["add", "clamp"]),
       before=st.booleans(), seed=st.integers(0, 2**16))
def test_inside_the_rule_the_batched_kernel_gives_the_loops_bits(num_matrices, short, long, tall, dtype,
                                                                  same_input_dtype, schedule, eps_mode, before, seed):
    shape = (num_matrices, long, short) if tall else (num_matrices, short, long)
    assert reference.batched_is_bitwise(CPU, dtype, "addmm", None, *shape)
    G = gaussian(shape, seed, dtype if same_input_dtype else torch.float32)
    options = dict(dtype=dtype, eps_mode=eps_mode, normalize_before_cast=before)
    assert same_bits(reference.newton_schulz_batched(G, schedule, **options), newton_schulz(G, schedule, **options))


@pytest.mark.parametrize("shape, dtype, seed", [
    ((2, 9, 13), torch.float32, 0),  # measured: 7.2e-7 apart (MKL's batched sgemm sums in another order)
    ((4, 6, 12), torch.bfloat16, 2),  # measured: 7.8e-3 apart (min(m, n) = 6: ATen's small-product loop kernel)
])
def test_outside_the_rule_the_batched_kernel_is_not_bitwise(shape, dtype, seed):
    assert not reference.batched_is_bitwise(CPU, dtype, "addmm", None, *shape)
    G = gaussian(shape, seed)
    assert not same_bits(reference.newton_schulz_batched(G, dtype=dtype), newton_schulz(G, dtype=dtype))


def test_the_rule_batches_only_what_was_measured(monkeypatch):
    inside = (CPU, torch.bfloat16, "addmm", None, 2, 8, 8)
    assert reference.batched_is_bitwise(*inside)
    for position, other in [(0, torch.device("cuda")), (1, torch.float32), (2, "keller"), (3, "aol"), (4, 1), (5, 7)]:
        changed = list(inside)
        changed[position] = other
        assert not reference.batched_is_bitwise(*changed), changed
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert not reference.batched_is_bitwise(*inside)


# "torch": the backend equals muon_ref.orthogonalize bitwise, batched or not


LAYOUTS = {  # shape, layout keys: a stack the rule batches, one it does not, fused experts, a separate layout
    "3-D stack": ((3, 16, 24), {}),
    "3-D stack, small": ((3, 6, 24), {}),
    "fused experts": ((40, 12), {"num_experts": 4}),
    "split sizes": ((24, 16), {"split_sizes": (8, 16)}),
}
CONFIGS = {  # the default (torch.optim.Muon's) and one whose schedule's own preconditioner is switched off
    "default": {},
    "aol schedule, no preconditioner": {"schedule": "aol", "precondition": "none", "eps_mode": "add"},
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_torch_backend_equals_muon_ref_orthogonalize_bitwise(monkeypatch, name, dtype, config):
    shape, keys = LAYOUTS[name]
    layout = matrix_layout(shape, **keys)
    cfg = MuonConfig(ns_dtype=dtype, **CONFIGS[config])
    calls, batched = [], reference.newton_schulz_batched
    monkeypatch.setattr(reference, "newton_schulz_batched", lambda G, **kw: calls.append(G.shape) or batched(G, **kw))
    D = gaussian(shape, 0)
    assert same_bits(backend("torch").orthogonalize(D, layout, cfg), orthogonalize(D, layout, cfg))
    # the batched path ran exactly where the rule applies (bf16, min(m, n) >= 8, a stack): the test is not vacuous
    batched_here = dtype == torch.bfloat16 and name in ("3-D stack", "fused experts")
    assert calls == ([layout.matrices_shape] if batched_here else [])


def test_the_batched_kernel_refuses_the_aol_preconditioner():
    with pytest.raises(ValueError, match="preconditioner"):
        reference.newton_schulz_batched(torch.ones(2, 8, 8), "aol")


def test_the_rule_measurement_command_finds_no_violation(capsys):
    assert reference.measure(CPU, num_stacks=6) == 0
    assert "the rule batches" in capsys.readouterr().out


# "gram": contract 2 of muon_dist/kernels/gram_ns.py, against muon_ref.newton_schulz under the same config


GRAM_SCHEDULES = ["keller", "you5", "polar_express_dao"]
# measured maxima over 40 inputs of each kind: 1.4e-4, 4.1e-2, 0.40 (gram_ns.py); these are the first 8 of them
GRAM_DIFFERENCE = {torch.float32: 2e-4, torch.float16: 5e-2, torch.bfloat16: 0.5}
BF16_ULP = 2.0**-7  # of 1
# measured bf16 bands (gram_ns.py), widened by 4 bf16 ulps of 1 on both sides
GRAM_BF16_GAUSSIAN_BAND = {"keller": (0.6685, 1.134), "you5": (0.9548, 1.031), "polar_express_dao": (0.8384, 1.181)}
GRAM_BF16_HARD_BAND = (-0.497, 1.599)


def within(band: tuple[float, float], low: float, high: float, margin: float) -> bool:
    """[low, high] inside band widened by margin on both sides (False for NaN)."""
    return band[0] - margin <= low and high <= band[1] + margin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("schedule", GRAM_SCHEDULES)
def test_the_gram_backend_is_within_its_measured_difference_from_newton_schulz(schedule, dtype):
    cfg = MuonConfig(schedule=schedule, ns_dtype=dtype)
    worst = max(measure("gram", cfg, kind, range(8), 64, CPU)["difference"] for kind in KINDS)
    assert worst <= GRAM_DIFFERENCE[dtype]


@pytest.mark.parametrize("schedule", GRAM_SCHEDULES)
def test_the_gram_backends_bf16_singular_values_stay_inside_the_measured_bands(schedule):
    cfg = MuonConfig(schedule=schedule, ns_dtype=torch.bfloat16)
    for kind in KINDS:
        r = measure("gram", cfg, kind, range(8), 64, CPU)
        band = GRAM_BF16_GAUSSIAN_BAND[schedule] if kind == "gaussian" else GRAM_BF16_HARD_BAND
        assert within(band, r["low"], r["high"], 4 * BF16_ULP), (kind, r)


@pytest.mark.parametrize("kind", ["low_rank", "ill_conditioned"])
def test_an_eight_step_schedule_is_outside_the_gram_contract_and_fails_its_band(kind):
    # negative control: polar_express's 8 steps with the one restart blow up in bf16 (seed 1, measured: 1.2e36 on
    # the low-rank input, 3.6e17 on the ill-conditioned one; NaN on other seeds)
    r = measure("gram", MuonConfig(schedule="polar_express", ns_dtype=torch.bfloat16), kind, range(1, 2), 64, CPU)
    assert not within(GRAM_BF16_HARD_BAND, r["low"], r["high"], 4 * BF16_ULP)
    assert within(GRAM_BF16_HARD_BAND, r["ref_low"], r["ref_high"], 0.0)  # muon_ref.newton_schulz holds it
