"""xtuner's FSDP2 Muon on the paths of InternLM/xtuner PR 1716 that tests/test_system_adapters.py does not reach
(muon_check/adapters/xtuner_paths.py): the padded all-to-all remainder strategy, the all-gather +
reduce-scatter path under NCCL's buffer shapes, the fused expert layout with num_experts, the expert-parallel
(fsdp, ep) mesh, and xtuner's own builder as a training setup. Each test pins a finding with its cause, so that it
fails when xtuner changes it. Without $MUON_XTUNER_CHECKOUT (a checkout of InternLM/xtuner, the folder holding
`xtuner`) every test skips; the setup tests also need xtuner's cyclopts, loguru and mmengine importable."""

from __future__ import annotations

import importlib.util

import pytest

from muon_check.adapters.systems import XTUNER_CHECKOUT_ENV
from muon_check.adapters.xtuner_paths import (
    EP_CASES,
    XtunerFusedAgrs,
    XtunerFusedAgrsNccl,
    XtunerPadAll2All,
    XtunerSetup,
    XtunerSetupNccl,
    run_ep,
)
from tests.system_checks import require_checkout, run_families


def _checkout() -> None:
    require_checkout(
        XTUNER_CHECKOUT_ENV,
        "xtuner/v1/optim/muon.py",
        "a checkout of InternLM/xtuner (b934f462 or later)",
    )


def _setup_packages() -> None:
    missing = [m for m in ("cyclopts", "loguru", "mmengine") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(
            f"xtuner/v1/config/optim.py needs {missing}: pip install --no-deps --target DIR cyclopts attrs "
            "docstring-parser rich-rst docutils loguru mmengine addict yapf termcolor platformdirs, DIR on "
            "PYTHONPATH"
        )


_run = run_families  # two float32 steps of the families through the check


@pytest.mark.timeout(300)
def test_pad_all2all_runs_remainder_and_fused_experts_bitwise_where_agrs_is_refused_by_gloo() -> (
    None
):
    """The shipped remainder strategy "agrs" sends a fused expert param ([10, 3], num_experts 5) alone on W = 2
    through reduce_scatter_tensor with a (W, K) input and a (K,) output, which gloo refuses; remainder_strategy
    "pad_all2all" pads the batch and is bitwise equal to `xtuner` + scale_apply "update_lr" per expert."""
    _checkout()
    refused = _run(XtunerFusedAgrs(), ("fused_sharded",), (2,))
    assert [o["status"] for o in refused] == ["crash"]
    assert "outputShape[0] * worldSize == inputShape[0]" in refused[0]["error"]
    padded = _run(XtunerPadAll2All(), ("fused_sharded", "remainder"), (2,))
    assert [o["status"] for o in padded] == ["bitwise", "bitwise"]


@pytest.mark.timeout(300)
def test_agrs_is_bitwise_under_nccl_buffer_shapes() -> None:
    """With gloo given NCCL's buffer shapes (nccl_buffer_shapes), the shipped all-gather + reduce-scatter path of
    remainder batches is bitwise equal to the claim on the remainder and fused_sharded families at W = 2."""
    _checkout()
    outcomes = _run(XtunerFusedAgrsNccl(), ("fused_sharded", "remainder"), (2,))
    assert [o["status"] for o in outcomes] == ["bitwise", "bitwise"]


@pytest.mark.timeout(300)
def test_pad_all2all_turns_the_asym_none_hang_into_mixed_params() -> None:
    """A param without a gradient on one rank only (asym_none): each rank batches its own params with a grad
    (muon.py:607); under "pad_all2all" the short batch is padded to W, so the all-to-all's sizes agree and it does
    not hang as "agrs" does, but rank 0 assembles param 0 from its own shard and rank 1's shard of param 1: the
    step differs from the claim (no error raised)."""
    _checkout()
    outcomes = _run(XtunerPadAll2All(), ("asym_none",), (2,))
    assert [o["status"] for o in outcomes] == ["differs"]


@pytest.mark.timeout(300)
def test_ep_mesh_agrs_pads_to_global_rows_and_mixes_experts() -> None:
    """On xtuner's (fsdp 2, ep 2) mesh with a fused param of E = 6 (3 experts per EP rank), one param is a
    remainder batch: the padded all-to-all is bitwise per expert, while AGRS (under NCCL's buffer shapes) pads
    each shard to ceil(global rows / fsdp) (muon.py:916, 984-985: X[0].size(0) is the global 12 rows, the fsdp
    group holds the EP rank's 6), so zero rows sit between the shards and the num_experts blocks straddle
    experts: it differs. Placements (Shard(0), Shard(0)), which xtuner's EP branch reads (641-666). W = 4."""
    _checkout()
    case = (EP_CASES[1],)
    assert run_ep(XtunerPadAll2All(), case, strided=False)[0][1] == "bitwise"
    assert run_ep(XtunerFusedAgrsNccl(), case, strided=False)[0][1] == "differs"


@pytest.mark.timeout(300)
def test_ep_mesh_with_torch_strided_shard_orthogonalises_slabs() -> None:
    """FSDP2 of torch 2.13 places a param that EP sharded on dim 0 as (_StridedShard(0, ep), Shard(0)) on the
    (fsdp, ep) mesh. Where _StridedShard is no Shard (`is_shard()` False, torch 2.13), xtuner's filter (muon.py:
    628-630) sees only the EP dim, divides num_experts by the ep size as if ep were the fsdp dim (677-683) and
    orthogonalises row slabs of the experts locally: the local-experts case differs, where with (Shard(0),
    Shard(0)) it is bitwise. W = 4. Under a torch whose _StridedShard is a Shard the cause is absent and the test
    skips, saying so (what xtuner computes there is not established)."""
    _checkout()
    from torch.distributed.tensor.placement_types import _StridedShard

    if _StridedShard(0, split_factor=2).is_shard():
        pytest.skip("this torch's _StridedShard is a Shard: the cause (xtuner's filter) is absent")
    case = (EP_CASES[0],)
    assert run_ep(XtunerPadAll2All(), case, strided=False)[0][1] == "bitwise"
    assert run_ep(XtunerPadAll2All(), case, strided=True)[0][1] == "differs"


@pytest.mark.timeout(300)
def test_xtuner_builder_as_setup_is_refused_by_gloo_and_clean_under_nccl_buffer_shapes() -> None:
    """MuonConfig().build(model) on the audit's model under FSDP2 at W = 2: its remainder batches' reduce-scatter
    is refused by gloo; with NCCL's buffer shapes every param is routed and orthogonalised as xtuner's rule
    claims (a 3-D stack flattened to one matrix), and the invariance families are bitwise across W = 1, 2."""
    _checkout()
    _setup_packages()
    from muon_check.api import audit_setup, setup_invariance

    refused = audit_setup(XtunerSetup(), world_size=2, micro_batches=2).raw["findings"]
    assert any("reduce_scatter_tensor" in f["text"] for f in refused), refused
    audit_setup(XtunerSetupNccl(), world_size=2, micro_batches=2).assert_clean()
    setup_invariance(XtunerSetupNccl(), world_sizes=(1, 2), micro_batches=2, steps=2).assert_clean()
