"""muon_ref's Newton-Schulz with each product run once for a whole stack, always ("batched" backend).

Reference equation, for every direction D, layout and config:
    BACKEND.orthogonalize(D, layout, cfg) ~ muon_ref.orthogonalize(D, layout, cfg)    a measured tolerance
The kernel is muon_dist.kernels.reference.newton_schulz_batched: muon_ref's "addmm" step with one bmm / baddbmm per
product for the stack, each matrix its own norm and its own transpose decision (shared by the stack's matrices, which
share a shape). The torch backend runs that kernel only where a probe shows it bitwise; this one runs it on every
stack it can, and the step stacks same-shape matrices of different params into one stack
(muon_dist.kernels.orthogonalize_many), as Dion's megabatches do. So its results differ from muon_ref's only where a
batched product rounds otherwise than one product per matrix: where oneDNN takes the dtype's CPU matmuls (bf16 on
CPUs with AVX512_BF16 or AMX), where ATen's small-product loop runs (contraction * rows * cols < 400), MKL's batched
float32 GEMM, and a GPU's batched GEMMs. A config the batched kernel does not implement (a step_form other than
"addmm", the AOL preconditioner) runs muon_ref.newton_schulz itself, bitwise.

Contract, against muon_ref.newton_schulz under the same config (step_form "addmm"), on the CPU, per matrix whatever
else its stack holds: max |difference| <= 1e-5 (float32), 8e-3 (float16), 2^-6 (bfloat16: two bf16 ulps of 1),
measured at most 2.7e-6, 1.5e-3 and 3.9e-3 (one bf16 ulp at 0.5) by `python -m muon_dist.kernels.reference --stacks
300` (random stacks of 2-6 matrices, sides 1-160, schedules keller, you5, polar_express; muon_ref's loop against this
kernel) on an AVX512 Xeon where oneDNN takes bf16 matmuls; `python -m muon_dist.kernels.contracts --backends batched
--cases 40` measures at most 1.4e-6 (float32) and 1.9e-6 (float16), bfloat16 bitwise there, so its bfloat16 signed
singular values are muon_ref's own bands on those inputs. docs/kernels.md, "The batched backend's tolerance", has the
measurements; tests/test_kernels.py asserts the bounds on stacks of every kind, a matrix alone and inside stacks of
others, and the bands widened by 2 bf16 ulps of 1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from muon_ref import MuonConfig

from . import Backend, over_stacks
from .reference import preconditioner, stack_through


def runs_batched(cfg: MuonConfig) -> bool:
    """Whether the batched kernel implements cfg's Newton-Schulz: step_form "addmm" and no preconditioner."""
    kwargs = cfg.ns_kwargs()
    return kwargs.get("step_form", "addmm") == "addmm" and preconditioner(kwargs) is None


def _stack_kernel(stack: Tensor, cfg: MuonConfig) -> Tensor:
    """A stack [k, m, n] through newton_schulz_batched under cfg's Newton-Schulz (muon_ref.newton_schulz where
    runs_batched says the batched kernel does not implement it)."""
    return stack_through(stack, cfg, runs_batched(cfg))


def _batches(
    matrix: tuple[int, int], input_dtype: torch.dtype, device: torch.device, cfg: MuonConfig
) -> bool:
    return runs_batched(cfg)


BACKEND = Backend(
    "batched",
    over_stacks(_stack_kernel),
    bitwise=False,
    reads_through_cast=True,
    stack=_stack_kernel,
    batches=_batches,
)  # contract: this module's docstring
