"""One GPU, one run: optimizer steps on Qwen-shaped parameter sets, and Newton-Schulz kernels shape by shape.

    python -m benchmarks gpu [--parts steps kernels] [--sets dense moe] [--warmup 2] [--steps 5] [--reps 10]
                             [--shapes 4096x4096,...] [--peak-tflops 989] [--triton-tiles 128/64/8 ...]
                             [--dion PATH] [--device cuda|cpu] [--tiny] [--json FILE]

1. Step tables, one per parameter set (the Muon matrices of a few layers; fp32 params and grads):
     dense  4 layers of Qwen2.5-7B: q, k, v, o, gate, up, down (28 matrices, 0.93 B params)
     moe    2 layers of Qwen3-30B-A3B: q, k, v, o and expert stacks [E, ffn, hidden] x2 (gate, up) and
            [E, hidden, ffn] (3-D params; 1.25 B params)
   Each optimizer gets its own copy of the same initial params and, at every step, the same gradients (drawn
   from seeded generators on the device), and runs alone on the device (peak memory reset before it):
     muon_ref.Muon(preset="torch")          the oracle; every other Muon's params are compared with its own
     torch.optim.Muon                       2-D only: each expert of a stack is its own 2-D param, a view of
                                            the stack (the same update as the oracle's per-expert loop)
     DistributedMuon W=1 ns_backend=NAME   each backend of muon_dist.kernels.BACKENDS, in a torch.distributed
                                            world of one (NCCL on CUDA, gloo on CPU), plain tensors
     torch.optim.AdamW(fused=True)          the elementwise baseline (no NS: no floor, not compared)
     dion.Muon [use_triton=True] [use_gram_newton_schulz=True]   with --dion PATH (a microsoft/dion checkout,
                                            imported from PATH at run time; Gram when gram_newton_schulz is
                                            importable); another update rule (Polar Express): not compared
   Hyperparameters: the "torch" preset's lr, weight decay and momentum, Nesterov, for every optimizer.
   step ms: the median over --steps timed steps after --warmup untimed ones, each timed alone (CUDA events
   around opt.step() on CUDA; time.perf_counter on CPU); [min, max] over the timed steps; x torch: the ratio to
   torch.optim.Muon's median; peak GiB: torch.cuda.max_memory_allocated over the optimizer's whole run (its
   params, grads, state and steps; reset before it; not measured on CPU); of floor: the NS floor / step ms,
   where the floor is the reference NS FLOPs (per matrix, m <= n: steps (4 m^2 n + 2 m^3), muon_dist.balance)
   at --peak-tflops; = muon_ref: the params after all the steps, bitwise equal to the oracle's or not.
2. Kernel table: per shape ([batch x] fan_out x fan_in, fp32 input from a seeded generator), each kernel's
   median ms over --reps timed calls after --warmup untimed ones, [min, max], its fraction of the bf16 peak
   (the reference FLOPs above / time / peak: a kernel that does fewer FLOPs shows as a higher fraction, not a
   smaller count) and its max |difference| from muon_ref.newton_schulz (by design large for other
   coefficients: Polar Express). Kernels: muon_ref.newton_schulz; torch.optim.Muon's internal NS (2-D only);
   every muon_dist.kernels backend through its orthogonalize; the Triton kernel at each --triton-tiles
   (block/block_k/num_warps); with --dion, Dion's NS functions.
A kernel or optimizer that cannot run here (Triton without CUDA, out of memory) is a row saying why.

On a machine without CUDA `python -m benchmarks gpu` says that the GPU parts are skipped and exits 0;
`--device cpu --tiny` runs the whole pipeline at tiny sizes on CPU (what tests/test_benchmarks_gpu_smoke.py
runs), where torch.compile'd functions run eagerly (torch.compiler.set_stance("force_eager")).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

import muon_ref
from muon_check.fixtures import bits
from muon_check.rules import param_flops
from muon_check.shapes import ParamSpec, transformer
from muon_dist.balance import ns_flops
from muon_ref import get_schedule, newton_schulz
from muon_ref.config import MuonConfig
from muon_ref.functional import matrix_layout
from muon_ref.optim import group_config
from muon_ref.presets import preset_defaults

# NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100): H100 SXM BF16 Tensor Core
# 1,979 TFLOPS "with sparsity", specifications one half lower without sparsity: 989 dense
H100_SXM_DENSE_BF16_TFLOPS = 989.0
# the shapes of the kernel table measured by hand on one H100 (2026-11-23): square, Qwen2.5-7B's MLP both
# ways, a short wide matrix, two expert stacks
DEFAULT_SHAPES = "4096x4096,3584x18944,18944x3584,1024x4096,8x1024x1024,16x512x2048"
TINY_SHAPES = "32x32,24x40,40x24,8x32,4x16x16,2x8x24"
PRESET = "torch"
TORCH_MUON = "torch.optim.Muon"
REFERENCE = 'muon_ref.Muon(preset="torch")'


# ------------------------------------------------------------------------------------------ parameter sets


def dense_layers(
    *, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int
) -> list[ParamSpec]:
    """The Muon matrices of `layers` dense decoder layers: q, k, v, o, gate, up, down."""
    specs = transformer(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ffn=ffn,
        vocab=1,
    )
    return [s for s in specs if s.kind == "matrix"]


def moe_layers(
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    experts: int,
    expert_ffn: int,
) -> list[ParamSpec]:
    """The Muon matrices of `layers` MoE decoder layers: q, k, v, o and 3-D expert stacks gate, up, down
    (separate gate and up stacks, as Qwen3-MoE's checkpoints hold them; the router is left out)."""
    specs = []
    for i in range(layers):
        pre = f"layers.{i}."
        specs += [
            ParamSpec(pre + "q_proj.weight", (heads * head_dim, hidden), "matrix"),
            ParamSpec(pre + "k_proj.weight", (kv_heads * head_dim, hidden), "matrix"),
            ParamSpec(pre + "v_proj.weight", (kv_heads * head_dim, hidden), "matrix"),
            ParamSpec(pre + "o_proj.weight", (hidden, heads * head_dim), "matrix"),
            ParamSpec(pre + "experts.gate", (experts, expert_ffn, hidden), "experts"),
            ParamSpec(pre + "experts.up", (experts, expert_ffn, hidden), "experts"),
            ParamSpec(pre + "experts.down", (experts, hidden, expert_ffn), "experts"),
        ]
    return specs


def step_sets(tiny: bool) -> dict[str, tuple[str, list[ParamSpec]]]:
    """name -> (description, specs)."""
    if tiny:  # the same structures at sizes that run in milliseconds on CPU: tall, wide and square matrices
        return {
            "dense": (
                "2 tiny dense layers",
                dense_layers(layers=2, hidden=24, heads=3, kv_heads=1, head_dim=8, ffn=40),
            ),
            "moe": (
                "1 tiny MoE layer",
                moe_layers(
                    layers=1, hidden=24, heads=4, kv_heads=1, head_dim=8, experts=4, expert_ffn=12
                ),
            ),
        }
    return {
        # Qwen/Qwen2.5-7B config.json: hidden_size 3584, 28 attention / 4 key-value heads (head_dim 128),
        # intermediate_size 18944
        "dense": (
            "4 layers of Qwen2.5-7B",
            dense_layers(layers=4, hidden=3584, heads=28, kv_heads=4, head_dim=128, ffn=18944),
        ),
        # Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, 32 / 4 heads of head_dim 128, 128 experts of
        # moe_intermediate_size 768
        "moe": (
            "2 layers of Qwen3-30B-A3B",
            moe_layers(
                layers=2,
                hidden=2048,
                heads=32,
                kv_heads=4,
                head_dim=128,
                experts=128,
                expert_ffn=768,
            ),
        ),
    }


def num_ns_steps(cfg: MuonConfig) -> int:
    return len(get_schedule(cfg.schedule).steps_for(cfg.ns_steps))


def ns_floor_ms(specs: list[ParamSpec], peak_tflops: float, steps: int) -> float:
    """The reference NS FLOPs of every matrix of the set at the bf16 peak, in ms."""
    return sum(param_flops(s, steps) for s in specs) / (peak_tflops * 1e12) * 1e3


def kernel_flops(shape: tuple[int, ...], steps: int) -> int:
    """The reference NS FLOPs of one call on a [batch x] fan_out x fan_in input."""
    return math.prod(shape[:-2]) * ns_flops(shape[-2], shape[-1], steps)


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """'4096x4096,8x1024x1024' -> [(4096, 4096), (8, 1024, 1024)]."""
    shapes = []
    for item in text.split(","):
        dims = item.lower().split("x")
        if len(dims) < 2 or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise argparse.ArgumentTypeError(
                f"a shape is [batch x] fan_out x fan_in, positive integers; got {item!r}"
            )
        shapes.append(tuple(int(d) for d in dims))
    return shapes


# ------------------------------------------------------------------------------------------ measurement


def elapsed_s(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of fn(): CUDA events around it on the current stream (after a synchronize), else perf_counter."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start_s = time.perf_counter()
    fn()
    return time.perf_counter() - start_s


def fresh_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def spread(times_s: list[float]) -> dict[str, float]:
    ms = [1e3 * t for t in times_s]
    return {"ms": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms)}


def why(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:240] if text else ''}"


def seeded(
    shape: tuple[int, ...], seed: int, device: torch.device, out: Tensor | None = None
) -> Tensor:
    """Standard normal values from a generator seeded with `seed` on `device` (into `out` when given)."""
    out = torch.empty(shape, device=device) if out is None else out
    return out.normal_(generator=torch.Generator(device).manual_seed(seed))


# ------------------------------------------------------------------------------------------ optimizers


@dataclass(frozen=True)
class Contender:
    """An optimizer of the step tables. build(params) returns it over the set's params, whose grads are
    attached already and refilled in place at each step. muon: it orthogonalises (the NS floor applies);
    compared: its params are compared with the oracle's."""

    name: str
    build: Callable[[list[Tensor]], torch.optim.Optimizer]
    muon: bool = True
    compared: bool = True


def hyperparameters() -> dict[str, float]:
    values = preset_defaults(PRESET, {})
    return {
        "lr": values["lr"],
        "weight_decay": values["weight_decay"],
        "momentum": values["momentum"],
    }


def torch_muon(params: list[Tensor]) -> torch.optim.Optimizer:
    """torch.optim.Muon takes 2-D params only: an expert stack enters as one view per expert (leaves, since
    the params do not require grad), each with the matching view of the stack's grad; updates land in the stack."""
    matrices = []
    for p in params:
        if p.ndim == 2:
            matrices.append(p)
            continue
        for expert, grad in zip(p.unbind(0), p.grad.unbind(0)):
            expert.grad = grad
            matrices.append(expert)
    return torch.optim.Muon(matrices, nesterov=True, **hyperparameters())


def distributed_muon(backend: str) -> Callable[[list[Tensor]], torch.optim.Optimizer]:
    def build(params: list[Tensor]) -> torch.optim.Optimizer:
        from muon_dist.optim import DistributedMuon

        return DistributedMuon(params, preset=PRESET, ns_backend=backend)

    return build


def fused_adamw(params: list[Tensor]) -> torch.optim.Optimizer:
    hp = hyperparameters()
    return torch.optim.AdamW(params, lr=hp["lr"], weight_decay=hp["weight_decay"], fused=True)


def contenders(dion: object | None) -> list[Contender]:
    """The oracle first (every comparison needs its result), then the others in the tables' order."""
    from muon_dist.kernels import BACKENDS

    rows = [
        Contender(REFERENCE, lambda params: muon_ref.Muon(params, preset=PRESET)),
        Contender(TORCH_MUON, torch_muon),
    ]
    rows += [
        Contender(f"DistributedMuon W=1 ns_backend={b}", distributed_muon(b)) for b in BACKENDS
    ]
    rows.append(Contender("torch.optim.AdamW(fused=True)", fused_adamw, muon=False, compared=False))
    return rows + ([] if dion is None else dion_contenders(dion))


def dion_contenders(dion: object) -> list[Contender]:
    """Dion's Muon with its defaults, with use_triton=True, and with Gram NS when gram_newton_schulz imports."""
    variants = {"dion.Muon": {}, "dion.Muon use_triton=True": {"use_triton": True}}
    if importlib.util.find_spec("gram_newton_schulz") is not None:
        variants["dion.Muon use_gram_newton_schulz=True"] = {"use_gram_newton_schulz": True}
    hp = hyperparameters()

    def builder(options: dict) -> Callable[[list[Tensor]], torch.optim.Optimizer]:
        return lambda params: dion.Muon(
            params,
            lr=hp["lr"],
            mu=hp["momentum"],
            weight_decay=hp["weight_decay"],
            nesterov=True,
            **options,
        )

    return [Contender(name, builder(options), compared=False) for name, options in variants.items()]


def load_dion(path: str) -> object:
    """The `dion` package of a microsoft/dion checkout at `path`, imported from there (sys.path restored)."""
    if not os.path.isdir(os.path.join(path, "dion")):
        raise ValueError(f"--dion {path}: no dion/ package there (give the checkout's root)")
    root = os.path.abspath(path)
    sys.path.insert(0, root)
    try:
        dion = importlib.import_module("dion")
    finally:
        sys.path.remove(root)
    if not os.path.abspath(dion.__file__).startswith(os.path.join(root, "")):
        raise ValueError(
            f"--dion {path}: another dion package is imported already ({dion.__file__})"
        )
    return dion


@contextlib.contextmanager
def world_of_one(device: torch.device) -> Iterator[None]:
    """A torch.distributed world of this one process for DistributedMuon at W = 1 (NCCL on CUDA, gloo on CPU),
    unless one exists already; destroyed afterwards when created here."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ValueError(
                f"benchmarks gpu runs DistributedMuon at W = 1; this process is rank {dist.get_rank()} "
                f"of {dist.get_world_size()} (run it as one process, without torchrun)"
            )
        yield
        return
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ step tables


@dataclass(frozen=True)
class StepRun:
    """What every optimizer of one set gets: the set, warm-up and timed steps, the device, the seed."""

    name: str
    description: str
    specs: tuple[ParamSpec, ...]
    warmup: int
    steps: int
    device: torch.device
    seed: int = 0


def fresh_params(run: StepRun) -> list[Tensor]:
    """The set's initial params with step 0's gradients attached (plain fp32 tensors, not requiring grad)."""
    params = [seeded(s.shape, run.seed * 7919 + i, run.device) for i, s in enumerate(run.specs)]
    for i, p in enumerate(params):
        p.grad = seeded(p.shape, gradient_seed(run, 0, i), run.device)
    return params


def gradient_seed(run: StepRun, step: int, index: int) -> int:
    return run.seed * 104729 + 1000 * (step + 1) + index


def refill_gradients(run: StepRun, params: list[Tensor], step: int) -> None:
    """Step `step`'s gradients, written into the attached grads (views of them stay valid)."""
    for i, p in enumerate(params):
        seeded(p.shape, gradient_seed(run, step, i), run.device, out=p.grad)


def time_steps(run: StepRun, contender: Contender) -> tuple[list[Tensor], dict]:
    """The contender on fresh params: (its params after all the steps, its timing and memory fields)."""
    fresh_peak(run.device)
    params = fresh_params(run)
    opt = contender.build(params)
    times = []
    for step in range(run.warmup + run.steps):
        if step:
            refill_gradients(run, params, step)
        times.append(elapsed_s(opt.step, run.device))
    return params, {**spread(times[run.warmup :]), "peak_gib": peak_gib(run.device)}


def compare(got: list[Tensor], want: list[Tensor]) -> dict:
    """Whether every param is bitwise the oracle's (want: on CPU), and the largest |difference|; compared on the
    params' device, one param at a time (after the timed steps and the peak)."""
    equal, worst = True, 0.0
    for p, ref in zip(got, want):
        p, ref = p.detach(), ref.to(p.device)
        if not torch.equal(bits(p), bits(ref)):
            equal = False
            worst = max(worst, (p.double() - ref.double()).abs().max().item())
        del ref
    return {"equal_muon_ref": equal, "max_abs_diff": worst}


def step_table(
    run: StepRun, candidates: list[Contender], peak_tflops: float, ns_steps: int
) -> list[dict]:
    """One row per contender; candidates[0] is the oracle, whose params the compared ones must equal. A contender
    that raises is a row with its error."""
    floor = ns_floor_ms(list(run.specs), peak_tflops, ns_steps)
    rows, reference = [], None
    for i, c in enumerate(candidates):
        row = {
            "set": run.name,
            "optimizer": c.name,
            "error": None,
            "oracle": i == 0,
            "ms": None,
            "ms_min": None,
            "ms_max": None,
            "peak_gib": None,
            "floor_fraction": None,
            "equal_muon_ref": None,
            "max_abs_diff": None,
        }
        try:
            params, measured = time_steps(run, c)
        except Exception as e:  # noqa: BLE001 - the table reports any failure as its row and goes on
            rows.append({**row, "error": why(e)})
            continue
        row.update(measured, floor_fraction=floor / measured["ms"] if c.muon else None)
        if row["oracle"]:
            reference = [p.detach().cpu() for p in params]
        elif c.compared and reference is not None:
            row.update(compare(params, reference))
        del params
        rows.append(row)
    base = next((r for r in rows if r["optimizer"] == TORCH_MUON and not r["error"]), None)
    for r in rows:
        r["x_torch"] = r["ms"] / base["ms"] if base and not r["error"] else None
    return rows


def bitwise_cell(row: dict) -> str:
    if row["oracle"]:
        return "oracle"
    if row["equal_muon_ref"] is None:
        return "-"
    return "bitwise" if row["equal_muon_ref"] else f"no {row['max_abs_diff']:.1e}"


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_step_table(
    run: StepRun, rows: list[dict], peak_tflops: float, ns_steps: int, clock: str
) -> None:
    num_params = sum(math.prod(s.shape) for s in run.specs)
    print(
        f"\n{run.name}: {run.description}, {len(run.specs)} Muon params ({num_params / 1e9:.3g} B), fp32 params "
        f"and grads; step: median of {run.steps} after {run.warmup} warm-up ({clock}); NS floor "
        f"{ns_floor_ms(list(run.specs), peak_tflops, ns_steps):.3g} ms ({ns_steps} steps at {peak_tflops:g} "
        f"TFLOP/s)"
        + (
            f"; {TORCH_MUON}: one 2-D param per expert of a stack (views)"
            if any(s.kind == "experts" for s in run.specs)
            else ""
        )
    )
    head = (
        f"{'optimizer':<40} {'step ms':>9} {'[min, max]':>19} {'x torch':>7} {'peak GiB':>8} {'of floor':>8} "
        f"{'= muon_ref':>12}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if r["error"]:
            print(f"{r['optimizer']:<40} unavailable: {r['error']}")
            continue
        interval = f"[{r['ms_min']:.4g}, {r['ms_max']:.4g}]"
        print(
            f"{r['optimizer']:<40} {r['ms']:>9.4g} {interval:>19} {fmt(r['x_torch'], '.2f'):>7} "
            f"{fmt(r['peak_gib'], '.1f'):>8} {fmt(r['floor_fraction'], '.3g'):>8} {bitwise_cell(r):>12}"
        )


# ------------------------------------------------------------------------------------------ kernel table


@dataclass(frozen=True)
class Kernel:
    """An orthogonalisation kernel of the kernel table: run(G) on a [batch x] m x n input."""

    name: str
    run: Callable[[Tensor], Tensor]
    matrices_only: bool = False  # 2-D inputs only


def kernels(
    cfg: MuonConfig, triton_tiles: list[tuple[int, int, int]], dion: object | None
) -> list[Kernel]:
    """muon_ref's kernel first (every difference is taken against it), then the others."""
    from muon_dist.kernels import BACKENDS, backend

    rows = [Kernel("muon_ref.newton_schulz", lambda G: newton_schulz(G, **cfg.ns_kwargs()))]
    with contextlib.suppress(
        ImportError
    ):  # a private module of torch.optim: its names may move between versions
        from torch.optim import _muon

        coefficients = (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)
        rows.append(
            Kernel(
                "torch.optim._muon._zeropower_via_newtonschulz",
                lambda G: _muon._zeropower_via_newtonschulz(
                    G, coefficients, _muon.DEFAULT_NS_STEPS, _muon.EPS
                ),
                matrices_only=True,
            )
        )
    for name in (
        BACKENDS
    ):  # imported at the first call: a backend whose package is missing is an unavailable row
        rows.append(
            Kernel(
                f"muon_dist.kernels backend {name}",
                lambda G, name=name: backend(name).orthogonalize(G, matrix_layout(G.shape), cfg),
            )
        )
    rows += [
        Kernel(f"triton_ns tiles {b}/{k}/{w}", triton_with_tiles(cfg, b, k, w))
        for b, k, w in triton_tiles
    ]
    return rows + ([] if dion is None else dion_kernels(dion))


def triton_with_tiles(
    cfg: MuonConfig, block: int, block_k: int, num_warps: int
) -> Callable[[Tensor], Tensor]:
    """The Triton kernel at these tiles with the config's NS arguments (those the fused step takes, as its backend)."""
    options = {k: v for k, v in cfg.ns_kwargs().items() if k not in ("step_form", "precondition")}

    def run(G: Tensor) -> Tensor:
        from muon_dist.kernels.triton_ns import newton_schulz_triton

        return newton_schulz_triton(G, **options, block=block, block_k=block_k, num_warps=num_warps)

    return run


# dion/newton_schulz_triton.py and dion/polar_express.py of microsoft/dion: (module, function)
DION_KERNELS = (
    ("newton_schulz_triton", "newton_schulz_triton"),
    ("newton_schulz_triton", "zeropower_via_newtonschulz5"),
    ("polar_express", "polar_express"),
    ("polar_express", "polar_express_triton"),
)


def dion_kernels(dion: object) -> list[Kernel]:
    """Those of DION_KERNELS that the checkout has, each called as fn(G) (its own epsilon)."""
    rows = []
    for module, function in DION_KERNELS:
        fn = getattr(importlib.import_module(f"{dion.__name__}.{module}"), function, None)
        if fn is not None:
            rows.append(Kernel(f"dion {function}", fn))
    return rows


def kernel_row(
    kernel: Kernel,
    G: Tensor,
    want: Tensor | None,
    reps: int,
    warmup: int,
    peak_tflops: float,
    ns_steps: int,
) -> dict:
    """One kernel on one input: timing, fraction of the peak, max |difference| from `want` (None: it is want)."""
    row = {
        "shape": "x".join(map(str, G.shape)),
        "kernel": kernel.name,
        "error": None,
        "ms": None,
        "ms_min": None,
        "ms_max": None,
        "peak_fraction": None,
        "max_abs_diff": None,
    }
    if kernel.matrices_only and G.ndim != 2:
        return {**row, "error": "2-D only"}
    try:
        out = kernel.run(G)
        for _ in range(warmup):
            kernel.run(G)
        measured = spread([elapsed_s(lambda: kernel.run(G), G.device) for _ in range(reps)])
        diff = 0.0 if want is None else (out.double() - want.double()).abs().max().item()
    except Exception as e:  # noqa: BLE001 - the table reports any failure as its row and goes on
        return {**row, "error": why(e)}
    peak_fraction = (
        kernel_flops(tuple(G.shape), ns_steps) / (measured["ms"] / 1e3) / (peak_tflops * 1e12)
    )
    return {**row, **measured, "peak_fraction": peak_fraction, "max_abs_diff": diff}


def kernel_table(
    shapes: list[tuple[int, ...]],
    candidates: list[Kernel],
    device: torch.device,
    reps: int,
    warmup: int,
    peak_tflops: float,
    ns_steps: int,
) -> list[dict]:
    rows = []
    for i, shape in enumerate(shapes):
        G = seeded(shape, 31 + i, device)
        want = candidates[0].run(G)
        rows += [
            kernel_row(k, G, None if j == 0 else want, reps, warmup, peak_tflops, ns_steps)
            for j, k in enumerate(candidates)
        ]
    return rows


def print_kernel_table(
    rows: list[dict], reps: int, warmup: int, peak_tflops: float, ns_steps: int, clock: str
) -> None:
    print(
        f"\nNewton-Schulz kernels, bf16 compute from fp32 input, {ns_steps} steps: median of {reps} calls after "
        f"{warmup} warm-up ({clock}); of peak: reference FLOPs / time / ({peak_tflops:g} TFLOP/s); max |diff| "
        "from muon_ref.newton_schulz"
    )
    head = f"{'shape':>14} {'kernel':<46} {'ms':>9} {'[min, max]':>19} {'of peak':>8} {'max |diff|':>10}"
    print(head)
    print("-" * len(head))
    for r in rows:
        if r["error"]:
            print(f"{r['shape']:>14} {r['kernel']:<46} unavailable: {r['error']}")
            continue
        interval = f"[{r['ms_min']:.4g}, {r['ms_max']:.4g}]"
        print(
            f"{r['shape']:>14} {r['kernel']:<46} {r['ms']:>9.4g} {interval:>19} {r['peak_fraction']:>8.3g} "
            f"{r['max_abs_diff']:>10.2e}"
        )


# ------------------------------------------------------------------------------------------ command line


def parse_tiles(text: str) -> tuple[int, int, int]:
    """'128/64/8' -> (block, block_k, num_warps)."""
    parts = text.split("/")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(
            f"tiles are block/block_k/num_warps, e.g. 128/64/8; got {text!r}"
        )
    return tuple(int(p) for p in parts)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--parts", nargs="+", choices=("steps", "kernels"), default=["steps", "kernels"]
    )
    parser.add_argument("--sets", nargs="+", choices=("dense", "moe"), default=["dense", "moe"])
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps and calls (default 2; --tiny 1)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="timed optimizer steps (default 5; --tiny 2)"
    )
    parser.add_argument(
        "--reps", type=int, default=None, help="timed kernel calls (default 10; --tiny 2)"
    )
    parser.add_argument(
        "--shapes",
        type=parse_shapes,
        default=None,
        help=f"kernel shapes, comma-separated (default {DEFAULT_SHAPES}; --tiny {TINY_SHAPES})",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=H100_SXM_DENSE_BF16_TFLOPS,
        help="dense bf16 peak of the GPU in TFLOP/s (default: H100 SXM, 989)",
    )
    parser.add_argument(
        "--triton-tiles",
        type=parse_tiles,
        nargs="*",
        default=[(128, 64, 8)],
        help="extra rows of the Triton kernel at these block/block_k/num_warps (default 128/64/8; "
        "its backend row uses the kernel's defaults, 64/32/4)",
    )
    parser.add_argument(
        "--dion", metavar="PATH", help="a microsoft/dion checkout: add its Muon and NS kernels"
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny sets and shapes (the whole pipeline in seconds)"
    )
    parser.add_argument("--json", metavar="FILE", help="write the header and every row as JSON")
    args = parser.parse_args(argv)
    tiny = args.tiny
    args.warmup = (1 if tiny else 2) if args.warmup is None else args.warmup
    args.steps = (2 if tiny else 5) if args.steps is None else args.steps
    args.reps = (2 if tiny else 10) if args.reps is None else args.reps
    args.shapes = (
        parse_shapes(TINY_SHAPES if tiny else DEFAULT_SHAPES)
        if args.shapes is None
        else args.shapes
    )
    return args


def header(device: torch.device, argv: list[str]) -> dict:
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = "not installed"
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    )
    return {
        "device": name,
        "torch": torch.__version__,
        "triton": triton,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": shlex.join(["python", "-m", "benchmarks", "gpu", *argv]),
    }


def run_all(args: argparse.Namespace, device: torch.device) -> dict:
    dion = load_dion(args.dion) if args.dion else None
    cfg = group_config(preset_defaults(PRESET, {}))
    ns_steps = num_ns_steps(cfg)
    clock = "CUDA events, synchronised" if device.type == "cuda" else "CPU wall clock"
    out = {"steps": [], "kernels": []}
    if "steps" in args.parts:
        sets = step_sets(args.tiny)
        with world_of_one(device):
            for name in args.sets:
                description, specs = sets[name]
                run = StepRun(name, description, tuple(specs), args.warmup, args.steps, device)
                rows = step_table(run, contenders(dion), args.peak_tflops, ns_steps)
                print_step_table(run, rows, args.peak_tflops, ns_steps, clock)
                out["steps"] += rows
    if "kernels" in args.parts:
        rows = kernel_table(
            args.shapes,
            kernels(cfg, args.triton_tiles, dion),
            device,
            args.reps,
            args.warmup,
            args.peak_tflops,
            ns_steps,
        )
        print_kernel_table(rows, args.reps, args.warmup, args.peak_tflops, ns_steps, clock)
        out["kernels"] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "benchmarks gpu: no CUDA device here: the GPU tables are skipped (run it on a GPU node; "
            "`python -m benchmarks gpu --device cpu --tiny` runs the whole pipeline at tiny sizes on CPU)"
        )
        return 0
    device = torch.device(args.device)
    head = header(device, argv)
    print(
        f"benchmarks gpu: {head['device']}, torch {head['torch']}, triton {head['triton']}, {head['date']}; "
        f"command: {head['command']}"
    )
    # without CUDA, torch.compile'd functions (Dion's) run eagerly: no compiler toolchain needed
    stance = (
        torch.compiler.set_stance("force_eager")
        if device.type == "cpu"
        else contextlib.nullcontext()
    )
    with stance:
        out = run_all(args, device)
    failed = [
        f"{r['set']} {r['optimizer']}" for r in out["steps"] if r.get("equal_muon_ref") is False
    ]
    print(
        f"\nnot bitwise equal to muon_ref: {failed or 'none'}; unavailable: "
        f"{sum(1 for r in out['steps'] + out['kernels'] if r['error'] and r['error'] != '2-D only')} rows"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": head, **out}, f, indent=1)
    return 0
