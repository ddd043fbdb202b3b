"""The setup audit: what a training setup does with each param of a real model, against what it claims.

    python -m muon_check --audit MODULE:SETUP [--world-sizes 4] [--micro-batches 2]

A Setup is a system's own way of building its optimizers from a model and a configuration (its builder, its
sharding, its training step). The audit builds model.AuditModel (fused QKV, gated attention, a per-head output
projection, expert stacks with E < W and E > W, an embedding tied to the head, norms, biases), shards it as the
setup does on W gloo ranks, lets the setup build its optimizers, and runs one optimizer step of `micro_batches`
micro-batches under trace.Trace on every rank, with the probe loss (model.py), so that every gradient is known
exactly:

    G_{r,i} = G + D_{r,i} (rank r, micro-batch i; sum over r, i of D_{r,i} = 0, integers / 64)
    loss_{r,i} = <params, G_{r,i}> / k, so the step's gradient is mean_r sum_i G_{r,i} / k = G bit for bit
    (for W and k powers of two)

Each Newton-Schulz call's input (trace.py) is attributed to a param and a view of it by its direction: on the first
step every convention orthogonalises a multiple of the gradient, so the input is, up to its dtype's rounding, a
multiple of one matrix of one view of G (|cos| >= MATCH_COS, the best): the claimed blocks (the setup's layout
keys, muon_ref.matrix_layout), the whole matrix, each expert, the stack flattened, 2-4 equal row blocks, a rank's
Shard(0) rows or Shard(1) columns, each on G or on a partial gradient (one rank's before the reduction, one
micro-batch's). The report lists per param: its claim (Muon with its blocks, or another optimizer), the optimizer
and group it went to, the blocks Newton-Schulz saw and its calls per optimizer step (over all ranks), the path
(one owner per matrix, every rank, tensor parallel) and the findings:

    silent fallback   claimed Muon, in a non-Muon optimizer or group, never orthogonalised
    never orthogonalised   claimed Muon, in a Muon group, no Newton-Schulz call
    orthogonalised elsewhere   claimed for another optimizer, orthogonalised
    wrong blocks      Newton-Schulz saw other blocks than the claim's (one fused matrix, a local shard, ...)
    partial gradient  a call on a micro-batch's or one rank's unreduced gradient
    calls per step    a block orthogonalised more often than the path needs (once per step and replica group
                      for a sharded path, once per rank for a replicated one)
    fallback          every rank orthogonalises a sharded matrix whole where the setup claims one owner
    unrouted          a trainable param in no optimizer
    crash             the step raised (its error and where; the routing is still read from construction, and
                      what the step did not reach draws no finding); "could not run on gloo" where the error is
                      gloo's refusal of a collective NCCL takes (unequal tensor shapes in a list-form all_to_all);
                      or the setup's own code refused to build it (no rows then: nothing was routed)
    unattributed      a Newton-Schulz call whose input is no view of any gradient (listed with its shape)
"""

from __future__ import annotations

import math
import os
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from muon_ref import matrix_layout
from muon_ref.split import DEFAULT_ADAMW_PATTERNS, split_params

from .model import MUON_LAYOUTS, AuditModel, shapes
from .trace import Trace

MATCH_COS = 0.99
SHARDINGS = (None, "fsdp2", "hsdp", "ddp")
PATHS = ("sharded", "replicated", None)


class Setup:
    """A training setup under the audit. Subclasses implement `build`; the others have defaults.

    sharding: how the model is laid out on W ranks before `build` (None: every rank its own full model, a
        single-device setup run W times; "fsdp2": fully_shard per layer and at the root on a 1-D mesh; "hsdp":
        the same on a (W/2 replicate, 2 shard) mesh; "ddp": DistributedDataParallel); `shard` may do otherwise,
        and a setup that lays the model out itself (an engine's ZeRO stages) names its own layouts in
        `shardings` and reads `self.sharding` in `build`. Any sharding but None gives each rank its own gradient.
    path: the Muon path it claims ("sharded": one rank orthogonalises each matrix per replica group;
        "replicated": every rank does; None: not claimed).
    layouts: True claims the model's declared layouts (model.MUON_LAYOUTS: fused projections split, per-head
        blocks); False every matrix whole (each expert of a stack on its own).
    adamw_patterns: the names (fnmatch) it claims to send to the other optimizer (besides every param with
        ndim < 2): muon_ref.split's rule.
    unreduced: with sharding None, each rank is given its own gradient (the setup's optimizer reduces them, as
        ZeRO-1/2 do) instead of the step's whole gradient.
    """

    name = "setup"
    sharding: str | None = "fsdp2"
    path: str | None = "sharded"
    layouts = True
    adamw_patterns: tuple[str, ...] = DEFAULT_ADAMW_PATTERNS
    unreduced = (
        False  # with sharding None: each rank its own gradient (the setup reduces), not the mean
    )
    shardings: tuple[
        str | None, ...
    ] = ()  # the layouts the invariance families run (besides W = 1)

    def build(self, model: nn.Module) -> Any:
        raise NotImplementedError(f"setup {self.name!r} must implement build(model)")

    def claimed(self) -> dict[str, dict[str, Any] | None]:
        """name -> the Muon layout keys it claims for the param, or None (another optimizer)."""
        model = AuditModel()
        muon, _ = split_params(model, self.adamw_patterns)
        return {
            name: (dict(MUON_LAYOUTS.get(name, {})) if self.layouts else {})
            if any(name == m for m, _ in muon)
            else None
            for name, _ in model.named_parameters()
        }

    def shard(self, model: nn.Module, world_size: int) -> nn.Module:
        return shard_as(model, self.sharding, world_size)

    def route(self, name: str, p: Tensor, optimizers: list[Any]) -> tuple | None:
        """(optimizer index, its class name, group index, the group's tags, whether it is a Muon group) of the
        group that holds p, or None. Setups whose optimizers hold flat copies (ZeRO) say it otherwise."""
        for o, opt in enumerate(optimizers):
            for g, group in enumerate(opt.param_groups):
                if any(q is p for q in group["params"]):
                    return (o, type(opt).__name__, g, _group_tag(group), _muon_group(opt, group))
        return None

    def held(self, p: Tensor) -> Tensor:
        """The part of p this rank holds (its DTensor shard, or p)."""
        return _local(p)

    def full(self, model: nn.Module) -> dict[str, Tensor]:
        """Every param whole (a collective where they are sharded), detached copies."""
        inner = getattr(model, "module", model)
        out = {}
        for name, p in inner.named_parameters():
            out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        return out

    def train_step(self, model: nn.Module, optimizers: list[Any], probes: list[dict]) -> None:
        """Every micro-batch's backward, then every optimizer's step and zero_grad."""
        for probe in probes:
            model(probe=probe).backward()
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)


def shard_as(model: nn.Module, sharding: str | None, world_size: int) -> nn.Module:
    if sharding is None:
        return model
    if sharding == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if sharding == "hsdp":
        if world_size % 2:
            raise ValueError(f"sharding 'hsdp' needs an even world size, got {world_size}")
        mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def shard_size(sharding: str | None, world_size: int) -> int:
    """The ranks a param's shards are spread over: W for fsdp2, 2 for hsdp, 1 otherwise."""
    return {"fsdp2": world_size, "hsdp": min(2, world_size)}.get(sharding, 1)


# ---------------------------------------------------------------------------------------------- the gradients


def _integers(shape: tuple[int, ...], key: str, low: int, high: int) -> Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randint(low, high + 1, shape, generator=g).to(torch.float32)


def probe_gradients(
    step: int, world_size: int, micro_batches: int, seed: int = 0
) -> tuple[dict[str, Tensor], dict[tuple[int, int], dict[str, Tensor]]]:
    """(G, {(rank, micro): G_{r,i} / k}) of the module docstring, for every param of AuditModel."""
    total, parts = {}, defaultdict(dict)
    n = world_size * micro_batches
    for name, shape in shapes().items():
        G = _integers(shape, f"{seed}/{step}/{name}", -16, 16)
        G[G == 0] = 1.0  # no zero entry: a zero gradient row would be no direction to attribute
        total[name] = G / 64
        deltas = [_integers(shape, f"{seed}/{step}/{name}/{j}", -16, 16) for j in range(n - 1)]
        deltas.append(-sum(deltas, torch.zeros(shape)))
        for r in range(world_size):
            for i in range(micro_batches):
                parts[(r, i)][name] = (G + deltas[r * micro_batches + i]) / 64 / micro_batches
    return total, dict(parts)


# ------------------------------------------------------------------------------------------ on every rank


def _placement(p: Tensor) -> str:
    placements = getattr(p, "placements", None)
    return "plain" if placements is None else ",".join(str(x) for x in placements)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _group_tag(group: dict[str, Any]) -> str:
    tags = [f"{k}={group[k]!r}" for k in ("use_muon", "algorithm") if k in group]
    return ", ".join(tags)


def _muon_group(opt: Any, group: dict[str, Any]) -> bool:
    """Whether a group is a Muon group: stated by a tag, or the optimizer is a Muon with no tag."""
    if "use_muon" in group:
        return bool(group["use_muon"])
    if "algorithm" in group:
        return str(group["algorithm"]).lower() == "muon"
    return "muon" in type(opt).__name__.lower()


def audit_rank(setup: Setup, world_size: int, micro_batches: int, seed: int) -> dict[str, Any]:
    """One rank's audit: its optimizers' routing, its Newton-Schulz calls, which params its step changed."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    setup.micro_batches = micro_batches
    refused = None
    try:
        model = setup.shard(AuditModel(seed), world_size)
        built = setup.build(model)
    except Exception as e:  # noqa: BLE001 - a setup its own code refuses to build is a finding, not a traceback
        refused = _error_line(e)
    if (
        world_size > 1 and dist.is_initialized()
    ):  # every rank stops if one could not build (no step to hang in)
        flag = torch.tensor([1 if refused else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag) and refused is None:
            return {"rank": rank, "construction_error": None}
    if refused is not None:
        return {"rank": rank, "construction_error": refused}
    optimizers = list(built) if isinstance(built, (list, tuple)) else [built]
    inner = getattr(model, "module", model)
    named = dict(inner.named_parameters())
    routes = {name: setup.route(name, p, optimizers) for name, p in named.items()}
    before = {n: setup.held(p).detach().clone() for n, p in named.items()}
    _, parts = probe_gradients(1, world_size, micro_batches, seed)
    own = setup.sharding or setup.unreduced
    probes = [parts[(rank, i)] for i in range(micro_batches)] if own else None
    if probes is None:  # every rank alone: the whole step's gradient in each micro-batch
        probes = [
            {n: sum(parts[(r, i)][n] for r in range(world_size)) / world_size for n in named}
            for i in range(micro_batches)
        ]
    error = None
    with Trace() as trace:
        try:
            setup.train_step(model, optimizers, probes)
        except Exception as e:  # noqa: BLE001 - a step that raises is a finding, reported with its routing
            error = _error_line(e)
    return {
        "rank": rank,
        "routes": routes,
        "placements": {n: _placement(p) for n, p in named.items()},
        "local_shapes": {n: tuple(setup.held(p).shape) for n, p in named.items()},
        "changed": {
            n: not torch.equal(before[n], setup.held(p).detach()) for n, p in named.items()
        },
        "calls": [(c.inputs, str(c.dtype), c.grams, c.distributed) for c in trace.calls],
        "dtensor_grams": trace.dtensor_grams,
        "collectives": len(trace.collectives),
        "error": error,
    }


_TRACE_FILE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "trace.py"
)  # the instrument's frames


def _error_line(e: BaseException) -> str:
    """The exception's type and first line, and the innermost frame outside torch that raised it."""
    import traceback

    frames = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if "/torch/" not in f.filename and f.filename != _TRACE_FILE
    ]
    where = (
        f" ({frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno})"
        if frames
        else ""
    )
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}{where}"


# --------------------------------------------------------------------------------------- the attribution


@dataclass(frozen=True)
class View:
    """One matrix of one reading of a param's gradient: `label` (the reading), `block` (its index), `box` (its
    index space in the param), `source` ("G", or the partial gradient it was read from)."""

    name: str
    label: str
    block: int
    box: tuple
    source: str


def _boxes(shape: tuple[int, ...], label: str, keys: dict[str, Any] | None, W: int) -> list[tuple]:
    """The index boxes of one reading (each read as a (fan_out, fan_in) matrix)."""
    full = tuple(slice(0, s) for s in shape)
    if label == "claimed" or label == "declared":
        return [b.index for b in matrix_layout(shape, **(keys or {})).blocks]
    if label == "whole":
        return [full] if len(shape) == 2 else []
    if label == "flattened":
        return [full] if len(shape) == 3 else []
    if label == "per expert":
        return [(slice(e, e + 1), *full[1:]) for e in range(shape[0])] if len(shape) == 3 else []
    if label.endswith("row blocks"):
        k = int(label.split()[0])
        if len(shape) != 2 or shape[0] % k or shape[0] == k:
            return []
        m = shape[0] // k
        return [(slice(j * m, (j + 1) * m), full[1]) for j in range(k)]
    if label in ("shard rows", "shard columns"):
        dim = 0 if label == "shard rows" else 1
        if len(shape) != 2 or W == 1:
            return []
        step = math.ceil(shape[dim] / W)
        cuts = [(o, min(o + step, shape[dim])) for o in range(0, shape[dim], step)]
        return [tuple(slice(a, b) if d == dim else full[d] for d in range(2)) for a, b in cuts]
    raise ValueError(label)


READINGS = (
    "claimed",
    "whole",
    "per expert",
    "declared",
    "flattened",
    "2 row blocks",
    "3 row blocks",
    "4 row blocks",
    "shard rows",
    "shard columns",
)


def _matrix(G: Tensor, box: tuple) -> Tensor:
    block = G[box]
    if block.dim() == 3 and block.shape[0] == 1:
        block = block[0]
    elif block.dim() == 3:
        block = block.reshape(block.shape[0], -1)
    return block.to(torch.float64)


def _canonical(m: Tensor) -> Tensor:
    m = m.T if m.shape[0] > m.shape[1] else m
    return m / m.norm().clamp_min(1e-300)


def catalogue(
    claims: dict[str, dict | None], world_size: int, micro_batches: int, shard: int, seed: int
) -> dict[tuple[int, int], list[tuple[View, Tensor]]]:
    """canonical shape -> every view's normalised matrix, in priority order (the claim's first)."""
    total, parts = probe_gradients(1, world_size, micro_batches, seed)
    sources: list[tuple[str, dict[str, Tensor]]] = [("G", total)]
    if world_size > 1:
        for r in range(world_size):
            sources.append(
                (
                    f"rank {r}'s gradient, not reduced",
                    {n: sum(parts[(r, i)][n] for i in range(micro_batches)) for n in total},
                )
            )
    if micro_batches > 1:
        for i in range(micro_batches):
            sources.append(
                (
                    f"micro-batch {i}'s gradient",
                    {
                        n: sum(parts[(r, i)][n] for r in range(world_size)) / world_size
                        for n in total
                    },
                )
            )
            for r in range(world_size if world_size > 1 else 0):
                sources.append((f"micro-batch {i} on rank {r}", parts[(r, i)]))
    out: dict[tuple[int, int], list[tuple[View, Tensor]]] = defaultdict(list)
    for name, shape in shapes().items():
        if len(shape) < 2:
            continue
        seen: set[tuple] = set()
        for label in READINGS:
            keys = claims.get(name) if label == "claimed" else MUON_LAYOUTS.get(name)
            if label == "claimed" and claims.get(name) is None:
                continue
            if label == "declared" and name not in MUON_LAYOUTS:
                continue
            for b, box in enumerate(_boxes(shape, label, keys, shard)):
                key = tuple((s.start, s.stop) for s in box)
                if key in seen:
                    continue
                seen.add(key)
                for source, grads in sources:
                    if source != "G" and label not in ("claimed", "whole", "per expert"):
                        continue
                    m = _canonical(_matrix(grads[name], box))
                    out[tuple(m.shape)].append((View(name, label, b, key, source), m))
    return out


def attribute(
    X: Tensor, views: dict[tuple[int, int], list[tuple[View, Tensor]]]
) -> tuple[View | None, float]:
    """The view whose matrix X is a multiple of (the first best at |cos| >= MATCH_COS), and that cosine."""
    X = _canonical(X.to(torch.float64))
    options = [X] + ([X.T] if X.shape[0] == X.shape[1] else [])
    best, best_cos = None, 0.0
    for view, m in views.get(tuple(X.shape), []):
        c = max(abs(float((o * m).sum())) for o in options)
        if c > best_cos + 1e-9:
            best, best_cos = view, c
    return (best, best_cos) if best_cos >= MATCH_COS else (None, best_cos)


# ----------------------------------------------------------------------------------------------- the report


@dataclass
class Row:
    name: str
    shape: tuple[int, ...]
    claim: str
    optimizer: str
    seen: str
    calls: int
    path: str
    findings: list[tuple[str, str]] = field(default_factory=list)


def _box_shape(box: tuple) -> tuple[int, ...]:
    dims = [b - a for a, b in box]
    if len(dims) == 3 and dims[0] == 1:
        return tuple(dims[1:])
    if len(dims) == 3:
        return (dims[0], dims[1] * dims[2])
    return tuple(dims)


def _seen_words(counts: dict[tuple[str, str], dict[tuple, int]]) -> str:
    words = []
    for (label, source), boxes in sorted(counts.items()):
        by_shape: dict[tuple[int, ...], int] = defaultdict(int)
        for box in boxes:
            by_shape[_box_shape(box)] += 1
        shapes_ = ", ".join(f"{n} x {s}" for s, n in sorted(by_shape.items()))
        words.append(f"{shapes_} ({label}{'' if source == 'G' else ', ' + source})")
    return "; ".join(words) or "-"


def _header(setup: Setup, world_size: int, micro_batches: int) -> dict[str, Any]:
    return {
        "setup": setup.name,
        "world_size": world_size,
        "micro_batches": micro_batches,
        "sharding": setup.sharding,
        "path_claimed": setup.path,
    }


def report(
    setup: Setup, results: list[dict[str, Any]], world_size: int, micro_batches: int, seed: int = 0
) -> dict[str, Any]:
    """The audit's rows and findings from every rank's result (a setup that could not be built on some rank: no
    rows, one "crash" finding naming the construction's error)."""
    if any("construction_error" in res for res in results):
        return _refused_report(setup, results, world_size, micro_batches)
    claims = setup.claimed()
    shard = shard_size(setup.sharding, world_size)
    views = catalogue(claims, world_size, micro_batches, shard, seed)
    per_param, unattributed, distributed = _attributed_calls(results, views)
    replicas = world_size // shard if setup.sharding else world_size
    rows = []
    for name, shape in shapes().items():
        rows.append(
            _row(
                setup,
                name,
                shape,
                claims.get(name),
                results,
                per_param.get(name, []),
                replicas,
                name in distributed,
                world_size,
            )
        )
    findings = _report_findings(rows, unattributed, results)
    dt = sorted({s for res in results for s in res["dtensor_grams"]})
    return {
        **_header(setup, world_size, micro_batches),
        "rows": [r.__dict__ for r in rows],
        "findings": [{"param": p, "kind": k, "text": t} for p, k, t in findings],
        "dtensor_grams": [list(s) for s in dt],
        "collectives_per_rank": [res["collectives"] for res in results],
    }


def _refused_report(
    setup: Setup, results: list[dict[str, Any]], world_size: int, micro_batches: int
) -> dict[str, Any]:
    """The report of a setup whose construction raised on some rank: no rows, one "crash" finding naming the
    ranks and the first error."""
    refused = sorted(
        {
            (res["construction_error"], res["rank"])
            for res in results
            if res.get("construction_error")
        }
    )
    ranks = ", ".join(str(r) for _, r in refused)
    text = f"the setup's construction raised on rank {ranks}: {refused[0][0]}"
    return {
        **_header(setup, world_size, micro_batches),
        "rows": [],
        "findings": [{"param": "-", "kind": "crash", "text": text}],
        "dtensor_grams": [],
        "collectives_per_rank": [],
    }


def _attributed_calls(
    results: list[dict[str, Any]], views: dict[tuple[int, int], list[tuple[View, Tensor]]]
) -> tuple[dict[str, list[tuple[View, int]]], list[str], set[str]]:
    """Every rank's Newton-Schulz inputs attributed to a view: (the views and ranks per param, a line per input
    no view matches, the params orthogonalised by a distributed call)."""
    per_param: dict[str, list[tuple[View, int]]] = defaultdict(list)
    unattributed: list[str] = []
    distributed: set[str] = set()
    for res in results:
        for inputs, dtype, grams, dist_ns in res["calls"]:
            for X in inputs:
                view, cos = attribute(X, views)
                if view is None:
                    unattributed.append(
                        f"rank {res['rank']}: {tuple(X.shape)} in {dtype} (best |cos| {cos:.3f})"
                    )
                    continue
                per_param[view.name].append((view, res["rank"]))
                if dist_ns:
                    distributed.add(view.name)
    return per_param, unattributed, distributed


def _report_findings(
    rows: list[Row], unattributed: list[str], results: list[dict[str, Any]]
) -> list[tuple[str, str, str]]:
    """The rows' findings, then the unattributed calls, as (param, kind, text); where the step raised, a first
    "crash" (or "could not run on gloo") finding and no finding the step did not reach."""
    findings = [(r.name, kind, text) for r in rows for kind, text in r.findings]
    findings += [("-", "unattributed", t) for t in unattributed]
    crashed = sorted({(res["error"], res["rank"]) for res in results if res.get("error")})
    if crashed:
        from .adapters.diagnose import gloo_refusal

        ranks = ", ".join(str(r) for _, r in crashed)
        refused = gloo_refusal(crashed[0][0])
        kind = "could not run on gloo" if refused else "crash"
        what = f" (gloo refuses this {refused}; NCCL takes it)" if refused else ""
        # what the step did not reach says nothing: only the construction-time routing stays
        findings = [f for f in findings if f[1] not in ("never orthogonalised", "calls per step")]
        findings.insert(0, ("-", kind, f"the step raised on rank {ranks}: {crashed[0][0]}{what}"))
    return findings


def _row(
    setup: Setup,
    name: str,
    shape: tuple[int, ...],
    keys: dict | None,
    results: list[dict[str, Any]],
    calls: list[tuple[View, int]],
    replicas: int,
    distributed: bool,
    W: int,
) -> Row:
    route = results[0]["routes"][name]
    optimizer = (
        "none"
        if route is None
        else f"{route[1]} group {route[2]}" + (f" ({route[3]})" if route[3] else "")
    )
    claim = (
        "other"
        if keys is None
        else "Muon" + (f" {', '.join(f'{k}={v}' for k, v in keys.items())}" if keys else "")
    )
    counts: dict[tuple[str, str], dict[tuple, int]] = defaultdict(lambda: defaultdict(int))
    ranks: dict[tuple, set[int]] = defaultdict(set)
    for view, rank in calls:
        counts[(view.label, view.source)][view.box] += 1
        ranks[view.box].add(rank)
    row = Row(name, shape, claim, optimizer, _seen_words(counts), len(calls), "-")
    changed = any(res["changed"][name] for res in results)
    if _routing_findings(row, route, keys, bool(calls), changed):
        return row
    expected = [tuple((s.start, s.stop) for s in b) for b in _boxes(shape, "claimed", keys, 1)]
    partial = _block_findings(row, calls, counts, expected)
    _path_findings(row, setup, counts, ranks, expected, partial, replicas, distributed, W)
    return row


def _routing_findings(
    row: Row, route: tuple | None, keys: dict | None, called: bool, changed: bool
) -> bool:
    """Unrouted, orthogonalised elsewhere, never orthogonalised, silent fallback; True when the row is complete
    (a param claimed for another optimizer, or a claimed matrix Newton-Schulz never saw)."""
    if route is None:
        row.findings.append(("unrouted", "a trainable param in no optimizer"))
    if keys is None:
        if called:
            row.findings.append(
                (
                    "orthogonalised elsewhere",
                    f"claimed for another optimizer; Newton-Schulz saw {row.seen}",
                )
            )
        return True
    if called:
        return False
    updated = "" if changed else "; not updated"
    if route is not None and route[4]:
        row.findings.append(
            (
                "never orthogonalised",
                f"in a Muon group ({row.optimizer}) but no Newton-Schulz call{updated}",
            )
        )
    elif route is not None:
        row.findings.append(
            (
                "silent fallback",
                f"a matrix claimed for Muon is stepped by the other optimizer ({row.optimizer}){updated}",
            )
        )
    return True


def _block_findings(
    row: Row, calls: list[tuple[View, int]], counts: dict, expected: list[tuple]
) -> bool:
    """Partial gradient (a call on a rank's or a micro-batch's part) and wrong blocks (Newton-Schulz saw other
    blocks of G than the claim's); whether any call was on a partial gradient."""
    claimed_boxes = {v.box for v, _ in calls if v.label == "claimed" and v.source == "G"}
    other = [(k, b) for k, b in counts.items() if k != ("claimed", "G")]
    partial = [k for k in counts if k[1] != "G"]
    if partial:
        row.findings.append(
            (
                "partial gradient",
                "Newton-Schulz ran on " + "; ".join(sorted({s for _, s in partial})),
            )
        )
    if [k for k in other if k[0][1] == "G"] or (set(expected) - claimed_boxes and not partial):
        row.findings.append(
            (
                "wrong blocks",
                f"Newton-Schulz saw {row.seen}; the claim: "
                + _seen_words({("claimed", "G"): {b: 1 for b in expected}}),
            )
        )
    return bool(partial)


def _path_findings(
    row: Row,
    setup: Setup,
    counts: dict,
    ranks: dict,
    expected: list[tuple],
    partial: bool,
    replicas: int,
    distributed: bool,
    W: int,
) -> None:
    """The path the calls show (tensor parallel, every rank, one owner per matrix and replica group), and the
    findings against the claimed path: calls per step, fallback."""
    per_block = [counts.get(("claimed", "G"), {}).get(b, 0) for b in expected]
    on_ranks = [len(ranks[b]) for b in expected]
    sharded = shard_size(setup.sharding, W) > 1
    if distributed:
        row.path = "tensor parallel (Gram combined across ranks)"
    elif all(n == W for n in on_ranks) and W > 1:
        row.path = "every rank" + (" (full_tensor)" if sharded else " (replicated)")
    elif all(n == replicas for n in on_ranks):
        row.path = "one owner per matrix" + (" and replica group" if replicas > 1 else "")
    else:
        row.path = f"ranks per block {on_ranks}"
    need = replicas if setup.path == "sharded" else (W if setup.path == "replicated" else None)
    if need is not None and any(n > need for n in per_block) and not partial:
        row.findings.append(
            (
                "calls per step",
                f"{per_block} calls per block in one optimizer step; the path needs {need}",
            )
        )
    if setup.path == "sharded" and sharded and row.path.startswith("every rank"):
        row.findings.append(
            (
                "fallback",
                "every rank orthogonalises the whole matrix (a full_tensor fallback); the setup "
                "claims one owner per matrix",
            )
        )


# ------------------------------------------------------------------------------------------------ running


def audit(
    setup: Setup,
    world_size: int = 4,
    micro_batches: int = 1,
    seed: int = 0,
    timeout: float = 120.0,
    pool: Any = None,
) -> dict[str, Any]:
    """The audit of one setup on world_size gloo ranks (a RankPool; pool: one to reuse)."""
    from .launch import RankPool

    valid = SHARDINGS + tuple(s for s in setup.shardings if s not in SHARDINGS)
    if setup.sharding not in valid:
        raise ValueError(
            f"setup {setup.name!r}: sharding must be one of {valid}, got {setup.sharding!r}"
        )
    if setup.path not in PATHS:
        raise ValueError(f"setup {setup.name!r}: path must be one of {PATHS}, got {setup.path!r}")
    own = pool is None
    pool = pool or RankPool(world_size, idle_s=10.0)
    try:
        results = pool.run(audit_rank, setup, world_size, micro_batches, seed, timeout=timeout)
    finally:
        if own:
            pool.close()
    return report(setup, results, world_size, micro_batches, seed)


def print_audit(rep: dict[str, Any], log=print) -> None:
    log(
        f"audit of {rep['setup']}: W = {rep['world_size']}, {rep['micro_batches']} micro-batch(es), "
        f"sharding {rep['sharding']}, claimed path {rep['path_claimed']}"
    )
    header = ("param", "shape", "claim", "optimizer", "Newton-Schulz saw", "calls", "path")
    log(" | ".join(header))
    for r in rep["rows"]:
        log(
            " | ".join(
                str(r[k]) for k in ("name", "shape", "claim", "optimizer", "seen", "calls", "path")
            )
        )
    for f in rep["findings"]:
        log(f"finding [{f['kind']}] {f['param']}: {f['text']}")
    if not rep["findings"]:
        log("no finding: every param routed, blocked and orthogonalised as claimed")
