"""The reference backend ("torch"): muon_ref's newton_schulz on every block; a stack batched where that is bitwise.

Reference equation, for every direction D, layout and config:
    orthogonalize(D, layout, cfg) == muon_ref.orthogonalize(D, layout, cfg)
Contract: bitwise. Outside the rule below it *is* muon_ref.orthogonalize (the oracle's function: every path runs
it on exactly the global blocks, proofs/paths.md). Inside the rule, a shared layout's stack [k, m, n] runs
newton_schulz_batched, muon_ref.newton_schulz's "addmm" step on the whole stack at once:
    X_0 = normalise(G'.to(dtype))     G' = G^T per matrix if m > n; muon_ref.normalise, each matrix its own norm
    per step: A = bmm(X, X^T),  B = baddbmm(A, A, A, beta=b, alpha=c),  X = baddbmm(X, B, X, beta=a)
with muon_ref's options (resolve_ns_options); the matrices share a shape, so they share the transpose decision.

The rule (batched_is_bitwise) enables the batch exactly where it was measured to give the loop's bits:
    device CPU with ATen capability AVX2, compute dtype bfloat16 or float16, step_form "addmm", no preconditioner,
    k >= 2 matrices, min(m, n) >= 8.
Why there: ATen runs a bf16 or fp16 bmm / baddbmm on CPU as one addmm_ per matrix, the loop's own call, when
contraction * rows * cols >= 400, and below that in a loop kernel of its own that rounds otherwise
(bmm_out_or_baddbmm_ as read in aten/src/ATen/native/LinearAlgebra.cpp); the smallest product of a step is B = A A with
m^3 >= 512 for m >= 8. The batched normalisation is muon_ref.normalise's measured contract (tests/test_gram.py).
Measured by `python -m muon_dist.kernels.reference` (torch 2.13.0+cpu, AMD EPYC, AVX2, one thread; 400 random
stacks per dtype, half [2-4, 1-48, 1-48], half [2-6, 8-96, 8-160] either way round; schedules keller, you5,
polar_express; both eps modes, both normalisation orders; fp32 or same-dtype inputs):
    bfloat16  min(m, n) >= 8: bitwise 342/342;  below: 57/58 (max |difference| 2.4e-4)
    float16   min(m, n) >= 8: bitwise 346/346;  below: 45/54 (7.3e-4)
    float32   min(m, n) >= 8: 329/345 (1.0e-6); below: 1/55   (MKL's batched gemm, baddbmm_with_gemm_, sums in
              another order for some sizes: the loop)
    float64   min(m, n) >= 8: 185/347 (3.8e-15); below: 5/53  (the same: the loop)
    the rule batches 688 of these stacks, all bitwise; 8 x 64 x 256 bf16: loop 132 ms, batched 107 ms (median of 5,
    two shared cores: on CPU ATen loops over the matrices anyway, so batching saves Python overhead only).
On a CPU with AVX512, mkldnn may take bf16 matmuls (mkldnn_bf16_device_check): not measured, so the loop. CUDA: not
measured (no GPU in the session that wrote this rule), so the loop; tests/gpu/test_kernels_gpu.py measures it
there and fails if the rule ever enables a case that is not bitwise (why it matters there: on an H100, Dion's
compiled batched NS ran a 16 x 512 x 2048 stack in 0.78 ms, the loop in 7.94 ms: ../shared/reference/gpu.md).
tests/test_kernels.py asserts the rule on CPU over Hypothesis shapes, with cases outside it that are not bitwise as
negative controls.
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch
from torch import Tensor

from muon_ref import MatrixLayout, MuonConfig, newton_schulz, orthogonalize as reference_orthogonalize
from muon_ref import resolve_ns_options
from muon_ref.newton_schulz import EPS_MODES, EpsMode, initial_iterate
from muon_ref.schedules import Schedule

from . import Backend

# the measured CPU: ATen's dispatch capability (torch.backends.cpu.get_cpu_capability()) of the machine above
MEASURED_CPU_CAPABILITY = "AVX2"
# ATen's bmm_out_or_baddbmm_ runs a product as one addmm_ per matrix from contraction * rows * cols >= 400 on;
# the smallest product of a step is m x m x m: 8^3 = 512 >= 400 > 7^3
MIN_BATCHED_SIDE = 8


def batched_is_bitwise(device: torch.device, dtype: torch.dtype, step_form: str, precondition: str | None,
                       num_matrices: int, fan_out: int, fan_in: int) -> bool:
    """Whether newton_schulz_batched gives muon_ref.newton_schulz's bits on a stack [num_matrices, fan_out, fan_in]
    computed in `dtype` on `device` (the module docstring's rule: measured there, the loop elsewhere)."""
    return (device.type == "cpu" and torch.backends.cpu.get_cpu_capability() == MEASURED_CPU_CAPABILITY
            and dtype in (torch.bfloat16, torch.float16) and step_form == "addmm" and precondition is None
            and num_matrices >= 2 and min(fan_out, fan_in) >= MIN_BATCHED_SIDE)


def newton_schulz_batched(
    G: Tensor,
    schedule: str | Schedule = "keller",
    *,
    steps: int | None = None,
    eps: float | None = None,
    dtype: torch.dtype | None = torch.bfloat16,
    eps_mode: EpsMode = "clamp",
    safety: float | None = None,
    normalize_before_cast: bool = False,
    precondition: str | None = None,
) -> Tensor:
    """muon_ref.newton_schulz(G, ..., step_form="addmm") on G [..., m, n] with one bmm / baddbmm per product for
    the whole stack (module docstring); bitwise equal to it only where batched_is_bitwise says so.

    Arguments and defaults as muon_ref.newton_schulz without step_form ("addmm"); ValueError when the
    preconditioner resolves to "aol" (not implemented here). Returns a new contiguous tensor of G's shape in the
    compute dtype.
    """
    if G.ndim < 2 or not G.is_floating_point() or eps_mode not in EPS_MODES:
        raise ValueError(f"newton_schulz_batched needs a real floating [..., m, n] tensor and eps_mode in "
                         f"{EPS_MODES}, got shape {tuple(G.shape)}, dtype {G.dtype}, eps_mode {eps_mode!r}")
    options = resolve_ns_options(schedule, steps, eps, safety, precondition)
    if options.precondition is not None:
        raise ValueError(f"schedule {schedule!r} uses the {options.precondition!r} preconditioner: not supported here")
    m, n = G.shape[-2:]
    stack = G.reshape(math.prod(G.shape[:-2]), m, n)  # -1 is ambiguous when a dim is 0
    transpose = m > n  # muon_ref's decision, on the matrices' own (shared) shape
    X = stack.mT if transpose else stack
    compute_dtype = G.dtype if dtype is None else dtype
    X = initial_iterate(X, compute_dtype, options.eps, eps_mode, options.safety, normalize_before_cast)
    for a, b, c in options.coefficients:
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    # contiguous, as the loop's torch.stack: later elementwise ops see the same layout
    return (X.mT if transpose else X).contiguous().reshape(G.shape)


def orthogonalize(direction: Tensor, layout: MatrixLayout, cfg: MuonConfig) -> Tensor:
    """muon_ref.orthogonalize, with a shared layout's stack batched where batched_is_bitwise says it is bitwise."""
    if layout.separate:
        return reference_orthogonalize(direction, layout, cfg)
    options = resolve_ns_options(cfg.schedule, cfg.ns_steps, cfg.eps, cfg.safety, cfg.precondition)
    dtype = direction.dtype if cfg.ns_dtype is None else cfg.ns_dtype
    if not batched_is_bitwise(direction.device, dtype, cfg.step_form, options.precondition, *layout.matrices_shape):
        return reference_orthogonalize(direction, layout, cfg)
    kwargs = cfg.ns_kwargs()
    del kwargs["step_form"]  # "addmm": a condition of the rule
    return newton_schulz_batched(direction.reshape(layout.matrices_shape), **kwargs).reshape(direction.shape)


BACKEND = Backend("torch", orthogonalize, bitwise=True)


def _random_case(rng: random.Random, seed: int, large: bool) -> tuple[Tensor, dict]:
    """A Gaussian stack and newton_schulz options, as the measurement in the module docstring draws them."""
    if large:
        short, long = rng.randint(8, 96), rng.randint(8, 160)
        shape = (rng.randint(2, 6), *((short, long) if rng.random() < 0.5 else (long, short)))
    else:
        shape = (rng.randint(2, 4), rng.randint(1, 48), rng.randint(1, 48))
    options = dict(schedule=rng.choice(["keller", "you5", "polar_express"]), eps_mode=rng.choice(EPS_MODES),
                   normalize_before_cast=rng.random() < 0.5)
    G = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return G, options


def measure(device: torch.device, num_stacks: int) -> int:
    """Print, per compute dtype and side class, how often newton_schulz_batched gives the loop's bits and what the
    rule says; return the number of cases the rule enables that are not bitwise (0 for a correct rule)."""
    rng, violations = random.Random(0), 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        tally: dict[bool, list] = {}  # min(m, n) >= 8 -> [stacks, bitwise, max |difference|, rule enabled]
        for seed in range(num_stacks):
            G, options = _random_case(rng, seed, large=seed % 2 == 1)
            G = (G if rng.random() < 0.5 else G.to(dtype)).to(device)
            got = newton_schulz_batched(G, dtype=dtype, **options)
            want = newton_schulz(G, dtype=dtype, **options)
            bitwise = torch.equal(got, want)
            enabled = batched_is_bitwise(device, dtype, "addmm", None, *G.shape)
            violations += enabled and not bitwise
            row = tally.setdefault(min(G.shape[1:]) >= MIN_BATCHED_SIDE, [0, 0, 0.0, 0])
            row[0], row[1], row[3] = row[0] + 1, row[1] + bitwise, row[3] + enabled
            row[2] = max(row[2], float((got.double() - want.double()).abs().max()) if got.numel() else 0.0)
        for large, (count, bitwise, worst, enabled) in sorted(tally.items()):
            print(f"{dtype}, min(m, n) {'>= 8' if large else '< 8 '}: bitwise {bitwise}/{count}, max |batched - loop| "
                  f"{worst:.2g}; the rule batches {enabled}/{count}")
    return violations


def _time_one_stack(device: torch.device) -> None:
    """Median wall time of the loop and the batched kernel on one bf16 stack (what batching buys on `device`)."""
    G = torch.randn(8, 64, 256, generator=torch.Generator().manual_seed(0)).to(device)
    kernels = (("loop (muon_ref.newton_schulz)", newton_schulz), ("newton_schulz_batched", newton_schulz_batched))
    for name, kernel in kernels:
        times = []
        for _ in range(5):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            kernel(G)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        print(f"8x64x256 bf16, {name}: {1e3 * sorted(times)[2]:.1f} ms (median of 5)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m muon_dist.kernels.reference", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--stacks", type=int, default=400, help="random stacks per dtype (default 400)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    capability = (torch.cuda.get_device_name(device) if device.type == "cuda"
                  else torch.backends.cpu.get_cpu_capability())
    print(f"batched vs loop on {device.type} ({capability}), torch {torch.__version__}")
    violations = measure(device, args.stacks)
    _time_one_stack(device)
    print(f"cases the rule batches that are not bitwise: {violations}")
    return 1 if violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
