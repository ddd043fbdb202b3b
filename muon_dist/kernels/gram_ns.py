"""Gram Newton-Schulz on a whole stack at once: muon_ref.gram_newton_schulz with batched torch ops ("gram" backend).

Reference equations, for G [..., m, n], a direction D of a param's layout, a config cfg and the same arguments:
    gram_newton_schulz_batched(G, ...)  == muon_ref.gram_newton_schulz(G, ...)        bitwise or a tolerance (1.)
    BACKEND.orthogonalize(D, layout, cfg) ~ muon_ref.orthogonalize(D, layout, cfg)    a measured tolerance (2.)
The second is the backend against the oracle: another algorithm (Gram NS, a restart after step 2), equal to
Newton-Schulz in exact arithmetic only (muon_ref/gram.py, NS11).

For a stack X_0 of shape [E, m, n] with m <= n (muon_ref's transpose decision: one decision for the stack, since
its matrices share a shape), each segment between restarts is
    A = X X^T                                      bmm
    per step: Z = b A + c A A                      baddbmm(A, A, A, beta=b, alpha=c)
              Q = Z + a I (first step), else a Q + Q Z           baddbmm(Q, Q, Z, beta=a)
              A <- P A P: AP = a A + A Z, A = a AP + Z AP        baddbmm x2, skipped after the last step
    X <- Q X                                       bmm (a one-step segment: baddbmm(X, Z, X, beta=a))
the operation order of muon_ref.gram_segment, matrix by matrix. No Python loop over the E matrices and no
data-dependent control flow (the segments depend only on the step count and the restarts), so the function can
be wrapped in torch.compile (fullgraph=True captures it in one graph). The contracts below are for eager
execution, as the tests run it: inductor fuses the elementwise epilogues and rounds otherwise (docs/kernels.md,
"The Gram kernel's tolerance").

Everything but the batched products is muon_ref's public code: the options (resolve_ns_options), the restart
segments (restart_segments) and the normalisation (normalise, which takes each matrix's own norm in one
batched reduction).

Contract 1, against muon_ref.gram_newton_schulz with the same arguments, on the CPU; measured by
`python -m muon_dist.kernels.gram_ns` and asserted by tests/test_gram.py:
    bfloat16, min(m, n) >= 8: bitwise where ATen's own kernel runs bf16 matmuls (oneDNN off, or not taking bf16:
        muon_dist.kernels.reference.onednn_takes). ATen runs a bf16 bmm / baddbmm as one addmm_ per matrix, the
        reference's own call, when k * rows * cols >= 400 (bmm_out_or_baddbmm_ as read in
        aten/src/ATen/native/LinearAlgebra.cpp); m >= 8 gives m^3 >= 512 for every product here. Where oneDNN
        takes bf16 matmuls, its batched and single products round some inputs otherwise: <= 2^-4, the small
        stacks' bound (measured up to 0.033, 1220 of 1235 stacks bitwise, on an Intel Xeon with AMX).
    bfloat16, min(m, n) < 8: <= 2^-4 (measured up to 2.3e-2, 3 ulps of 1): below 400, ATen's own loop kernel
        rounds otherwise.
    float32: <= 2e-4 (measured <= 6.1e-5 over 7,000 stacks): MKL's batched GEMM and the small-matrix loop sum in
        other orders than one gemm per matrix. float64: the same reason, not asserted.
    bfloat16 signed singular values on Gaussian stacks with n / m in [2, 8]: muon_ref.gram_newton_schulz's band,
        which tests/test_gram.py asserts ([0.80, 1.22]).
It is stated for the CPU: on a GPU the batched and the per-matrix GEMMs may sum in other orders again.
The measurements, per dtype and side: docs/kernels.md, "The Gram kernel's tolerance".

Contract 2, the "gram" backend against muon_ref.newton_schulz under the same config (the config's schedule, steps,
eps, dtype, eps_mode, safety, normalisation; a restart after step 2; the config's step_form is ignored), for the
5-step schedules keller, you5 and polar_express_dao: max |difference| <= 2e-4 (float32), 5e-2 (float16), 0.5
(bfloat16), measured at most 1.4e-4, 4.1e-2 and 0.40; bfloat16 signed singular values against the exact polar
factor in the measured bands: Gaussians with n / m in [2, 8], keller [0.6685, 1.134], you5 [0.9548, 1.031],
polar_express_dao [0.8384, 1.181]; the harder inputs [-0.497, 1.599]. A loose tolerance, because the Gram is
rounded once per segment: its eigenvalues are known to about u ||X||_F^2 (u: the unit roundoff), which Gram NS
then amplifies (muon_ref/gram.py). Measured by `python -m muon_dist.kernels.contracts --backends gram --schedules
keller you5 polar_express_dao --cases 40`; tests/test_kernels.py asserts the bounds on the first 8 of those
inputs, the bands widened by 4 bf16 ulps of 1 (2^-7 each). The measurements, beside muon_ref's own bands:
docs/kernels.md, "The Gram kernel's tolerance".
Not covered: longer schedules. polar_express (8 steps) with the one restart gives NaN in float16 and bfloat16 on the
low-rank and ill-conditioned inputs (bfloat16, where not NaN: up to 1.5e36), as muon_ref.gram_newton_schulz does
(muon_ref/gram.py: "8-step polar_express, bfloat16: one restart blows up"); tests/test_kernels.py pins it as the
negative control.
On CUDA: tests/gpu/test_kernels_gpu.py asserts contract 2's bounds and bands there, a priori.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable

import torch
from torch import Tensor

from muon_ref import DAO_RESTARTS, MuonConfig, Schedule, resolve_ns_options, restart_segments
from muon_ref.newton_schulz import EPS_MODES, EpsMode, initial_iterate
from muon_ref.schedules import Coefficients

from . import Backend, over_stacks, own_step_kwargs


def gram_segment_batched(X: Tensor, coefficients: tuple[Coefficients, ...]) -> Tensor:
    """Q X for each matrix of X [E, m, n] (m <= n), Q = P_0 ... P_{L-1}: muon_ref.gram_segment, batched."""
    A = torch.bmm(X, X.mT)
    Q = None
    for t, (a, b, c) in enumerate(coefficients):
        Z = torch.baddbmm(A, A, A, beta=b, alpha=c)
        last = t == len(coefficients) - 1
        if Q is None and last:
            return torch.baddbmm(X, Z, X, beta=a)
        if Q is None:
            Q = Z + a * torch.eye(A.size(-1), dtype=A.dtype, device=A.device)
        else:
            Q = torch.baddbmm(Q, Q, Z, beta=a)
        if not last:
            AP = torch.baddbmm(A, A, Z, beta=a)
            A = torch.baddbmm(AP, Z, AP, beta=a)
    assert Q is not None, "empty segment: restart_segments never makes one"
    return torch.bmm(Q, X)


def gram_newton_schulz_batched(
    G: Tensor,
    schedule: str | Schedule = "polar_express_dao",
    *,
    steps: int | None = None,
    restarts: Iterable[int] = DAO_RESTARTS,
    eps: float | None = None,
    dtype: torch.dtype | None = torch.bfloat16,
    eps_mode: EpsMode = "add",
    safety: float | None = None,
    normalize_before_cast: bool = False,
) -> Tensor:
    """Orthogonalise G of shape [..., m, n] by Gram Newton-Schulz, all matrices at once (module docstring).

    Arguments, defaults and result as muon_ref.gram_newton_schulz; contract against it in the module docstring.
    """
    _check_arguments(G, eps_mode)
    options = resolve_ns_options(schedule, steps, eps, safety)
    if options.precondition is not None:
        raise ValueError(
            f"schedule {schedule!r} uses the {options.precondition!r} preconditioner: not supported here"
        )
    segments = restart_segments(len(options.coefficients), restarts)
    compute_dtype = G.dtype if dtype is None else dtype
    m, n = G.shape[-2:]
    stack = G.reshape(math.prod(G.shape[:-2]), m, n)  # -1 is ambiguous when a dim is 0
    transpose = m > n
    X = stack.mT if transpose else stack
    X = initial_iterate(
        X, compute_dtype, options.eps, eps_mode, options.safety, normalize_before_cast
    )
    for start, end in segments:
        X = gram_segment_batched(X, options.coefficients[start:end])
    return (X.mT if transpose else X).reshape(G.shape)


def _check_arguments(G: Tensor, eps_mode: str) -> None:
    """ValueError for the caller's mistakes, naming the argument."""
    if G.ndim < 2:
        shape = tuple(G.shape)
        raise ValueError(
            f"gram_newton_schulz_batched needs a matrix or a stack of matrices, got shape {shape}"
        )
    if G.is_complex() or not G.is_floating_point():
        raise ValueError(
            f"gram_newton_schulz_batched needs a real floating tensor, got dtype {G.dtype}"
        )
    if eps_mode not in EPS_MODES:
        raise ValueError(f"eps_mode must be one of {EPS_MODES}, got {eps_mode!r}")


def _measure_contract(num_stacks: int = 2000) -> None:
    """Print the measurements behind the module docstring's contract (python -m muon_dist.kernels.gram_ns)."""
    from muon_ref import gram_newton_schulz, signed_singular_values

    torch.set_num_threads(1)
    rng = random.Random(0)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        tally = {
            False: [0, 0, 0.0],
            True: [0, 0, 0.0],
        }  # min(m, n) >= 8: [stacks, bitwise, max |difference|]
        for seed in range(num_stacks):
            shape = (rng.randint(1, 4), rng.randint(1, 32), rng.randint(1, 32))
            name = rng.choice(["polar_express_dao", "you5"])
            G = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
            got, want = (
                gram_newton_schulz_batched(G, name, dtype=dtype),
                gram_newton_schulz(G, name, dtype=dtype),
            )
            row = tally[min(shape[1:]) >= 8]
            row[0] += 1
            row[1] += torch.equal(got, want)
            row[2] = max(
                row[2], float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
            )
        for large, (count, bitwise, worst) in tally.items():
            print(
                f"{dtype}, min(m, n) {'>= 8' if large else '< 8'}: bitwise {bitwise}/{count} stacks, "
                f"max |batched - reference| {worst:.2g}"
            )
    low, high = 1.0, 1.0
    for seed in range(num_stacks // 4):
        m = rng.randint(4, 32)
        n = max(m + 1, round(m * rng.uniform(2.0, 8.0)))
        G = torch.randn(rng.randint(1, 4), m, n, generator=torch.Generator().manual_seed(seed))
        d = signed_singular_values(gram_newton_schulz_batched(G), G)
        low, high = min(low, float(d.min())), max(high, float(d.max()))
    print(
        f"bfloat16 signed singular values, {num_stacks // 4} Gaussian stacks, n / m in [2, 8]: [{low:.3f}, {high:.3f}]"
    )


def _stack_kernel(stack: Tensor, cfg: MuonConfig) -> Tensor:
    """A stack through gram_newton_schulz_batched with the config's schedule, steps, eps, dtype, eps_mode, safety
    and normalisation, restarting after step 2 (DAO_RESTARTS); no step_form (the Gram step has its own operation
    order); the AOL preconditioner is refused."""
    return gram_newton_schulz_batched(stack, **own_step_kwargs(cfg, "gram"))


BACKEND = Backend(
    "gram", over_stacks(_stack_kernel), bitwise=False, stack=_stack_kernel
)  # contract: this module's docstring


if __name__ == "__main__":
    _measure_contract()
