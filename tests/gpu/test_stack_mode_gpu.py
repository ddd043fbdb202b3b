"""The stack mode (muon_ref.MuonConfig.ns_stack, docs/conventions.md "Stacks") on CUDA (run: pytest -m gpu).

On CUDA a batched product is another kernel than a single one (cuBLAS's strided-batched GEMM), so an origin that
runs `X @ X.mT` on a 3-D stack may differ from muon_ref's per-matrix default in bits; `ns_stack="batched"` runs the
same batched ops, so its contract holds on any device: bitwise the batched restatement, and bitwise KellerJordan's
SingleDeviceMuon as it ships on 3-D params (the conformance check on the device).
"""

from __future__ import annotations

import pytest
import torch

from muon_check import conformance
from muon_check.adapters.cases import Case
from muon_check.adapters.origins import KellerOrigin
from muon_check.fixtures import same_bits
from muon_ref import newton_schulz
from tests.conftest import require
from tests.test_newton_schulz import KELLER5, _batched_restatement, _memory_order

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
STACKS = [(3, 2, 34), (4, 24, 24), (5, 40, 24), (2, 37, 6), (8, 128, 64)]


@pytest.mark.parametrize("step_form", ["addmm", "keller", "dion"])
@pytest.mark.parametrize("shape", STACKS, ids=str)
def test_a_batched_stack_is_the_batched_restatement_bitwise_on_cuda(shape, step_form):
    """stack="batched" on a CUDA stack: the restatement's batched ops, bit for bit and in its memory order."""
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    got = newton_schulz(G, step_form=step_form, stack="batched")
    want = _batched_restatement(G, KELLER5, step_form)
    assert same_bits(got, want) and _memory_order(got) == _memory_order(want)


@pytest.mark.parametrize("shape", STACKS[:4], ids=str)
def test_kellerjordans_muon_on_cuda_stacks_is_keller_with_batched_stacks_bitwise(shape):
    """KellerJordan's SingleDeviceMuon as it ships, 5 steps on a 3-D stack on CUDA, against preset keller with
    ns_stack="batched" (KellerOrigin's claim): bitwise, no rounding named."""
    require("muon", "muon-optimizer")
    case = Case("drawn", "single", 1, (shape,), steps=5, device=DEVICE)
    outcome = conformance.run_here(KellerOrigin(), case)
    assert outcome.status == "bitwise" and outcome.elementwise is None, outcome.summary()
