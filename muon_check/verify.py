"""The main job: DistributedMuon checked against muon_ref on a model-like parameter set, path by path.

    python -m muon_check.verify [--world-sizes 1 2 4 8] [--steps 3] [--json FILE]
    python -m muon_check.verify --device cuda [--world-sizes 1 2 3 4 8]   (W ranks sharing the node's GPUs, gloo)
    torchrun --nproc-per-node N -m muon_check.verify --backend nccl      (one rank per GPU; gloo works too)

For each world size, gloo ranks (muon_check.launch.RankPool) train the Muon matrices of a scaled-down
transformer with dense and MoE layers (muon_check.shapes.tiny_moe: attention, MLP, experts; its embeddings and
norms go to AdamW and are listed, not checked) for a few steps, in every preset, on every mesh that fits
(fsdp: Shard(0) on a 1-D mesh; hsdp: (Replicate, Shard(0)); ddp: plain replicated tensors), in automatic
mode, forcing each remainder path, with dispatch="batched", and across a checkpoint (torch.distributed.checkpoint
save after half the steps, load into fresh params and a fresh optimizer, continue). On the ep mesh (2 x W/2, placements (Shard(0), Shard(0))) the experts
are fused [E * m, n] with num_experts = E, the layout whose boxes can split an expert, so the expert paths
(local, subgroup_all_gather, or the fallback) all occur. The parent runs muon_ref.Muon on the full tensors with
the same gradients and param groups, and compares every rank's shard with its box of the reference, bit
pattern for bit pattern. Shards come back to the parent as they are (their global offsets beside them): no
rank ever gathers a full tensor (DTensor.full_tensor, through torch's functional collectives, killed the ranks
with SIGSEGV on gloo over CUDA tensors, torch 2.11: docs/gpu.md).

--device cuda: the ranks' params, gradients and optimizer live on CUDA (W ranks share the node's GPUs, gloo
carrying CUDA tensors; muon_check.launch) and the reference runs on CUDA too: the same code as on CPU, with
CUDA kernels. NCCL needs one GPU per rank: torchrun with --backend nccl.

Contract checked: every path is bitwise (proofs/paths.md); a run that is not, or that crashes or hangs, is a
violation and the exit code is 1. Bytes: this rank's sent bytes per step against the lower bound per rank,
    sharded params:  sum over matrices of (p - 1) / p * S * (b_direction + b_update) / W
    replicated:      sum over matrices of (W - 1) / W * S * b_update     (each rank must receive the others')
where W is the shard group's size (W / 2 on the hsdp mesh), p the number of its ranks that hold a piece of
the matrix (a matrix held whole by one rank needs no traffic: p = 1), S a matrix's element count and b the
bytes of an element (proofs/paths.md#a2a).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

import muon_ref
from muon_dist.kernels import direction_bytes as kernel_direction_bytes
from muon_dist.optim import UPDATE_LAYOUT
from muon_ref.optim import group_config
from muon_ref.presets import PRESETS, preset_defaults

from .fixtures import axis_codes, box_of, distribute, local, mesh_shape, same_bits, seeded
from .shapes import ParamSpec, tiny_moe


@dataclass(frozen=True)
class Run:
    """One distributed training run: world size, mesh kind, preset, mode (DistributedMuon options), dtype."""

    world_size: int
    mesh: str  # "fsdp" | "hsdp" | "ep" | "ddp" | "tp"
    preset: str
    mode: str  # "auto" | "resume" | "remainder=padded_all_to_all" | "force=agrs" | "force=padded_all_to_all"
    #            | "dispatch=batched"
    dtype: str = "float32"
    steps: int = 3
    seed: int = 0

    def options(self) -> dict:
        if self.mode in ("auto", "resume"):
            return {}
        key, value = self.mode.split("=")
        return {{"force": "force_path"}.get(key, key): value}


# the tp mesh: each matrix as parallelize_module shards it (ColwiseParallel: rows; RowwiseParallel: columns), FSDP2
# over it (a strided Shard(0) under Colwise); experts sharded by dp and replicated over tp
COLWISE, ROWWISE = (
    ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "router"),
    ("o_proj", "down_proj"),
)
HEADS = 3  # tiny_moe's query heads (muon_check/shapes.py): q and o orthogonalised per head on the tp mesh


def _role(spec: ParamSpec) -> str:
    return next((name for name in COLWISE + ROWWISE if name in spec.name), "experts")


def muon_specs(mesh: str = "fsdp") -> list[ParamSpec]:
    """The Muon params in param-group order: on the ep mesh the experts are fused and come last (their group); on
    the tp mesh the q and o projections come last (their per-head groups)."""
    specs = [s for s in tiny_moe() if s.is_muon]
    if mesh == "tp":
        return (
            [s for s in specs if _role(s) not in ("q_proj", "o_proj")]
            + [s for s in specs if _role(s) == "q_proj"]
            + [s for s in specs if _role(s) == "o_proj"]
        )
    if mesh != "ep":
        return specs
    fused = [
        ParamSpec(s.name, (s.shape[0] * s.shape[1], s.shape[2]), "experts", s.shape[0])
        for s in specs
        if s.num_experts
    ]
    return [s for s in specs if not s.num_experts] + fused


def param_groups(mesh: str, params: list) -> list[dict]:
    """One group of plain matrices; on the ep mesh, a second group of fused experts with num_experts; on the tp
    mesh, a group of q projections per head (rows) and one of o projections per head (columns)."""
    specs = muon_specs(mesh)
    if mesh == "tp":
        keys = {"q_proj": {"num_heads": HEADS}, "o_proj": {"num_heads": HEADS, "split_dim": 1}}
        groups: dict[str, dict] = {}
        for p, s in zip(params, specs):
            role = _role(s) if _role(s) in keys else "plain"
            group = groups.setdefault(role, {"params": [], "param_names": [], **keys.get(role, {})})
            group["params"].append(p)
            group["param_names"].append(s.name)
        return list(groups.values())
    experts = [s.num_experts for s in tiny_moe() if s.num_experts]
    split = len(specs) - (len(experts) if mesh == "ep" else 0)
    groups = [{"params": params[:split], "param_names": [s.name for s in specs[:split]]}]
    if split < len(specs):
        groups.append(
            {
                "params": params[split:],
                "param_names": [s.name for s in specs[split:]],
                "num_experts": experts[0],
            }
        )
    return groups


def initial(run: Run, device: str = "cpu") -> list[torch.Tensor]:
    return [
        seeded(s.shape, run.seed * 7919 + i, run.dtype, device)
        for i, s in enumerate(muon_specs(run.mesh))
    ]


def gradients(run: Run, step: int, device: str = "cpu") -> list[torch.Tensor]:
    return [
        seeded(s.shape, run.seed * 104729 + 1000 * step + i + 1, run.dtype, device)
        for i, s in enumerate(muon_specs(run.mesh))
    ]


def placement(run: Run, spec: ParamSpec) -> tuple[str, str]:
    """(placement, mesh kind) of a param of the run (muon_check.fixtures)."""
    if run.mesh == "tp":
        role = _role(spec)
        return ("S0:2,S0" if role in COLWISE else "S0,S1" if role in ROWWISE else "S0,R"), "tp2"
    return {"ddp": ("plain", "fsdp"), "ep": ("S0", "ep2")}.get(run.mesh, ("S0", run.mesh))


def runs_for(world_size: int, steps: int, presets: list[str] | None = None) -> list[Run]:
    """Every preset (or those given) in automatic mode on the 1-D mesh; the torch preset on the other meshes,
    in bf16, across a checkpoint, with each remainder path forced, and with dispatch="batched" (automatic mode
    is DistributedMuon's default, global dispatch)."""
    out = [Run(world_size, "fsdp", p, "auto", steps=steps) for p in sorted(presets or PRESETS)]
    out.append(Run(world_size, "fsdp", "torch", "auto", "bfloat16", steps=steps))
    out.append(Run(world_size, "fsdp", "torch", "resume", steps=max(steps, 2)))
    out.append(Run(world_size, "ddp", "torch", "auto", steps=steps))
    if world_size >= 4 and world_size % 2 == 0:
        out.append(Run(world_size, "hsdp", "torch", "auto", steps=steps))
        out.append(Run(world_size, "ep", "torch", "auto", steps=steps))
        out.append(Run(world_size, "tp", "torch", "auto", steps=steps))
    if world_size > 1:
        out += [
            Run(world_size, "fsdp", "torch", m, steps=steps)
            for m in (
                "remainder=padded_all_to_all",
                "force=agrs",
                "force=padded_all_to_all",
                "dispatch=batched",
            )
        ]
    return out


# ------------------------------------------------------------------------------------------------ ranks


def _distribute(full: torch.Tensor, run: Run, spec: ParamSpec, device: str) -> torch.Tensor:
    return distribute(full, *placement(run, spec), device)


def rank_run(run: Run, device: str = "cpu", checkpoint_dir: str | None = None) -> dict:
    """Train on this rank; return its shards (CPU copies), the paths, bytes and step times. mode "resume": a DCP
    checkpoint in `checkpoint_dir` after half the steps, then fresh (zero) params and a fresh optimizer load it and
    take the remaining steps."""
    from muon_dist import DistributedMuon

    specs = muon_specs(run.mesh)
    params = [_distribute(f, run, s, device) for f, s in zip(initial(run, device), specs)]
    opt = DistributedMuon(param_groups(run.mesh, params), preset=run.preset, **run.options())
    times = []
    for step in range(run.steps):
        if run.mode == "resume" and step == run.steps // 2:
            params, opt = _save_and_reload(run, params, opt, device, checkpoint_dir)
        for p, g, s in zip(params, gradients(run, step, device), specs):
            p.grad = _distribute(g, run, s, device)
        start = time.perf_counter()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    shards = [local(p).detach().cpu().clone() for p in params]
    return {
        "shards": shards,
        "paths": list(opt.last_report.paths),
        "step_s": times,
        "bytes": {k: list(v) for k, v in opt.last_report.bytes_by_path.items()},
    }


def _save_and_reload(
    run: Run, params: list, opt, device: str, checkpoint_dir: str | None
) -> tuple[list, object]:
    """DCP-save params and optimizer state, then load them into zero params and a new optimizer."""
    import torch.distributed.checkpoint as dcp

    from muon_dist import DistributedMuon

    assert checkpoint_dir is not None, "mode 'resume' needs a checkpoint directory"
    dcp.save(
        {"params": {f"p{i}": p for i, p in enumerate(params)}, "optim": opt.state_dict()},
        checkpoint_id=checkpoint_dir,
    )
    fresh = [
        _distribute(torch.zeros_like(f), run, s, device)
        for f, s in zip(initial(run, device), muon_specs(run.mesh))
    ]
    new_opt = DistributedMuon(param_groups(run.mesh, fresh), preset=run.preset, **run.options())
    state = {"params": {f"p{i}": p for i, p in enumerate(fresh)}, "optim": new_opt.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    new_opt.load_state_dict(state["optim"])
    return fresh, new_opt


# ----------------------------------------------------------------------------------------------- parent


def reference(run: Run, device: str = "cpu") -> list[torch.Tensor]:
    """muon_ref.Muon on the full tensors with the run's gradients (one intra-op thread, as the ranks), on
    `device`; the result as CPU tensors."""
    params = [torch.nn.Parameter(t.clone()) for t in initial(run, device)]
    opt = muon_ref.Muon(
        param_groups(run.mesh, params), preset=run.preset, update_layout=UPDATE_LAYOUT
    )
    for step in range(run.steps):
        for p, g in zip(params, gradients(run, step, device)):
            p.grad = g
        opt.step()
    return [p.detach().cpu() for p in params]


def compare(run: Run, results: list[dict], want: list[torch.Tensor]) -> list[dict]:
    """Per param: its path, max |difference| over ranks, and whether every rank's shard is bitwise its box."""
    rows, W = [], run.world_size
    for i, full in enumerate(want):
        worst, equal = 0.0, True
        for rank, r in enumerate(results):
            got, box = (
                r["shards"][i],
                box_of(full, *placement(run, muon_specs(run.mesh)[i]), rank, W),
            )
            if got.numel() and got.shape == box.shape:
                worst = max(worst, float((got.double() - box.double()).abs().max()))
            equal &= same_bits(got, box)
        rows.append(
            {
                "param": results[0]["paths"][i][0],
                "path": results[0]["paths"][i][1],
                "max_diff": worst,
                "bitwise": equal,
            }
        )
    return rows


def direction_bytes(preset: str, param_dtype: torch.dtype) -> int:
    """muon_dist.kernels.direction_bytes of the preset's group config."""
    return kernel_direction_bytes(group_config(preset_defaults(preset, {})), param_dtype)


def lower_bound_per_rank(run: Run, path: str, params: list[int]) -> float:
    """Bytes a rank must send, on average over its shard group, for these params: for each matrix (an expert of a
    stack, a block of a split or per-head param, else the whole param) of S elements whose largest piece on any
    rank has p elements, someone must receive S - p direction elements and send the S - p update elements back:
    (S - p) (b_direction + b_update) / W (b_direction: direction_bytes). Replicated: each rank must receive the other members' results,
    (W - 1) / W S b_update. The pieces come from the fixtures' boxes (torch.chunk), apart from muon_dist."""
    b_dir = direction_bytes(run.preset, getattr(torch, run.dtype))
    b_upd = 2  # the kernel's output dtype: bf16 in every preset
    specs, total = muon_specs(run.mesh), 0.0
    groups = param_groups(run.mesh, list(range(len(specs))))
    for i in params:
        spec = specs[i]
        code, kind = placement(run, spec)
        W = _group_size(code, kind, run.world_size)
        keys = next(
            (
                {k: v for k, v in g.items() if k not in ("params", "param_names")}
                for g in groups
                if i in g["params"]
            )
        )
        labels = torch.arange(math.prod(spec.shape)).reshape(spec.shape)
        held = [
            set(box_of(labels, code, kind, r, run.world_size).flatten().tolist())
            for r in range(run.world_size)
        ]
        for block in muon_ref.matrix_layout(spec.shape, **keys).blocks:
            S = math.prod(block.shape)
            if path == "replicated":
                total += (W - 1) / W * S * b_upd
            else:
                inside = set(labels[block.index].flatten().tolist())
                total += (S - max(len(inside & h) for h in held)) * (b_dir + b_upd) / W
    return total


def _group_size(code: str, kind: str, world_size: int) -> int:
    """Ranks of a shard group: the product of the sizes of the mesh axes that shard (all of them when none do)."""
    shape, _ = mesh_shape(kind, world_size)
    sizes = [n for n, c in zip(shape, axis_codes(code, kind, world_size)) if c != "R"]
    return math.prod(sizes) if sizes and code != "plain" else world_size


def summarise(run: Run, results: list[dict], rows: list[dict]) -> list[dict]:
    """One row per path of this run."""
    by_path: dict[str, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        by_path[row["path"]].append(i)
    out = []
    for path, members in sorted(by_path.items()):
        sent = statistics.mean(r["bytes"].get(path, [0, 0])[0] for r in results)
        bound = lower_bound_per_rank(run, path, members)
        out.append(
            {
                "world_size": run.world_size,
                "mesh": run.mesh,
                "mode": run.mode,
                "preset": run.preset,
                "dtype": run.dtype,
                "path": path,
                "params": len(members),
                "max_diff": max(rows[i]["max_diff"] for i in members),
                "bitwise": all(rows[i]["bitwise"] for i in members),
                "bytes_per_rank": sent,
                "bound_per_rank": bound,
                "step_ms": 1e3 * statistics.median(results[0]["step_s"]),
            }
        )
    return out


def print_table(world_size: int, rows: list[dict]) -> None:
    print(
        f"\nW = {world_size}: {len(rows)} (run, path) rows; bytes are this rank's sent bytes per step"
    )
    head = (
        f"{'mode':<28} {'mesh':<5} {'preset':<9} {'dtype':<8} {'path':<18} {'params':>6} {'max|diff|':>9} "
        f"{'bitwise':>7} {'bytes/rank':>11} {'bound':>9} {'ratio':>6} {'step ms':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        ratio = (
            f"{r['bytes_per_rank'] / r['bound_per_rank']:.2f}"
            if r["bound_per_rank"]
            else ("1.00" if r["bytes_per_rank"] == 0 else "inf")
        )
        print(
            f"{r['mode']:<28} {r['mesh']:<5} {r['preset']:<9} {r['dtype']:<8} {r['path']:<18} {r['params']:>6} "
            f"{r['max_diff']:>9.2g} {'yes' if r['bitwise'] else 'NO':>7} {r['bytes_per_rank']:>11.0f} "
            f"{r['bound_per_rank']:>9.0f} {ratio:>6} {r['step_ms']:>8.1f}"
        )


def verify_world(
    world_size: int,
    steps: int,
    refs: dict,
    timeout: float,
    presets: list[str] | None = None,
    device: str = "cpu",
) -> tuple[list[dict], list[str]]:
    from .launch import RankFailure, RankPool

    rows, violations = [], []
    pool = RankPool(world_size, device)
    try:
        todo = runs_for(world_size, steps, presets)
        for n, run in enumerate(todo, 1):
            start = time.perf_counter()
            try:
                with tempfile.TemporaryDirectory(prefix="muon_dist_verify_ckpt_") as checkpoint_dir:
                    results = pool.run(rank_run, run, device, checkpoint_dir, timeout=timeout)
            except RankFailure as failure:
                violations.append(f"{run}: {str(failure)[-400:]}")
                print(
                    f"[W={world_size}] {n}/{len(todo)} {run.mesh} {run.preset} {run.mode}: FAILED",
                    file=sys.stderr,
                )
                continue
            key = (
                run.preset,
                run.dtype,
                run.steps,
                run.seed,
                run.mesh if run.mesh in ("ep", "tp") else "",
            )
            refs.setdefault(key, reference(run, device))
            per_param = compare(run, results, refs[key])
            violations += [
                f"{run}: {r['param']} ({r['path']}) differs by {r['max_diff']:.3g}"
                for r in per_param
                if not r["bitwise"]
            ]
            rows += summarise(run, results, per_param)
            print(
                f"[W={world_size}] {n}/{len(todo)} {run.mesh} {run.preset} {run.dtype} {run.mode}: "
                f"{'ok' if all(r['bitwise'] for r in per_param) else 'VIOLATION'} "
                f"({time.perf_counter() - start:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
    finally:
        pool.close()
    return rows, violations


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring): exit 0 when every run matches muon_ref bit for bit, 1 on a contract
    violation, 2 when the device or backend asked for is not available."""
    args = _parser().parse_args(argv)
    args.world_sizes = args.world_sizes or (
        [1, 2, 3, 4, 8] if args.device == "cuda" else [1, 2, 4, 8]
    )
    if not _device_ready(args):
        return 2
    torch.set_num_threads(1)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return torchrun_main(args)
    specs = tiny_moe()
    print(
        f"muon_dist verification: {sum(s.is_muon for s in specs)} Muon matrices of a {len(specs)}-param "
        f"model (tiny_moe), {args.steps} steps, against muon_ref on the full tensors, on {args.device}"
    )
    print("routed to AdamW, not checked: " + ", ".join(s.name for s in specs if not s.is_muon))
    refs: dict = {}
    rows, violations = [], []
    for W in args.world_sizes:
        got_rows, got_violations = verify_world(
            W, args.steps, refs, args.timeout, args.presets, args.device
        )
        print_table(W, got_rows)
        rows += got_rows
        violations += got_violations
    paths_seen = sorted({r["path"] for r in rows})
    print(f"\npaths exercised: {', '.join(paths_seen)}; contract violations: {len(violations)}")
    for v in violations[:20]:
        print("  " + v)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "violations": violations}, f, indent=1)
    return 1 if violations else 0


def _parser() -> argparse.ArgumentParser:
    """The command line's options (--help shows the module docstring)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--world-sizes",
        type=int,
        nargs="+",
        help="default: 1 2 4 8 on cpu, 1 2 3 4 8 on cuda (W = 8: the ep mesh whose experts split)",
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--presets",
        nargs="+",
        choices=sorted(PRESETS),
        help="presets run in automatic mode "
        "(default: all; the other meshes and the forced paths always use the torch preset)",
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds per run before it counts as a hang"
    )
    parser.add_argument(
        "--backend", default="gloo", help="gloo (spawned ranks) or nccl (under torchrun)"
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where params, gradients and the "
        "reference live (cuda: W gloo ranks share the node's GPUs)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        help="under torchrun: a directory every rank can read and write, for "
        "the resume run (default: a temporary directory made by rank 0; one node only)",
    )
    parser.add_argument("--json", metavar="FILE", help="write every row and violation as JSON")
    return parser


def _device_ready(args: argparse.Namespace) -> bool:
    """Whether the device the run needs (CUDA for --backend nccl, else --device) is available; prints the error
    to stderr where it is not."""
    from .launch import device_unavailable

    unavailable = device_unavailable("cuda" if args.backend == "nccl" else args.device)
    if unavailable:
        if args.backend == "nccl":
            print(f"error: --backend nccl needs CUDA: {unavailable} (gloo)", file=sys.stderr)
        else:
            print(f"error: --device {unavailable}", file=sys.stderr)
        return False
    return True


def torchrun_main(args: argparse.Namespace) -> int:
    """Under torchrun: this process is one rank; rank 0 gathers the results, compares and prints."""
    import torch.distributed as dist

    device = "cuda" if args.backend == "nccl" else args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(args.backend)
    W, rows, violations = dist.get_world_size(), [], []
    made = [
        args.checkpoint_dir
        or (tempfile.mkdtemp(prefix="muon_dist_verify_ckpt_") if dist.get_rank() == 0 else None)
    ]
    dist.broadcast_object_list(made, src=0)
    try:
        for n, run in enumerate(runs_for(W, args.steps, args.presets)):
            result = rank_run(run, device, os.path.join(made[0], f"run{n}"))
            gathered = [None] * W
            dist.all_gather_object(gathered, result)
            if dist.get_rank() == 0:
                per_param = compare(run, gathered, reference(run, device))
                violations += [
                    f"{run}: {r['param']} differs" for r in per_param if not r["bitwise"]
                ]
                rows += summarise(run, gathered, per_param)
        if dist.get_rank() == 0:
            print_table(W, rows)
            print(
                f"paths exercised: {', '.join(sorted({r['path'] for r in rows}))}; "
                f"contract violations: {len(violations)}"
            )
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"rows": rows, "violations": violations}, f, indent=1)
    finally:
        dist.destroy_process_group()
        if args.checkpoint_dir is None and made[0] and os.path.isdir(made[0]):
            shutil.rmtree(made[0], ignore_errors=True)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
