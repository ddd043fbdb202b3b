"""LeRobot's DistributedMuon (huggingface/lerobot PR 4658, muon_check/adapters/lerobot.py): its claim is a
valid muon_ref configuration; with the checkout ($MUON_LEROBOT_CHECKOUT) its own code runs through the conformance
check and the causes found by hand are pinned: bitwise on uneven FSDP2 shards at W = 2, momentum lost by a
torch.distributed.checkpoint resume through its `CombinedOptimizer` (the bare DistributedMuon keeps it), the
lazily created state that a checkpoint of a never-stepped param lacks. Without the checkout the tests that need it
skip, naming the variable."""

from __future__ import annotations

import pytest
import torch

from muon_check.adapters.cases import DIST_FAMILIES, SINGLE_FAMILIES
from muon_check.adapters.lerobot import (
    LEROBOT_CHECKOUT_ENV,
    LEROBOT_MUON_PATH,
    LerobotDistributedMuon,
)
from muon_check.adapters.oracle import claim_of
from muon_ref.config import CONFIG_KEYS, MuonConfig
from muon_ref.presets import preset_defaults
from tests.system_checks import by_family, require_checkout, run_families

HP = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True}


def _adapter() -> LerobotDistributedMuon:
    """The adapter over the checkout; skips naming the variable when it is unset or wrong."""
    root = require_checkout(
        LEROBOT_CHECKOUT_ENV,
        LEROBOT_MUON_PATH,
        "a folder holding src/lerobot/optim/muon.py of huggingface/lerobot at 85b2fd6c (the file PR 4658 adds)",
    )
    return LerobotDistributedMuon(root)


def test_lerobot_claim_is_a_valid_muon_ref_configuration() -> None:
    """The claim (preset torch, lr_scale match_rms_adamw) builds a MuonConfig, and the families are the check's."""
    preset, overrides = claim_of(LerobotDistributedMuon())
    assert preset == "torch" and overrides["lr_scale"] == "match_rms_adamw", (preset, overrides)
    values = preset_defaults(preset, overrides)
    MuonConfig(**{k: values[k] for k in CONFIG_KEYS})
    assert LerobotDistributedMuon.families <= SINGLE_FAMILIES | DIST_FAMILIES
    assert "conv4d" not in LerobotDistributedMuon.families


def test_lerobot_conforms_on_uneven_shards_and_loses_momentum_on_a_checkpoint_resume() -> None:
    """At W = 2, fp32, 2 steps: uneven FSDP2 shards are bitwise (the padded all-gather rebuilds torch.chunk's boxes
    there); a DCP save and resume leaves the params equal but the momentum departs (CombinedOptimizer drops it on
    load); a checkpoint whose last param never stepped cannot be loaded (state created lazily: "Missing key")."""
    outcomes = by_family(
        run_families(_adapter(), ("uneven", "checkpoint", "checkpoint_unstepped"), (2,))
    )
    assert outcomes["uneven"]["status"] == "bitwise", outcomes["uneven"]
    assert outcomes["checkpoint"]["status"] == "differs", outcomes["checkpoint"]
    assert outcomes["checkpoint"]["stage"] == "momentum", outcomes["checkpoint"]
    unstepped = outcomes["checkpoint_unstepped"]
    assert unstepped["status"] == "crash" and "Missing key" in unstepped["error"], unstepped


def test_combined_optimizer_drops_the_momentum_that_torch_distributed_checkpoint_hands_it() -> None:
    """The cause, in one process: `set_optimizer_state_dict` hands `CombinedOptimizer.load_state_dict` a state keyed
    by parameter name, which it reads by integer index only, so every buffer is dropped; LeRobot's own
    `state_dict()` / `load_state_dict()` round trip (integer keys) keeps the buffers. Fails when either changes."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    adapter = _adapter()

    def stepped(
        source: torch.nn.Module | None = None,
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        module = torch.nn.Module()
        for name, shape in (("w", (3, 2)), ("v", (4, 2))):
            value = getattr(source, name).detach().clone() if source else torch.randn(shape)
            setattr(module, name, torch.nn.Parameter(value))
        return module, adapter.build(list(module.parameters()), **HP)

    torch.manual_seed(0)
    module, opt = stepped()
    for p in module.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    saved = {n: opt.state[p]["momentum_buffer"].clone() for n, p in module.named_parameters()}

    own_module, own = stepped(module)
    own.load_state_dict(opt.state_dict())
    for n, p in own_module.named_parameters():
        assert torch.equal(own.state[p]["momentum_buffer"], saved[n]), n

    dcp_module, resumed = stepped(module)
    set_optimizer_state_dict(dcp_module, resumed, get_optimizer_state_dict(module, opt))
    assert all(p not in resumed.state for p in dcp_module.parameters())  # every buffer dropped


@pytest.mark.timeout(300)
def test_lerobot_rebuilds_the_wrong_rows_where_fsdp2_chunks_differ_from_its_rule() -> None:
    """At W = 3 a (7, 4) matrix is sharded by FSDP2 as torch.chunk does (3, 3, 1 rows), while its all-gather is
    unpadded by the rule "the first rows % W ranks hold ceil(rows / W)" (3, 2, 2: muon.py's mega-batch): the
    gathered matrix is wrong and the update departs with no error (badly_scaled, fp32, 1 step); uneven at W = 3
    ((5, 5): chunk 2, 2, 1 equals the rule) is bitwise."""
    outcomes = by_family(run_families(_adapter(), ("badly_scaled", "uneven"), (3,), steps=1))
    assert outcomes["uneven"]["status"] == "bitwise", outcomes["uneven"]
    assert outcomes["badly_scaled"]["status"] == "differs", outcomes["badly_scaled"]
