"""The setup audit (muon_check/audit.py), its instrument (trace.py) and the invariance families
(invariance.py): the project's own setups draw no finding and stay invariant; every planted setup bug draws the
finding that names it (and breaks the invariance it breaks); the trace counts one Newton-Schulz call per matrix in
every form and marks only tensor-parallel calls distributed."""

from __future__ import annotations

import pytest
import torch

import muon_ref
from muon_check.adapters import setups
from muon_check.adapters.planted_setups import (
    CONTROL_SETUPS,
    PLANTED_SETUPS,
    NSPerMicroBatch,
    ReducingMuon,
)
from muon_check.audit import attribute, audit, catalogue, probe_gradients
from muon_check.invariance import invariance
from muon_check.launch import RankPool
from muon_check.trace import Trace
from muon_ref.gram import gram_newton_schulz


@pytest.mark.parametrize("preset", ["torch", "keller", "moonlight", "dion", "xtuner", "emerging"])
def test_the_trace_counts_one_call_per_matrix_with_its_iterations(preset: str) -> None:
    """Each matrix (each expert of a stack) is one call whose input is the normalised direction; the call's
    later Gram products are its iterations, not new calls."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(3, 5, 7))]
    for p in params:
        p.grad = torch.randn(p.shape)
    opt = muon_ref.Muon(params, preset=preset)
    with Trace() as t:
        opt.step()
    assert [tuple(c.inputs[0].shape) for c in t.calls] == [(4, 6), (5, 7), (5, 7), (5, 7)]
    assert len({c.grams for c in t.calls}) == 1 and t.calls[0].grams >= 5, (
        t.calls
    )  # one per iteration
    assert not any(c.distributed for c in t.calls)
    cos = torch.nn.functional.cosine_similarity(
        t.calls[0].inputs[0].flatten(), params[0].grad.T.double().flatten(), dim=0
    )
    assert cos > 0.999  # the input is the direction (the first step's momentum is a multiple of G)


def test_the_trace_counts_a_gram_newton_schulz_and_no_other_product() -> None:
    """Gram Newton-Schulz (X^T X, then iterations on small matrices) is one call; products of two different
    tensors and A @ A (no transpose) are none."""
    G = torch.randn(12, 5)
    with Trace() as t:
        gram_newton_schulz(G)
        A = G.T @ torch.randn(12, 3)
        S = torch.randn(4, 4)
        S @ S
    assert len(t.calls) == 1 and A.shape == (5, 3)


def _tensor_parallel_ns(distributed: bool) -> tuple[int, bool]:
    """Newton-Schulz on column shards with the Gram matrix all-reduced (distributed) or on the whole matrix
    with its result all-gathered afterwards (not distributed)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    G = torch.randn(4, 8)
    rank, W = dist.get_rank(), dist.get_world_size()
    with Trace() as t:
        if distributed:
            X = G[:, rank * 8 // W : (rank + 1) * 8 // W] / G.norm()
            for _ in range(3):
                A = X @ X.T
                dist.all_reduce(A)
                X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
        else:
            X = G / G.norm()
            for _ in range(3):
                A = X @ X.T
                X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
            out = torch.empty(W * X.shape[0], X.shape[1])
            dist.all_gather_into_tensor(out, X.contiguous())
    return len(t.calls), t.calls[0].distributed


@pytest.mark.timeout(120)
def test_the_trace_marks_a_call_distributed_only_when_its_gram_crosses_ranks() -> None:
    """One call either way; distributed iff a collective reads the call's Gram before its next Gram product (the
    all-reduced Gram of column shards), not when it only carries the result (the all-gather afterwards)."""
    pool = RankPool(2, idle_s=10.0)
    try:
        assert pool.run(_tensor_parallel_ns, True) == [(1, True)] * 2
        assert pool.run(_tensor_parallel_ns, False) == [(1, False)] * 2
    finally:
        pool.close()


def _call_then_dtensor_overwrite() -> int:
    """One Newton-Schulz call; its result's memory rewritten by a DTensor op (copy_ of fresh data, as an
    optimizer's next DTensor momentum may land in a freed call buffer); a second call on that memory. The number
    of calls the trace counts."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with Trace() as t:
        X = torch.randn(4, 6) / 8
        for _ in range(2):  # the first call: its result is tainted by it
            A = X @ X.T
            X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
        D = DTensor.from_local(X, mesh, [Replicate()], run_check=False)
        D.copy_(DTensor.from_local(torch.randn(4, 6), mesh, [Replicate()], run_check=False))
        Y = D.to_local()  # X's memory, now fresh data
        Y @ Y.T
    return len(t.calls)


@pytest.mark.timeout(120)
def test_a_dtensor_op_clears_the_taint_of_the_memory_it_writes() -> None:
    """A DTensor op's output (here an in-place copy_ of fresh data) takes its inputs' taint on its local tensor,
    so a call read from memory that held an earlier call's result is a new call, not one more iteration of the
    earlier one (which merged calls of consecutive params in a DTensor optimizer's step)."""
    pool = RankPool(1, idle_s=10.0)
    try:
        assert pool.run(_call_then_dtensor_overwrite) == [2]
    finally:
        pool.close()


def test_the_probe_gradients_sum_to_the_step_gradient_bit_for_bit() -> None:
    """mean over ranks of the sum over micro-batches of G_{r,i} / k is G exactly (the reduction order of any
    layout cannot change it), and the parts differ from G (a partial gradient is told apart)."""
    G, parts = probe_gradients(1, 4, 2, 0)
    for name, g in G.items():
        total = sum(parts[(r, i)][name] for r in range(4) for i in range(2)) / 4
        assert torch.equal(total, g)
        assert not torch.equal(parts[(0, 0)][name] * 2, g)


def test_a_matrix_that_is_no_view_of_any_gradient_is_unattributed() -> None:
    """Attribution needs |cos| >= MATCH_COS with one view: a random matrix matches none; a bf16 block of the
    step gradient matches its claimed block."""
    views = catalogue(setups.DistributedMuonFSDP().claimed(), 2, 1, 2, 0)
    assert attribute(torch.randn(8, 8), views)[0] is None
    G, _ = probe_gradients(1, 2, 1, 0)
    view, cos = attribute(G["layers.0.attn.wqkv.weight"][8:16].bfloat16(), views)
    assert (view.name, view.label, view.block, view.source) == (
        "layers.0.attn.wqkv.weight",
        "claimed",
        1,
        "G",
    ) and cos > 0.999


OWN = {
    "DistributedMuonFSDP": (setups.DistributedMuonFSDP, 4, 2),
    "DistributedMuonHSDP": (setups.DistributedMuonHSDP, 4, 1),
    "MuonWithAdamWSingle": (setups.MuonWithAdamWSingle, 1, 1),
    "MuonWithAdamWDDP": (setups.MuonWithAdamWDDP, 2, 1),
    **CONTROL_SETUPS,
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(OWN))
def test_the_projects_own_setups_draw_no_finding(name: str) -> None:
    """Every param routed as claimed, each fused projection split, each expert on its own, and the path the setup
    claims (one owner per matrix and replica group for DistributedMuon)."""
    cls, w, k = OWN[name]
    rep = audit(cls(), w, k)
    assert rep["findings"] == [], rep["findings"]
    rows = {r["name"]: r for r in rep["rows"]}
    assert rows["layers.1.attn.wgqkv.weight"]["seen"] == "4 x (8, 8) (claimed)"
    assert rows["layers.1.mlp.large.weight"]["seen"] == "6 x (8, 12) (claimed)"
    assert rows["embed.weight"]["seen"] == "-" and rows["embed.weight"]["claim"] == "other"
    if cls.path == "sharded":
        replicas = 2 if cls.sharding == "hsdp" else 1
        assert rows["layers.0.mlp.up.weight"]["calls"] == replicas  # once per step, whatever k
        assert rows["layers.0.mlp.up.weight"]["path"].startswith("one owner per matrix")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(PLANTED_SETUPS))
def test_each_planted_setup_bug_draws_the_finding_that_names_it(name: str) -> None:
    """Each planted setup bug (PLANTED_SETUPS) draws its finding at its world size and micro-batches."""
    plant = PLANTED_SETUPS[name]
    rep = audit(plant.setup(), plant.world_size, plant.micro_batches)
    assert plant.finding in {f["kind"] for f in rep["findings"]}, rep["findings"]


@pytest.mark.timeout(300)
def test_the_invariance_families_hold_for_distributed_muon_and_name_what_breaks() -> None:
    """DistributedMuon on FSDP2 and HSDP, any world size and accumulation: bit for bit the reference. The planted
    Newton-Schulz-per-micro-batch breaks accumulation only; the unreduced straddlers break the world size."""
    ok = invariance(setups.DistributedMuonFSDP(), (1, 2, 4), 2, 2)
    assert ok["broken"] == [] and len(ok["rows"]) == 7, ok
    assert invariance(ReducingMuon(), (1, 2), 2, 2)["broken"] == []
    micro = invariance(NSPerMicroBatch(), (1, 2), 2, 2)
    assert micro["broken"] == ["gradient accumulation"], micro
    straddle = invariance(PLANTED_SETUPS["StraddlingUnreduced"].setup(), (1, 2), 1, 1)
    (row,) = straddle["rows"]
    assert row["status"] == "differs" and row["step"] == 1 and straddle["broken"] == ["world size"]


class _RaisingStep(setups.MuonWithAdamWSingle):
    """A setup whose step raises after its optimizer is built."""

    name = "raises in its step"

    def train_step(self, model, optimizers, probes) -> None:
        raise RuntimeError("planted failure\nsecond line")


@pytest.mark.timeout(120)
def test_a_step_that_raises_is_a_crash_finding_and_the_routing_is_still_read() -> None:
    """The audit reports the error's first line and where it was raised; the routing read at construction stays
    (every matrix in a Muon group: no finding), and what the step did not reach (no Newton-Schulz call) draws
    none."""
    rep = audit(_RaisingStep(), 1, 1)
    assert [f["kind"] for f in rep["findings"]] == ["crash"], rep["findings"]
    assert "RuntimeError: planted failure (" in rep["findings"][0]["text"]
    assert "test_setup_audit.py:" in rep["findings"][0]["text"]
    rows = {r["name"]: r for r in rep["rows"]}
    assert rows["layers.0.mlp.up.weight"]["optimizer"] == "MuonWithAdamW group 2 (algorithm='muon')"


class _OpRaisesInStep(setups.MuonWithAdamWSingle):
    """A setup whose step raises inside a torch op (a matmul of mismatched shapes), which the trace's dispatch mode
    runs for it."""

    name = "an op raises in its step"

    def train_step(self, model, optimizers, probes) -> None:
        torch.ones(2, 3) @ torch.ones(2, 3)


@pytest.mark.timeout(120)
def test_a_crash_inside_a_traced_op_is_located_in_the_code_that_called_it() -> None:
    """The crash finding names the frame that called the op (here this test file), never the audit's own
    instrument (trace.py's dispatch), through which every op of the step runs."""
    rep = audit(_OpRaisesInStep(), 1, 1)
    (finding,) = rep["findings"]
    assert finding["kind"] == "crash", finding
    assert "test_setup_audit.py:" in finding["text"] and "trace.py" not in finding["text"], finding


class _RefusedOnOneRank(setups.DistributedMuonFSDP):
    """A setup whose own builder refuses on rank 1 only (as an engine refuses a configuration)."""

    name = "refused on rank 1"

    def build(self, model):
        import torch.distributed as dist

        if dist.get_rank() == 1:
            raise ValueError("planted refusal\nsecond line")
        return super().build(model)


@pytest.mark.timeout(120)
def test_a_setup_its_own_code_refuses_to_build_is_one_crash_finding_with_no_rows() -> None:
    """A construction error on any rank is reported, not raised: no rows (nothing was routed), one crash finding
    naming the ranks, the error's first line and where it was raised; the other rank does not hang (the step,
    whose collectives it would wait in, is not run)."""
    rep = audit(_RefusedOnOneRank(), 2, 1)
    assert rep["rows"] == [] and [f["kind"] for f in rep["findings"]] == ["crash"], rep
    text = rep["findings"][0]["text"]
    assert text.startswith(
        "the setup's construction raised on rank 1: ValueError: planted refusal ("
    )
    assert "test_setup_audit.py:" in text


class _StepRaisesAtTwoRanks(setups.DistributedMuonFSDP):
    """A setup whose step raises on every rank once the world has two ranks (a refusal at some layouts only)."""

    name = "raises at W = 2"

    def train_step(self, model, optimizers, probes) -> None:
        import torch.distributed as dist

        if dist.get_world_size() == 2:
            raise RuntimeError("planted refusal at W = 2")
        super().train_step(model, optimizers, probes)


@pytest.mark.timeout(180)
def test_a_configuration_that_raises_is_a_could_not_run_row_not_a_traceback() -> None:
    """The invariance families run every configuration: one that raises is a row "could not run" with the
    failing rank's error, the others are still compared, and the verdict (and the API's `clean`) says so."""
    from muon_check.api import SetupReport

    rep = invariance(_StepRaisesAtTwoRanks(), (1, 2), 2, 1)
    by_config = {r["config"]: r for r in rep["rows"]}
    failed = [r for r in rep["rows"] if r["status"] == "could not run"]
    assert failed and all("planted refusal at W = 2" in r["error"] for r in failed), rep
    assert by_config["W = 1 (fsdp2, 2 micro-batches)"]["status"] == "bitwise", rep
    assert (
        rep["broken"] == []
        and rep["verdict"] == f"could not run {len(failed)} of {len(rep['rows'])}"
    )
    assert not SetupReport("invariance", rep).clean
