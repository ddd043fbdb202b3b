"""torchtitan's DistributedMuon (pytorch/torchtitan PR 4060, muon_check/adapters/torchtitan.py): its claim is
a valid muon_ref configuration, its CPU shim is scoped to the construction, and, with a checkout of pytorch/torchtitan
at PR 4060's merge commit in $MUON_TORCHTITAN_CHECKOUT, its own code steps bitwise like preset `torch` with lr_scale
"match_rms_adamw" on the recipe's Owned (2-D) and Shard(0) (expert stack) layouts, and refuses a step in which a
configured param has no gradient (distributed_muon.py:541-545): a crash where no rank has it, a hang of the peers in
the all-to-all where one rank lacks it. Without the checkout the checks that run its code skip, naming the
variable."""

from __future__ import annotations

import types

import pytest
import torch

from muon_check.adapters import Adapter
from muon_check.adapters.cases import DIST_FAMILIES
from muon_check.adapters.oracle import claim_of
from muon_check.adapters.torchtitan import (
    MODULE_PATH,
    TORCHTITAN_CHECKOUT_ENV,
    TorchtitanDistributedMuon,
    TorchtitanDistributedMuonDefaults,
    _cpu_shim,
)
from muon_ref.config import CONFIG_KEYS, MuonConfig
from muon_ref.presets import preset_defaults
from tests.system_checks import by_family, require_checkout, run_families

MISSING = "DistributedMuon requires every configured gradient before step()"


def _checkout() -> None:
    """Skip, naming the variable and what it should hold, when $MUON_TORCHTITAN_CHECKOUT is unset or wrong."""
    require_checkout(
        TORCHTITAN_CHECKOUT_ENV,
        MODULE_PATH,
        "a checkout of pytorch/torchtitan at PR 4060's merge commit "
        "bb90ff9c23c95f966d0d584a3ccb7b5448286def (the folder holding `torchtitan`)",
    )


def _run(adapter: Adapter, families: tuple[str, ...]) -> dict[str, dict]:
    """Two float32 steps of `families` at W = 2 through the conformance check; outcome by family."""
    return by_family(run_families(adapter, families, (2,), timeout=120.0))


@pytest.mark.parametrize("adapter", [TorchtitanDistributedMuon, TorchtitanDistributedMuonDefaults])
def test_torchtitan_claims_are_valid_muon_ref_configurations(adapter: type[Adapter]) -> None:
    """Each claim names a preset and options muon_ref accepts, and the families are the dtensor ones (the class
    refuses plain tensors, distributed_muon.py:387); the recipe's claim is preset torch + match_rms_adamw."""
    preset, overrides = claim_of(adapter())
    values = preset_defaults(preset, overrides)
    MuonConfig(**{k: values[k] for k in CONFIG_KEYS})
    assert adapter.families == DIST_FAMILIES and adapter.distributed == "dtensor"
    assert TorchtitanDistributedMuon.preset == "torch"
    assert TorchtitanDistributedMuon.overrides == {"lr_scale": "match_rms_adamw"}
    assert TorchtitanDistributedMuonDefaults.overrides == {}


def test_torchtitan_without_its_checkout_names_the_environment_variable(monkeypatch) -> None:
    """Built without a checkout, the adapter raises ValueError naming $MUON_TORCHTITAN_CHECKOUT."""
    monkeypatch.delenv(TORCHTITAN_CHECKOUT_ENV, raising=False)
    with pytest.raises(ValueError, match=TORCHTITAN_CHECKOUT_ENV):
        TorchtitanDistributedMuon().build([])


def test_torchtitan_cpu_shim_holds_only_during_the_construction_on_cpu() -> None:
    """Inside the shim (CPU tensors) the device check accepts the CPU where it raised "one CUDA device" and
    torch.cpu.Stream takes `device=`; outside it, both are torch's and the module's own again."""

    def refuse(self):
        raise ValueError("DistributedMuon requires one CUDA device per process")

    cls = type("DistributedMuon", (), {"_validate_parameter_storage": refuse})
    module = types.SimpleNamespace(DistributedMuon=cls)
    stream = torch.cpu.Stream
    with _cpu_shim(module, [torch.zeros(2, 2)]):
        assert cls()._validate_parameter_storage() == torch.device("cpu")
        torch.cpu.Stream(device=torch.device("cpu"), priority=0)
    assert torch.cpu.Stream is stream and cls._validate_parameter_storage is refuse
    with pytest.raises(TypeError):
        torch.cpu.Stream(device=torch.device("cpu"), priority=0)


@pytest.mark.timeout(300)
def test_torchtitan_distributed_muon_is_bitwise_and_refuses_a_missing_gradient() -> None:
    """At W = 2: uneven 2-D params (Owned: all-to-all to one owner) and an expert stack split 2 | 1 (Shard(0),
    batched NS where it lies) are bitwise to preset torch + match_rms_adamw; a param without a gradient on every
    rank crashes with the class's RuntimeError (checkpoint_unstepped), and one missing on one rank only leaves the
    other blocked in the all-to-all (asym_none), the stated contract of `_preflight_step`."""
    _checkout()
    by_family = _run(
        TorchtitanDistributedMuon(), ("uneven", "experts", "checkpoint_unstepped", "asym_none")
    )
    assert by_family["uneven"]["status"] == "bitwise", by_family["uneven"]
    assert by_family["experts"]["status"] == "bitwise", by_family["experts"]
    crash = by_family["checkpoint_unstepped"]
    assert crash["status"] == "crash" and MISSING in crash["error"], crash
    hang = by_family["asym_none"]
    assert hang["status"] == "hang" and "all_to_all_single" in hang["error"], hang


@pytest.mark.timeout(300)
def test_torchtitan_recipe_scale_is_not_the_class_default() -> None:
    """The recipe's build (adjust_lr_fn "match_rms_adamw") checked against the class-default claim (preset torch,
    "original" scale) differs on even shards, where 0.2 * sqrt(max(A, B)) != sqrt(max(1, A / B)): the check sees
    the scale the recipe sets."""
    _checkout()
    adapter = TorchtitanDistributedMuon()
    adapter.overrides = {}
    even = _run(adapter, ("even",))["even"]
    assert even["status"] == "differs", even
