"""The system adapters (muon_check/adapters/systems.py): each claim is a valid muon_ref configuration; each
adapter whose package or checkout is present runs its system's own optimizer code through the conformance check;
and the causes of their departures found by hand (docs/field-systems.md) are pinned, so that a test fails when the
system changes them. Without the package or checkout a test skips with what installs it (`make field` installs
all of them into .venv-field and runs this module there)."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from muon_check import conformance
from muon_check.adapters import Adapter
from muon_check.adapters.cases import (
    DIST_FAMILIES,
    MATRIX_FAMILIES,
    SINGLE_FAMILIES,
    UNREDUCED_FAMILIES,
    Case,
)
from muon_check.adapters.diagnose import diagnose, gloo_refusal
from muon_check.adapters.oracle import Outcome, claim_of
from muon_check.adapters.systems import (
    EMERGING_CHECKOUT_ENV,
    LLAMAFACTORY_CHECKOUT_ENV,
    MEGATRON_PATH_ENV,
    SYSTEMS,
    XTUNER_CHECKOUT_ENV,
    DeepSpeedMuon,
    DeepSpeedMuonZero1,
    DeepSpeedMuonZero2,
    DeepSpeedMuonZero3,
    EmergingMuon,
    LlamaFactoryV0Muon,
    LlamaFactoryV1Muon,
    MegatronTensorParallelMuon,
    VeomniMuon,
    XtunerMuon,
)
from muon_ref.config import CONFIG_KEYS, MuonConfig
from muon_ref.presets import preset_defaults
from tests.system_checks import require_checkout, run_families

ADAPTERS = list(SYSTEMS)
INSTALL = {
    "llamafactory": "pip install --no-deps llamafactory==0.9.5",
    "veomni": "pip install --no-deps veomni==0.1.12 && pip install transformers==5.9.0",
    "deepspeed": "DS_BUILD_OPS=0 pip install --no-deps --no-build-isolation deepspeed==0.19.8 "
    "&& pip install einops hjson msgpack ninja psutil py-cpuinfo pydantic tqdm",
    "llamafactory.train.trainer_utils": "pip install --no-deps llamafactory==0.9.5 and the Makefile's "
    "FIELD_LLAMAFACTORY_DEPS",
}
CHECKOUTS = {
    "MUON_AREAL_CHECKOUT": "a folder holding areal/engine/fsdp_utils/muon.py of inclusionAI/AReaL PR 1270 at 7d18cca0",
    LLAMAFACTORY_CHECKOUT_ENV: "a checkout of hiyouga/LlamaFactory",
    XTUNER_CHECKOUT_ENV: "a checkout of InternLM/xtuner",
    EMERGING_CHECKOUT_ENV: "a checkout of NVIDIA-NeMo/Emerging-Optimizers (needs absl-py)",
    MEGATRON_PATH_ENV: "a folder holding megatron-core 0.19.2 and emerging-optimizers 0.3.0 (make field)",
}


def _package(module: str) -> None:
    """Skip, with the install command, when `module` does not import here."""
    try:
        importlib.import_module(module)
    except ImportError as e:
        pytest.skip(f"{module} does not import ({e}); install: {INSTALL[module]} (or: make field)")


def _checkout(env: str, inner: str) -> str:
    """Skip, naming the variable and what it should hold, when $env is unset or wrong."""
    return require_checkout(env, inner, f"{CHECKOUTS[env]} (make field sets it)")


_run = run_families  # two float32 steps of the families through `python -m muon_check`'s check


def _statuses(outcomes: list[dict]) -> list[str]:
    return [o["status"] for o in outcomes]


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda a: a.__name__)
def test_each_system_adapter_claims_a_valid_muon_ref_configuration(adapter: type[Adapter]) -> None:
    """Each adapter's claim (preset and options) builds a MuonConfig, and its families are the check's."""
    preset, overrides = claim_of(adapter())
    values = preset_defaults(preset, overrides)  # raises ValueError on an unknown option or value
    MuonConfig(**{k: values[k] for k in CONFIG_KEYS})
    everything = SINGLE_FAMILIES | DIST_FAMILIES | UNREDUCED_FAMILIES
    assert adapter.families and adapter.families <= everything


def _crash(family: str, error: str) -> Outcome:
    return Outcome(Case(family, "dtensor", 2, ((3, 3),)), "crash", error=error)


def test_a_crash_that_only_gloo_refuses_is_named_could_not_run_on_gloo_with_its_collective() -> (
    None
):
    """A crash that is gloo refusing a collective NCCL takes (all_to_all of unequal shapes, reduce_scatter_tensor's
    first-dimension check) is named "could not run on gloo" with the collective, never "bug"; any other crash stays
    a crash (negative control)."""
    all_to_all = (
        "RuntimeError: ProcessGroupGloo::alltoall: invalid tensor size at index 1 (expected (2, 3)"
    )
    reduce_scatter = (
        "RuntimeError: [rank0]:[F1125 ProcessGroupGloo.cpp:1537] Check failed: "
        "outputShape[0] * worldSize == inputShape[0] (20 vs. 2)."
    )
    outcomes = [
        _crash("uneven", all_to_all),
        _crash("remainder", reduce_scatter),
        Outcome(Case("even", "dtensor", 2, ((4, 3),)), "bitwise"),
    ]
    line = diagnose(outcomes, "torch", {})
    assert "could not run on gloo (all_to_all" in line and "on uneven (1/1: W=2)" in line, line
    assert "could not run on gloo (reduce_scatter_tensor" in line and "remainder" in line, line
    assert "bug" not in line and "crashes on" not in line, line
    # negative control: any other crash stays a crash
    other = diagnose(
        [_crash("experts", "RuntimeError: Attempting to broadcast a dimension")], "torch", {}
    )
    assert other.startswith("crashes on experts"), other
    assert gloo_refusal("RuntimeError: ProcessGroupNCCL error") is None


def test_a_checkout_adapter_without_its_checkout_names_the_environment_variable(
    monkeypatch,
) -> None:
    """Without its checkout, a checkout adapter raises a ValueError naming the environment variable to set."""
    monkeypatch.delenv(XTUNER_CHECKOUT_ENV, raising=False)
    with pytest.raises(ValueError, match=XTUNER_CHECKOUT_ENV):
        XtunerMuon().build([])


@pytest.mark.timeout(240)
def test_llamafactory_v0_muon_steps_bitwise_like_moonlight() -> None:
    """llamafactory 0.9.5's Muon is bitwise equal to preset moonlight on tall and wide matrices."""
    _package("llamafactory")
    assert _statuses(_run(LlamaFactoryV0Muon(), ("tall", "wide"), (1,))) == ["bitwise"] * 2


@pytest.mark.timeout(300)
def test_llamafactory_v1_muon_is_bitwise_on_uneven_shards_and_loses_its_momentum_on_a_dcp_resume() -> (
    None
):
    """The v1 plugin is bitwise on uneven FSDP2 shards at W = 2, and a DCP resume departs with its momentum lost (its
    state holds only `use_muon` at construction, so DCP's template has no buffer to load into)."""
    _checkout(LLAMAFACTORY_CHECKOUT_ENV, LlamaFactoryV1Muon.module_path)
    outcomes = _run(LlamaFactoryV1Muon(), ("uneven", "checkpoint"), (2,))
    by_family = {o["family"]: o for o in outcomes}
    assert by_family["uneven"]["status"] == "bitwise", by_family["uneven"]
    # `self.state[p]["use_muon"] = True` at construction: DCP's template has no momentum_buffer to load into
    resumed = by_family["checkpoint"]
    assert resumed["status"] == "differs" and resumed["state_diff"] > 0, resumed


def _bitwise_on_one_refused_by_gloo_on_other(
    outcomes: list[dict], bitwise: str, refused: str, marker: str
) -> None:
    """The case of family `bitwise` is bitwise; the case of family `refused` crashes in gloo (`marker` in its
    error: a collective NCCL accepts and gloo refuses)."""
    by_family = {o["family"]: o for o in outcomes}
    assert by_family[bitwise]["status"] == "bitwise", by_family[bitwise]
    crash = by_family[refused]
    assert crash["status"] == "crash" and marker in crash["error"], crash


@pytest.mark.timeout(300)
def test_veomni_muon_is_bitwise_on_even_shards_and_gloo_refuses_its_uneven_all_to_all() -> None:
    """VeOmni's Muon is bitwise on even shards at W = 2; on uneven ones gloo refuses its list-form all_to_all."""
    _package("veomni")
    _bitwise_on_one_refused_by_gloo_on_other(
        _run(VeomniMuon(), ("even", "uneven"), (2,)), "even", "uneven", "ProcessGroupGloo::alltoall"
    )


@pytest.mark.timeout(300)
def test_veomni_muon_crashes_on_expert_stacks_split_unevenly() -> None:
    """_compute_ortho's Shard(0) 3-D path rebuilds the DTensor with DTensor.from_local(...) and no shape: the
    global shape is inferred as local rows times W, (4, 4, 3) for E = 3 on W = 2, and the update cannot be added."""
    _package("veomni")
    (outcome,) = _run(VeomniMuon(), ("experts",), (2,))
    assert outcome["status"] == "crash" and "broadcast" in outcome["error"], outcome


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "adapter",
    [DeepSpeedMuon, DeepSpeedMuonZero1, DeepSpeedMuonZero2, DeepSpeedMuonZero3],
    ids=lambda a: f"stage{a.zero_stage}",
)
def test_deepspeed_muon_built_by_deepspeed_initialize_steps_bitwise_like_keller(
    adapter: type[DeepSpeedMuon],
) -> None:
    """Built by deepspeed.initialize at each ZeRO stage, DeepSpeed's Muon is bitwise equal to its claim (keller,
    scale_sqrt sqrt) on even and partition-straddling params at W = 2."""
    _package("deepspeed")
    assert _statuses(_run(adapter(), ("even", "straddle"), (2,))) == ["bitwise"] * 2


@pytest.mark.timeout(300)
def test_deepspeed_resumes_bitwise_through_its_engine_and_loses_the_muon_momentum_it_keeps_in_memory() -> (
    None
):
    """The checkpoint family through DeepSpeed's own save and load (`engine.save_checkpoint` /
    `engine.load_checkpoint`): ZeRO-3 resumes bitwise at the same W (the steps after the resume depend on the
    restored momentum); with `save_muon_momentum_buffer_in_memory` (its documented example's key) the loaded
    momentum lands in optimizer.state while the step reads its in-memory buffer (stage3.py), still zeros, so the
    first step after the resume departs; at another W, ZeRO refuses with its stated message."""
    _package("deepspeed")
    from muon_check.adapters.systems import DeepSpeedMuonZero3InMemory

    assert _statuses(_run(DeepSpeedMuonZero3(), ("checkpoint",), (1,))) == ["bitwise"]
    (lost,) = _run(DeepSpeedMuonZero3InMemory(), ("checkpoint",), (1,))
    assert lost["status"] == "differs", lost
    assert lost["first_step"] == (lost["steps"] + 1) // 2 + 1, lost  # the first step after the save
    refused = _run(DeepSpeedMuonZero1(), ("checkpoint",), (1, 2))
    assert _statuses(refused) == ["crash", "crash"], refused
    assert all("Automatic adjustment of ZeRO's optimizer state" in o["error"] for o in refused)


@pytest.mark.timeout(300)
def test_xtuner_muon_is_bitwise_with_its_tensor_lr_and_its_reduce_scatter_is_refused_by_gloo() -> (
    None
):
    """xtuner's Muon is bitwise under its claim (scale_apply update_lr) on uneven shards at W = 2; its remainder
    batches' reduce-scatter is refused by gloo."""
    _checkout(XTUNER_CHECKOUT_ENV, "xtuner/v1/optim/muon.py")
    _bitwise_on_one_refused_by_gloo_on_other(
        _run(XtunerMuon(), ("uneven", "remainder"), (2,)), "uneven", "remainder", "ProcessGroupGloo"
    )


@pytest.mark.timeout(240)
def test_emerging_muon_steps_bitwise_like_its_preset_with_eps_1e_15() -> None:
    """Emerging-Optimizers' Muon is bitwise equal to preset emerging with eps 1e-15 on every matrix family."""
    _checkout(EMERGING_CHECKOUT_ENV, "emerging_optimizers")
    _package_absl()
    families = tuple(sorted(MATRIX_FAMILIES))
    assert _statuses(_run(EmergingMuon(), families, (1,))) == ["bitwise"] * len(families)


@pytest.mark.timeout(300)
def test_megatron_tensor_parallel_muon_steps_bitwise_on_even_tp_shards() -> None:
    """megatron-core's TensorParallelMuon (duplicated mode) is bitwise equal to preset emerging on even TP shards."""
    _checkout(MEGATRON_PATH_ENV, "megatron/core/optimizer")
    _package_absl()
    assert _statuses(_run(MegatronTensorParallelMuon(), ("even",), (2,))) == ["bitwise"]


def test_megatron_blockwise_mode_departs_on_row_blocks_and_distributed_on_wide_matrices() -> None:
    """tp_mode "blockwise" orthogonalises each rank's row block (bitwise at W = 1, departs at W = 2); "distributed"
    iterates on the transpose of a matrix sharded along its smaller dim, which under Megatron's default
    fp32_matmul_prec "medium" departs even at W = 1 on a wide (2, 5) matrix; its non-TP path (a plain
    param, no partition_dim) stays bitwise."""
    _checkout(MEGATRON_PATH_ENV, "megatron/core/optimizer")
    _package_absl()
    from muon_check.adapters.systems import (
        MegatronTensorParallelMuonBlockwise,
        MegatronTensorParallelMuonDistributed,
    )

    assert _statuses(_run(MegatronTensorParallelMuonBlockwise(), ("even",), (1, 2))) == [
        "bitwise",
        "differs",
    ]
    outcomes = _run(MegatronTensorParallelMuonDistributed(), ("even", "tall"), (1,))
    assert {o["family"]: o["status"] for o in outcomes} == {"even": "differs", "tall": "bitwise"}


def _package_absl() -> None:
    if importlib.util.find_spec("absl") is None:
        pytest.skip(
            "absl-py is not installed (Emerging-Optimizers imports it): pip install absl-py"
        )


# ------------------------------------------------------------------- field systems as training setups


def _setup_audit(
    cls: type, world_size: int, micro_batches: int, sharding: str | None = None
) -> dict:
    from muon_check.audit import audit

    setup = cls()
    if sharding is not None:
        setup.sharding = sharding
    return audit(setup, world_size, micro_batches, timeout=240.0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", ["zero0", "zero1", "zero2", "zero3"])
def test_deepspeed_under_its_shipped_config_routes_and_orthogonalises_as_it_claims(
    stage: str,
) -> None:
    """deepspeed.initialize with {"optimizer": {"type": "Muon"}} and the stage only: every matrix but the
    embedding to Muon, each whole (experts per expert), Newton-Schulz once per optimizer step with 2
    micro-batches (the #8443 fix is in 0.19.8), no finding."""
    _package("deepspeed")
    from muon_check.adapters.field_setups import DeepSpeedSetup

    rep = _setup_audit(DeepSpeedSetup, 2, 2, stage)
    assert rep["findings"] == [], rep["findings"]
    rows = {r["name"]: r for r in rep["rows"]}
    assert rows["layers.0.attn.wqkv.weight"]["seen"] == "1 x (24, 8) (claimed)"


@pytest.mark.timeout(600)
def test_deepspeed_is_invariant_without_clipping_and_its_default_clip_changes_muon_steps_with_the_stage() -> (
    None
):
    """Bitwise across ZeRO 0-3, W = 1 and 2 and 2 micro-batches with gradient_clipping 0; with the default 1.0,
    ZeRO 1-3 clip the orthogonalised update (stage_1_and_2.py: the norm is taken after Muon) where stage 0 clips
    the raw gradient (engine.py `_take_model_step`), so the layouts differ from the first step."""
    _package("deepspeed")
    from muon_check.adapters.field_setups import DeepSpeedSetup, DeepSpeedSetupNoClip
    from muon_check.invariance import invariance

    clean = invariance(DeepSpeedSetupNoClip(), (1, 2), 2, 2, timeout=240.0)
    assert clean["broken"] == [], clean
    shipped = invariance(DeepSpeedSetup(), (1, 2), 1, 1, timeout=240.0)
    assert shipped["broken"] == ["layout (zero1)", "layout (zero2)", "layout (zero3)"], shipped
    assert all(r["step"] == 1 for r in shipped["rows"] if r["status"] == "differs")


@pytest.mark.timeout(600)
def test_deepspeed_documented_muon_example_is_refused_at_zero3_as_written_and_runs_with_reduce_scatter_off() -> (
    None
):
    """DeepSpeed's own configuration example for Muon (ZeRO-3, no `reduce_scatter` key): its construction raises
    "Muon and reduce scatter cannot be used together" (stage3.py) on every rank, reported as one crash finding
    with no rows; with `"reduce_scatter": false` added it routes and orthogonalises as claimed and is bitwise
    across W = 1, 2 and 2 micro-batches."""
    _package("deepspeed")
    from muon_check.adapters.field_setups import (
        DeepSpeedSetupDocExample,
        DeepSpeedSetupDocExampleNoReduceScatter,
    )
    from muon_check.invariance import invariance

    refused = _setup_audit(DeepSpeedSetupDocExample, 2, 1)
    assert refused["rows"] == [] and [f["kind"] for f in refused["findings"]] == ["crash"], refused
    assert "Muon and reduce scatter cannot be used together" in refused["findings"][0]["text"]
    assert "rank 0, 1" in refused["findings"][0]["text"]
    assert _setup_audit(DeepSpeedSetupDocExampleNoReduceScatter, 2, 2)["findings"] == []
    rep = invariance(DeepSpeedSetupDocExampleNoReduceScatter(), (1, 2), 2, 2, timeout=240.0)
    assert rep["broken"] == [] and len(rep["rows"]) == 3, rep


@pytest.mark.timeout(600)
def test_llamafactory_builder_routes_as_its_rule_under_ddp_and_sends_every_matrix_to_adamw_under_zero3() -> (
    None
):
    """Its own `_create_muon_optimizer`: under DDP every 2-D matrix but the embedding to Muon, whole, on every
    rank; under DeepSpeed ZeRO-3 (params partitioned before it runs, as transformers' Trainer does) every matrix
    looks 1-D, all go to its AdamW branch (hiyouga/LlamaFactory#8041), and its first step raises."""
    import os

    os.environ.setdefault(
        "DISABLE_VERSION_CHECK", "1"
    )  # as field_setups does (its docstring says why)
    _package("llamafactory.train.trainer_utils")
    _package("deepspeed")
    from muon_check.adapters.field_setups import LlamaFactorySetup, LlamaFactoryZero3Setup

    assert _setup_audit(LlamaFactorySetup, 2, 1)["findings"] == []
    rep = _setup_audit(LlamaFactoryZero3Setup, 2, 1)
    kinds = [f["kind"] for f in rep["findings"]]
    assert kinds.count("silent fallback") == 7 and kinds[0] == "crash", rep["findings"]
    assert (
        "KeyError: 'use_muon' (llamafactory/third_party/muon/muon.py:" in rep["findings"][0]["text"]
    )


@pytest.mark.timeout(600)
def test_llamafactory_v1_documented_muon_example_routes_as_its_rule_and_is_invariant_on_fsdp2() -> (
    None
):
    """Its v1 plugin `create_muon_optimizer` with examples/v1/train_full/train_full_muon.yaml (read from the
    checkout) on FSDP2: every 2-D matrix but the embedding to Muon, each orthogonalised whole on every rank once
    per step (its stated full_tensor path), no finding; bitwise across W = 1, 2 and 2 micro-batches."""
    _checkout(LLAMAFACTORY_CHECKOUT_ENV, "examples/v1/train_full/train_full_muon.yaml")
    from muon_check.adapters.field_setups import LlamaFactoryV1Setup
    from muon_check.invariance import invariance

    rep = _setup_audit(LlamaFactoryV1Setup, 2, 2)
    assert rep["findings"] == [], rep["findings"]
    rows = {r["name"]: r for r in rep["rows"]}
    assert rows["layers.0.attn.wo.weight"]["path"] == "every rank (full_tensor)"
    assert rows["layers.1.mlp.large.weight"]["claim"] == "other"
    assert invariance(LlamaFactoryV1Setup(), (1, 2), 2, 2, timeout=240.0)["broken"] == []


@pytest.mark.timeout(600)
def test_veomni_builder_on_an_hsdp_mesh_could_not_run_on_gloo() -> None:
    """VeOmni's `build_optimizer(optimizer_type="muon")` on a 2 x 2 HSDP mesh: its routing is its rule, and its
    owner all-to-all pairs params of different shapes in one list-form `dist.all_to_all`, which gloo refuses
    (NCCL takes it): named as could not run on gloo, with VeOmni's line."""
    _package("veomni")
    from muon_check.adapters.field_setups import VeomniSetup

    rep = _setup_audit(VeomniSetup, 4, 1, "hsdp")
    (first, *rest) = rep["findings"]
    assert first["kind"] == "could not run on gloo" and "veomni/optim/muon.py:" in first["text"], (
        first
    )
    assert rest == [], rest


def test_areal_pr_muon_is_bitwise_on_even_shards_and_its_gather_crashes_on_uneven_ones() -> None:
    """AReaL PR 1270's Muon: bitwise like keller + match_rms_adamw (sqrt) on even shards in bf16; gloo stops its
    gather into buffers of the destination's box on uneven shards (class 13)."""
    from muon_check.adapters.systems import AREAL_CHECKOUT_ENV, ArealMuon

    _checkout(AREAL_CHECKOUT_ENV, "areal/engine/fsdp_utils")
    report = conformance.check(
        ArealMuon(), (2,), 2, 240.0, 0.0, ("even", "uneven"), ("bfloat16",), log=lambda *_: None
    )
    statuses = {o["family"]: o["status"] for o in report["outcomes"]}
    assert statuses == {"even": "bitwise", "uneven": "crash"}, report["outcomes"]
