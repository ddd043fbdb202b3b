"""The reference backend ("torch"): muon_ref's newton_schulz on every block; a stack batched where that is bitwise.

Reference equation, for every direction D, layout and config:
    orthogonalize(D, layout, cfg) == muon_ref.orthogonalize(D, layout, cfg)
D is read only through muon_ref's input cast (reads_through_cast: both kernels start from initial_iterate).
Contract: bitwise, on every device. Unbatched it *is* muon_ref.orthogonalize (proofs/paths.md). Batched, a shared
layout's stack [k, m, n] runs newton_schulz_batched, muon_ref's "addmm" step on the whole stack (G' = G^T if m > n):
    X_0 = normalise(G'.to(dtype)), each matrix its own norm; per step: A = bmm(X, X^T),
    B = baddbmm(A, A, A, beta=b, alpha=c), X = baddbmm(X, B, X, beta=a)
The batch is chosen (batched_is_bitwise) on the CPU only, where all three hold; elsewhere the loop runs:
1. static rule: compute dtype bf16 or fp16, step_form "addmm", no preconditioner, k >= 2, min(m, n) >= 8;
2. ATen's own kernel runs: oneDNN does not take matmuls of that dtype in the process (read at runtime);
3. a runtime probe, cached per probe_key, finds the batch and the loop bitwise equal on a Gaussian stack.
Reference: ATen's bmm_out_or_baddbmm_ (aten/src/ATen/native/LinearAlgebra.cpp), one addmm_ per matrix from
contraction * rows * cols >= 400 on. Why each part, per CPU: docs/kernels.md, "The reference backend's batch".
`python -m muon_dist.kernels.reference` exits 1 if the rule chose a stack that is not bitwise; tests/test_kernels.py
asserts bitwise when chosen, chosen where the rule and the probe say (oneDNN on, off; a planted negative control).
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from muon_ref import MatrixLayout, MuonConfig, newton_schulz, resolve_ns_options
from muon_ref import orthogonalize as reference_orthogonalize
from muon_ref.newton_schulz import EPS_MODES, EpsMode, initial_iterate
from muon_ref.schedules import Schedule

from . import Backend

# ATen's bmm_out_or_baddbmm_ runs a product as one addmm_ per matrix from contraction * rows * cols >= 400 on;
# the smallest product of a step is m x m x m: 8^3 = 512 >= 400 > 7^3
MIN_BATCHED_SIDE = 8
LOW_PRECISION = (torch.bfloat16, torch.float16)
# probe_key -> whether the batch gave the loop's bits on the probe's stack (module docstring, part 3)
_PROBED: dict[tuple, bool] = {}
# dtype -> whether this process's CPU has oneDNN's kernels for it (onednn_takes; the query's answer is fixed)
_ONEDNN_SUPPORTS: dict[torch.dtype, bool] = {}


def in_static_rule(
    shape: tuple[int, ...], dtype: torch.dtype | None, step_form: str, precondition: str | None
) -> bool:
    """Part 1 of the module docstring's rule: whether a stack [k, m, n] in compute dtype `dtype` can be batched."""
    return (
        len(shape) == 3
        and dtype in LOW_PRECISION
        and step_form == "addmm"
        and precondition is None
        and shape[0] >= 2
        and min(shape[1:]) >= MIN_BATCHED_SIDE
    )


def probe_key(
    shape: tuple[int, ...], input_dtype: torch.dtype, device: torch.device, ns_kwargs: dict
) -> tuple:
    """What a probe's verdict stands for: shape, input dtype, device, thread count, whether oneDNN is enabled and
    newton_schulz's options."""
    options = tuple(sorted((name, repr(value)) for name, value in ns_kwargs.items()))
    return (
        tuple(shape),
        input_dtype,
        torch.device(device),
        torch.get_num_threads(),
        torch.backends.mkldnn.enabled,
        options,
    )


def probe(
    shape: tuple[int, ...], input_dtype: torch.dtype, device: torch.device, ns_kwargs: dict
) -> bool:
    """Whether newton_schulz_batched gives muon_ref.newton_schulz's bits on a Gaussian stack of `shape` (seed 0,
    drawn in float32 on the CPU, cast to input_dtype, moved to device) with these newton_schulz options. The probe
    runs below every Python dispatch mode in effect (a tracer, a FLOP counter, a fake-tensor mode): it measures the
    kernels on real tensors and is no part of the caller's computation, so no mode sees its products."""
    with _disable_current_modes():
        G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        G = G.to(input_dtype).to(device)
        kwargs = {name: value for name, value in ns_kwargs.items() if name != "step_form"}
        return torch.equal(
            newton_schulz_batched(G, **kwargs), newton_schulz(G, step_form="addmm", **kwargs)
        )


def onednn_takes(dtype: torch.dtype) -> bool:
    """Whether oneDNN may run CPU matmuls of `dtype` in this process instead of ATen's own kernel (rule part 2);
    True when torch cannot say (a missing query), so that the loop runs. torch.backends.mkldnn.enabled is read at
    every call (a context manager may turn it off); the CPU's support, fixed for the process, is asked once per
    dtype."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    if dtype not in _ONEDNN_SUPPORTS:
        query = {
            torch.bfloat16: "_is_mkldnn_bf16_supported",
            torch.float16: "_is_mkldnn_fp16_supported",
        }.get(dtype)
        try:
            _ONEDNN_SUPPORTS[dtype] = query is None or bool(getattr(torch.ops.mkldnn, query)())
        except (AttributeError, RuntimeError):
            _ONEDNN_SUPPORTS[dtype] = True
    return _ONEDNN_SUPPORTS[dtype]


def batched_is_bitwise(
    shape: tuple[int, ...], input_dtype: torch.dtype, device: torch.device, **ns_kwargs
) -> bool:
    """Whether orthogonalize batches a stack of `shape` and input_dtype on `device` under muon_ref.newton_schulz's
    keyword arguments ns_kwargs (MuonConfig.ns_kwargs()): the module docstring's three parts; the probe's verdict
    is cached per probe_key."""
    if not in_rule(shape, input_dtype, device, **ns_kwargs):
        return False
    key = probe_key(shape, input_dtype, device, ns_kwargs)
    if key not in _PROBED:
        _PROBED[key] = probe(tuple(shape), input_dtype, device, ns_kwargs)
    return _PROBED[key]


def in_rule(
    shape: tuple[int, ...], input_dtype: torch.dtype, device: torch.device, **ns_kwargs
) -> bool:
    """Parts 1 and 2 of the module docstring's rule for a stack of `shape` on `device` (batched_is_bitwise without
    its probe)."""
    dtype = ns_kwargs.get("dtype", torch.bfloat16) or input_dtype
    # oneDNN first (a dict lookup): where it takes the dtype the schedule is never resolved
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return (
        kind == "cpu"
        and not onednn_takes(dtype)
        and in_static_rule(
            tuple(shape), dtype, ns_kwargs.get("step_form", "addmm"), preconditioner(ns_kwargs)
        )
    )


def preconditioner(ns_kwargs: dict) -> str | None:
    """The preconditioner that muon_ref.newton_schulz's keyword arguments resolve to (their schedule's, unless
    overridden): "aol" or None."""
    return resolve_ns_options(
        ns_kwargs.get("schedule", "keller"),
        ns_kwargs.get("steps"),
        ns_kwargs.get("eps"),
        ns_kwargs.get("safety"),
        ns_kwargs.get("precondition"),
    ).precondition


def probed() -> dict[tuple, bool]:
    """A copy of the probe verdicts of this process (probe_key -> bitwise)."""
    return dict(_PROBED)


def forget_probes() -> None:
    """Drop every cached probe verdict (the next call probes again)."""
    _PROBED.clear()


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
    the whole stack (module docstring); bitwise equal to it where batched_is_bitwise says so.

    Arguments and defaults as muon_ref.newton_schulz without step_form ("addmm"); ValueError when the
    preconditioner resolves to "aol" (not implemented here). Returns a new contiguous tensor of G's shape in the
    compute dtype.
    """
    if G.ndim < 2 or not G.is_floating_point() or eps_mode not in EPS_MODES:
        raise ValueError(
            f"newton_schulz_batched needs a real floating [..., m, n] tensor and eps_mode in "
            f"{EPS_MODES}, got shape {tuple(G.shape)}, dtype {G.dtype}, eps_mode {eps_mode!r}"
        )
    options = resolve_ns_options(schedule, steps, eps, safety, precondition)
    if options.precondition is not None:
        raise ValueError(
            f"schedule {schedule!r} uses the {options.precondition!r} preconditioner: not supported here"
        )
    m, n = G.shape[-2:]
    stack = G.reshape(math.prod(G.shape[:-2]), m, n)  # -1 is ambiguous when a dim is 0
    transpose = m > n  # muon_ref's decision, on the matrices' own (shared) shape
    X = stack.mT if transpose else stack
    compute_dtype = G.dtype if dtype is None else dtype
    X = initial_iterate(
        X, compute_dtype, options.eps, eps_mode, options.safety, normalize_before_cast
    )
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
    kwargs = cfg.ns_kwargs()
    if not batched_is_bitwise(layout.matrices_shape, direction.dtype, direction.device, **kwargs):
        return reference_orthogonalize(direction, layout, cfg)
    del kwargs["step_form"]  # "addmm": a condition of the rule
    return newton_schulz_batched(direction.reshape(layout.matrices_shape), **kwargs).reshape(
        direction.shape
    )


def stack_through(stack: Tensor, cfg: MuonConfig, batch: bool) -> Tensor:
    """A stack [k, m, n] under cfg's Newton-Schulz: newton_schulz_batched where `batch` (the caller has checked
    that cfg's step form is "addmm", which that kernel implements), else muon_ref.newton_schulz (a loop over the
    stack's matrices, each alone)."""
    kwargs = cfg.ns_kwargs()
    if not batch:
        return newton_schulz(stack, **kwargs)
    del kwargs["step_form"]  # "addmm"
    return newton_schulz_batched(stack, **kwargs)


def orthogonalize_stack(stack: Tensor, cfg: MuonConfig) -> Tensor:
    """The backend's stack kernel: muon_ref.newton_schulz on a stack [k, m, n] (a loop over its matrices, each
    alone), batched where batched_is_bitwise says it is bitwise; so each matrix gets muon_ref's bits for it,
    whatever else the stack holds (Backend.stack)."""
    bitwise = batched_is_bitwise(stack.shape, stack.dtype, stack.device, **cfg.ns_kwargs())
    return stack_through(stack, cfg, bitwise)  # "addmm" is a condition of the rule


def may_batch(
    matrix: tuple[int, int], input_dtype: torch.dtype, device: torch.device, cfg: MuonConfig
) -> bool:
    """The backend's Backend.batches: whether orthogonalize_stack may batch a stack of such matrices (parts 1 and 2
    of the rule for a stack of two; the probe, part 3, runs on the stack's own shape when it comes)."""
    return in_rule((2, *matrix), input_dtype, device, **cfg.ns_kwargs())


BACKEND = Backend(
    "torch",
    orthogonalize,
    bitwise=True,
    reads_through_cast=True,
    stack=orthogonalize_stack,
    batches=may_batch,
)


def _random_case(rng: random.Random, seed: int, large: bool) -> tuple[Tensor, dict]:
    """A Gaussian stack and newton_schulz options, drawn as docs/kernels.md, "The measurement command" says."""
    if large:
        short, long = rng.randint(8, 96), rng.randint(8, 160)
        shape = (rng.randint(2, 6), *((short, long) if rng.random() < 0.5 else (long, short)))
    else:
        shape = (rng.randint(2, 4), rng.randint(1, 48), rng.randint(1, 48))
    options = dict(
        schedule=rng.choice(["keller", "you5", "polar_express"]),
        eps_mode=rng.choice(EPS_MODES),
        normalize_before_cast=rng.random() < 0.5,
    )
    G = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return G, options


def measure(device: torch.device, num_stacks: int) -> int:
    """Print, per compute dtype and side class, how often newton_schulz_batched gives the loop's bits and how often
    batched_is_bitwise chooses the batch; return the number of stacks it chooses that are not bitwise (0 when the
    probe's verdict holds for other inputs of its key: the probe draws seed 0, these stacks other seeds)."""
    rng, violations = random.Random(0), 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        tally: dict[
            bool, list
        ] = {}  # min(m, n) >= 8 -> [stacks, bitwise, max |difference|, rule enabled]
        for seed in range(num_stacks):
            G, options = _random_case(rng, seed, large=seed % 2 == 1)
            G = (G if rng.random() < 0.5 else G.to(dtype)).to(device)
            got = newton_schulz_batched(G, dtype=dtype, **options)
            want = newton_schulz(G, dtype=dtype, **options)
            bitwise = torch.equal(got, want)
            enabled = batched_is_bitwise(G.shape, G.dtype, device, dtype=dtype, **options)
            violations += enabled and not bitwise
            row = tally.setdefault(min(G.shape[1:]) >= MIN_BATCHED_SIDE, [0, 0, 0.0, 0])
            row[0], row[1], row[3] = row[0] + 1, row[1] + bitwise, row[3] + enabled
            row[2] = max(
                row[2], float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
            )
        for large, (count, bitwise, worst, enabled) in sorted(tally.items()):
            print(
                f"{dtype}, min(m, n) {'>= 8' if large else '< 8 '}: bitwise {bitwise}/{count}, max |batched - loop| "
                f"{worst:.2g}; the probe batches {enabled}/{count}"
            )
    return violations


def _time_one_stack(device: torch.device) -> None:
    """Median wall time of the loop and the batched kernel on one bf16 stack (what batching buys on `device`)."""
    G = torch.randn(8, 64, 256, generator=torch.Generator().manual_seed(0)).to(device)
    kernels = (
        ("loop (muon_ref.newton_schulz)", newton_schulz),
        ("newton_schulz_batched", newton_schulz_batched),
    )
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
    parser = argparse.ArgumentParser(
        prog="python -m muon_dist.kernels.reference",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--stacks", type=int, default=400, help="random stacks per dtype (default 400)"
    )
    parser.add_argument(
        "--no-onednn", action="store_true", help="disable oneDNN (torch.backends.mkldnn) first"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.no_onednn:
        torch.backends.mkldnn.enabled = False
    device = torch.device(args.device)
    capability = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else torch.backends.cpu.get_cpu_capability()
    )
    print(
        f"batched vs loop on {device.type} ({capability}), torch {torch.__version__}, oneDNN takes bf16 / fp16: "
        f"{onednn_takes(torch.bfloat16)} / {onednn_takes(torch.float16)}"
    )
    violations = measure(device, args.stacks)
    _time_one_stack(device)
    print(f"stacks the probe batches that are not bitwise: {violations}")
    return 1 if violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
