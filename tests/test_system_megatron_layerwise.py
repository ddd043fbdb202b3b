"""Megatron-core 0.19.2's LayerWiseDistributedOptimizer (muon_check/adapters/megatron_layerwise.py), built
by its own get_megatron_optimizer and run through the conformance check on gloo ranks: the findings read by hand are
pinned, so that a test fails when the system changes them. Without megatron-core the tests skip, naming
$MUON_MEGATRON_PATH and what it should hold (`make field` unpacks it and sets it)."""

from __future__ import annotations

import importlib.util

import pytest

from muon_check.adapters import Adapter
from muon_check.adapters.megatron_layerwise import (
    MegatronLayerWiseMuon,
    MegatronLayerWiseMuonStep,
)
from muon_check.adapters.oracle import claim_of
from muon_check.adapters.systems import MEGATRON_PATH_ENV
from muon_ref.config import CONFIG_KEYS, MuonConfig
from muon_ref.presets import preset_defaults
from tests.system_checks import by_family, require_checkout, run_families


def _megatron() -> None:
    """Skip, naming the variable and what it should hold, when megatron-core is not there."""
    require_checkout(
        MEGATRON_PATH_ENV,
        "megatron/core/optimizer",
        "a folder holding megatron-core 0.19.2 and emerging-optimizers 0.3.0 (make field sets it)",
    )
    if importlib.util.find_spec("absl") is None:
        pytest.skip(
            "absl-py is not installed (Emerging-Optimizers imports it): pip install absl-py"
        )


def _run(adapter: Adapter, families: tuple[str, ...], world_sizes: tuple[int, ...]) -> dict:
    """Two float32 steps of `families` through the check: {family: outcome}."""
    return by_family(run_families(adapter, families, world_sizes))


@pytest.mark.parametrize("adapter", [MegatronLayerWiseMuon, MegatronLayerWiseMuonStep])
def test_the_claim_is_a_valid_muon_ref_configuration(adapter: type[Adapter]) -> None:
    """Both adapters claim preset `emerging` with the check's hyperparameters, a configuration muon_ref accepts."""
    preset, overrides = claim_of(adapter())
    values = preset_defaults(preset, overrides)
    MuonConfig(**{k: values[k] for k in CONFIG_KEYS})


def test_layerwise_is_bitwise_where_owners_hold_equal_sizes_and_gloo_refuses_the_uneven_all_gather() -> (
    None
):
    """At W = 2, ping-pong ownership gives each rank one (4, 5) matrix on `even`: the owner's TensorParallelMuon step
    and the all-gather reproduce `emerging` bit for bit. On `remainder` (three matrices: rank 1 owns two)
    `allgather_params`' list-form all_gather has buffers of unequal sizes, which gloo refuses
    (layer_wise_optimizer.py:772). On `asym_none` the owner of param 0 (rank 0) holds its gradient and steps it
    where the claim skips a param that some rank lacks: a departure at the update's application."""
    _megatron()
    outcomes = _run(MegatronLayerWiseMuon(), ("even", "remainder", "asym_none"), (2,))
    assert outcomes["even"]["status"] == "bitwise"
    assert outcomes["remainder"]["status"] == "crash"
    assert "ProcessGroupGloo::allgather: invalid tensor size" in outcomes["remainder"]["error"]
    assert outcomes["asym_none"]["status"] == "differs"
    assert outcomes["asym_none"]["stage"] == "application"


def test_megatrons_own_step_raises_in_fp32_because_layerwise_chains_raw_optimizers() -> None:
    """With bf16 off LayerWise leaves its children raw TensorParallelMuons (it wraps them only for bf16,
    layer_wise_optimizer.py:505-516), and ChainedOptimizer.step calls prepare_grads on them (optimizer.py:1631):
    Megatron's own step raises AttributeError, even on one rank."""
    _megatron()
    outcome = _run(MegatronLayerWiseMuonStep(), ("even",), (1,))["even"]
    assert outcome["status"] == "crash"
    assert "'TensorParallelMuon' object has no attribute 'prepare_grads'" in outcome["error"]
