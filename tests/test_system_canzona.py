"""FSDP-Canzona's Muon (liangyuwang/FSDP-Canzona, muon_check/adapters/canzona.py): its claim is a valid
muon_ref configuration; with the checkout ($MUON_CANZONA_CHECKOUT) its own code runs through the conformance check on
gloo ranks and the findings are pinned: bitwise on one device and on uniform FSDP shards at W = 2 (host rank
gathers, orthogonalises and scatters through `all_to_all_single`), and a crash when a param's gradient is missing on
one rank only (each rank assigns hosts from the params it has a gradient for). Without the checkout the test that
needs it skips, naming the variable."""

from __future__ import annotations

from muon_check.adapters.canzona import CANZONA_CHECKOUT_ENV, CanzonaMuon
from muon_check.adapters.cases import DIST_FAMILIES, MATRIX_FAMILIES
from muon_check.adapters.oracle import claim_of
from muon_ref.config import CONFIG_KEYS, MuonConfig
from muon_ref.presets import preset_defaults
from tests.system_checks import by_family, require_checkout, run_families


def _adapter() -> CanzonaMuon:
    """The adapter over the checkout; skips naming the variable when it is unset or wrong."""
    root = require_checkout(
        CANZONA_CHECKOUT_ENV,
        "matrix_based_optimizer/optimizers/muon.py",
        "a folder holding the matrix_based_optimizer package of liangyuwang/FSDP-Canzona at 13a92059",
    )
    return CanzonaMuon(root)


def test_canzona_claim_is_a_valid_muon_ref_configuration() -> None:
    """The claim (preset torch with Moonlight's scale multiplied into the bf16 update and F.normalize before the
    cast) builds a MuonConfig; the families are 2-D ones with rows % W == 0 at W <= 2 (its uniform-shard contract)."""
    preset, overrides = claim_of(CanzonaMuon())
    assert preset == "torch", preset
    assert overrides["lr_scale"] == "match_rms_adamw" and overrides["scale_apply"] == "update"
    assert overrides["normalize_before_cast"] is True
    values = preset_defaults(preset, overrides)
    MuonConfig(**{k: values[k] for k in CONFIG_KEYS})
    assert CanzonaMuon.families <= MATRIX_FAMILIES | DIST_FAMILIES | {
        "micro_batches",
        "nesterov_off",
    }
    assert not CanzonaMuon.families & {"uneven", "empty", "padded_scale", "experts", "checkpoint"}


def test_canzona_conforms_on_uniform_shards_and_crashes_when_a_gradient_is_missing_on_one_rank() -> (
    None
):
    """At W = 2, fp32, 2 steps: tall single-device and even FSDP shards are bitwise under the claim; asym_none
    (param 0 has no gradient on rank 1 at step 1) crashes in gloo's all-to-all, whose sizes the ranks no longer agree
    on ("Received data size doesn't match expected size")."""
    outcomes = by_family(run_families(_adapter(), ("tall", "even", "asym_none"), (2,)))
    assert outcomes["tall"]["status"] == "bitwise", outcomes["tall"]
    assert outcomes["even"]["status"] == "bitwise", outcomes["even"]
    asym = outcomes["asym_none"]
    assert asym["status"] == "crash" and "doesn't match expected size" in asym["error"], asym
