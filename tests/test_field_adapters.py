"""The field adapters (muon_check/adapters/field.py): each claim is a valid muon_ref configuration; each adapter
whose package (or checkout) is here builds its optimizer and steps through the conformance machinery; and the
causes of their departures found by hand (docs/public-muons.md) are pinned, so that a test fails
when upstream changes them. Everything runs eagerly (the adapters force it in their ranks; here in-process
through torch.compiler.set_stance), without torch.compile."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from muon_check import conformance
from muon_check.adapters import Adapter
from muon_check.adapters.cases import DIST_FAMILIES, SINGLE_FAMILIES
from muon_check.adapters.field import (
    DION_CHECKOUT_ENV,
    DionMuon,
    GramNewtonSchulzMuon,
    TorchtitanDistMuon,
    TorchtitanDistMuonOnCpu,
)
from muon_check.adapters.oracle import claim_of
from muon_ref import newton_schulz
from muon_ref.config import CONFIG_KEYS, MuonConfig
from muon_ref.presets import preset_defaults

ADAPTERS = [TorchtitanDistMuon, TorchtitanDistMuonOnCpu, DionMuon, GramNewtonSchulzMuon]


def _importable(module: str) -> str | None:
    """None when `module` imports, else why not (the missing package)."""
    try:
        importlib.import_module(module)
        return None
    except ImportError as e:
        return f"{module} does not import here ({e}); install: see muon_check/adapters/field.py"


def _dion_checkout() -> str:
    path = os.environ.get(DION_CHECKOUT_ENV)
    if not path:
        pytest.skip(
            f"${DION_CHECKOUT_ENV} is not set (a microsoft/dion checkout; this clone may have none)"
        )
    if not os.path.isdir(os.path.join(path, "dion")):
        pytest.skip(f"${DION_CHECKOUT_ENV}={path} holds no dion package")
    return path


def _one_step(adapter: Adapter, family: str, world_size: int = 1) -> dict:
    """One step of one float32 case of `family` through `python -m muon_check`'s check."""
    report = conformance.check(
        adapter,
        (world_size,),
        steps=1,
        timeout=120.0,
        shrink_budget=0.0,
        families=(family,),
        dtypes=("float32",),
        log=lambda *_: None,
    )
    (outcome,) = report["outcomes"]
    return outcome


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda a: a.__name__)
def test_each_field_adapter_claims_a_valid_muon_ref_configuration(adapter: type[Adapter]) -> None:
    preset, overrides = claim_of(adapter())
    values = preset_defaults(preset, overrides)  # raises ValueError on an unknown option or value
    MuonConfig(**{k: values[k] for k in CONFIG_KEYS})
    assert adapter.families <= SINGLE_FAMILIES | DIST_FAMILIES and adapter.families


@pytest.mark.timeout(120)
def test_torchtitan_dist_muon_as_shipped_refuses_cpu_tensors_with_its_own_error() -> None:
    if reason := _importable("torchtitan.distributed.flex_shard"):
        pytest.skip(reason)
    outcome = _one_step(TorchtitanDistMuon(), "even")
    assert outcome["status"] == "crash" and "requires one CUDA device" in outcome["error"], outcome


@pytest.mark.timeout(120)
def test_torchtitan_dist_muon_on_cpu_steps_bitwise_like_the_torch_preset() -> None:
    if reason := _importable("torchtitan.distributed.flex_shard"):
        pytest.skip(reason)
    outcome = _one_step(TorchtitanDistMuonOnCpu(), "even")
    assert outcome["status"] == "bitwise", outcome


@pytest.mark.timeout(120)
def test_dion_muon_from_a_checkout_steps_bitwise_like_its_claim() -> None:
    outcome = _one_step(DionMuon(_dion_checkout()), "square")
    assert outcome["status"] == "bitwise", outcome


def test_a_dion_adapter_without_a_checkout_names_the_environment_variable(monkeypatch) -> None:
    monkeypatch.delenv(DION_CHECKOUT_ENV, raising=False)
    with pytest.raises(ValueError, match=DION_CHECKOUT_ENV):
        DionMuon().build([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.02)


def test_dion_orthogonalises_a_square_matrix_padded_to_a_tall_one_as_its_transpose(
    monkeypatch,
) -> None:
    """The uneven-shard departure: a (3, 3) param on W=2 reaches Polar Express padded to (4, 3)
    (megabatch_base.py:755-800), which is iterated in the tall form; the zero row changes nothing else."""
    monkeypatch.syspath_prepend(_dion_checkout())
    from dion.polar_express import polar_express

    G = torch.randn(3, 3, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.compiler.set_stance("force_eager"):
        on_padded = polar_express(torch.cat([G, G.new_zeros(1, 3)]), epsilon=torch.tensor(1e-8))[:3]
        unpadded = polar_express(G, epsilon=torch.tensor(1e-8))
    ns = dict(schedule="polar_express_modded", eps=1e-8, eps_mode="add", step_form="dion")
    assert torch.equal(unpadded, newton_schulz(G, **ns))
    assert torch.equal(on_padded, newton_schulz(G.mT.contiguous(), **ns).mT)
    assert not torch.equal(on_padded, unpadded)


@pytest.mark.timeout(120)
def test_gram_newton_schulz_muon_steps_with_the_claimed_momentum_and_another_newton_schulz() -> (
    None
):
    if reason := _importable("gram_newton_schulz"):
        pytest.skip(reason)
    outcome = _one_step(GramNewtonSchulzMuon(), "square")
    assert outcome["status"] == "differs" and outcome["state_diff"] == 0.0, outcome


def test_gram_newton_schulz_standard_ns_is_the_oracle_kernel_on_the_bf16_direction_normalised_in_fp32() -> (
    None
):
    """Its NS input: the direction rounded to bf16 (muon_opt_utils.py:53), then normalised in fp32 and cast to
    fp16 (gram_newton_schulz.py:84-86); no muon_ref option normalises in a wider dtype than the direction's."""
    if reason := _importable("gram_newton_schulz"):
        pytest.skip(reason)
    from gram_newton_schulz import StandardNewtonSchulz

    standard = StandardNewtonSchulz(ns_use_kernels=False, compile_kwargs=None)
    U = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
    ns = dict(
        schedule="polar_express_dao",
        eps=1e-7,
        eps_mode="add",
        dtype=torch.float16,
        step_form="addmm",
        normalize_before_cast=True,
    )
    assert torch.equal(standard(U.unsqueeze(0))[0], newton_schulz(U.float(), **ns).bfloat16())
    assert not torch.equal(standard(U.unsqueeze(0))[0], newton_schulz(U, **ns).bfloat16())


def test_gram_newton_schulz_momentum_of_bf16_buffers_uses_mu_rounded_to_bf16() -> None:
    """In-place torch._foreach_mul_ with a Python float on bf16 tensors (muon_opt_utils.py:43; eager, x86 CPU
    build) rounds the scalar to bf16 first: 0.9 -> 0.8984375. Dion passes a 0-dim fp32 tensor and does not."""
    if reason := _importable("gram_newton_schulz"):
        pytest.skip(reason)
    from gram_newton_schulz.muon.muon_utils.muon_opt_utils import muon_update_pre_orthogonalize

    G = torch.randn(64, generator=torch.Generator().manual_seed(2)).bfloat16()
    M = torch.randn(64, generator=torch.Generator().manual_seed(3)).bfloat16()
    buffers = [M.clone()]
    with torch.compiler.set_stance("force_eager"):
        muon_update_pre_orthogonalize([G], buffers, 0.9, True)
    assert torch.equal(buffers[0], M.mul(torch.tensor(0.9).bfloat16()).add(G))
    assert not torch.equal(buffers[0], M.mul(0.9).add(G))
