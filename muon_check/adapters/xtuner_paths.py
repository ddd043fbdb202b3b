"""xtuner's FSDP2 Muon (InternLM/xtuner `xtuner/v1/optim/muon.py`, PR 1716; checked at b934f462) on the paths
that systems.py's XtunerMuon does not reach: its other remainder strategy, its all-gather + reduce-scatter (AGRS)
switch, its fused expert layout `[E * m, n]` with `num_experts` in the param group (the groups
`MuonConfig.build` makes, `xtuner/v1/config/optim.py:159-164`), the expert paths that layout selects (local experts,
the sub-group all-gather), the expert-parallel (EP + FSDP) 2-D mesh, and xtuner as a training setup (its
`MuonConfig().build(model)`).

    XtunerPadAll2All   remainder_strategy="pad_all2all" (a constructor keyword; MuonConfig has no field for it)
    XtunerFusedAgrs    the shipped options, with the fused_sharded family ([E * m, n], num_experts = E)
    XtunerAllAgrs      enable_all2all=False (a MuonConfig field): every sharded batch through AGRS
    ...Nccl            the same with nccl_buffer_shapes(): the all-gather / reduce-scatter buffer shapes NCCL
                       takes and gloo refuses, given to gloo with NCCL's meaning (a stated shim)
    SUBGROUP_CASES     cases on the 1-D "fsdp" mesh that select its expert paths (run_cases runs them)
    EP_CASES           cases on the (fsdp, ep) mesh its MoE models build (run_ep runs them: the check's dtensor
                       families are 1-D, so the EP runs are driven here)
    XtunerSetup        MuonConfig().build(model) on the audit's model, FSDP2 (and XtunerSetupNccl,
                       XtunerSetupPadAll2All)

Every class runs the checkout's own code ($MUON_XTUNER_CHECKOUT, the folder holding `xtuner`); nothing of it is
copied here. XtunerSetup imports `xtuner/v1/config/optim.py`, which needs cyclopts, loguru and mmengine (xtuner's
own requirements): install them with `pip install --no-deps --target DIR cyclopts attrs docstring-parser rich-rst
docutils loguru mmengine addict yapf termcolor platformdirs` and put DIR on PYTHONPATH.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from ..audit import Setup
from .cases import DIST_FAMILIES, FUSED_DIST_FAMILIES, Case
from .systems import XtunerMuon, import_without_package_inits


class _XtunerPath(XtunerMuon):
    """XtunerMuon (MuonConfig.build's constructor keywords, config/optim.py:198-211) with `muon_kwargs` over them,
    on the dtensor families and xtuner's fused expert layout."""

    families = DIST_FAMILIES | FUSED_DIST_FAMILIES


class XtunerPadAll2All(_XtunerPath):
    """xtuner's Muon (checkout b934f462, `xtuner/v1/optim/muon.py`) built as MuonConfig.build builds it
    (XtunerMuon's docstring) with `remainder_strategy="pad_all2all"`, the constructor's other choice (muon.py:321,
    docstring 303-305: "restores the original FSDP2 Muon behavior"); MuonConfig has no field for it
    (config/optim.py:70-80), so a user reaches it by constructing Muon. A batch of fewer than W same-shape params
    is padded with `torch.zeros_like` params (`pad_batch`, muon.py:81-88, called at 884) and goes through the
    all-to-all (`_all_to_all_orthogonalize`, 1142) instead of all-gather + reduce-scatter. Claim: `xtuner` with
    `scale_apply="update_lr"` (XtunerMuon's), per expert where the group has num_experts (the lr ratio from
    `rows // num_experts`, muon.py:378). Families: the dtensor ones and fused_sharded ([E * m, n], num_experts = E
    in the group: xtuner's expert layout, config/optim.py:159-164)."""

    name = "xtuner Muon (FSDP2, remainder_strategy=pad_all2all)"
    muon_kwargs = {"remainder_strategy": "pad_all2all"}


class XtunerFusedAgrs(_XtunerPath):
    """xtuner's Muon (checkout b934f462) with MuonConfig's defaults (XtunerMuon's construction and claim), run on
    the fused_sharded family as well: xtuner's fused expert weights `[E * m, n]` with `num_experts = E` in the
    param group (config/optim.py:159-164), whose expert path (muon.py:674-692) depends on E against the fsdp
    size: E % W == 0 local experts, W % E == 0 a sub-group all-gather, else the all-to-all with num_experts blocks
    (a batch of fewer params than W: all-gather + reduce-scatter, the shipped remainder_strategy "agrs")."""

    name = "xtuner Muon (FSDP2, shipped options, fused experts)"


class XtunerAllAgrs(_XtunerPath):
    """xtuner's Muon (checkout b934f462) with MuonConfig's `enable_all2all=False` (config/optim.py:78-80: "set
    False on topologies where all-to-all is unreliable"): every sharded batch goes through all-gather +
    reduce-scatter (`_agrs_orthogonalize`, muon.py:975; selected at 743-747). Claim: XtunerMuon's."""

    name = "xtuner Muon (FSDP2, enable_all2all=False)"
    muon_kwargs = {"enable_all2all": False}


@contextlib.contextmanager
def nccl_buffer_shapes() -> Iterator[None]:
    """While open, make torch.distributed's `all_gather_into_tensor` and `reduce_scatter_tensor` take the buffer
    shapes that NCCL takes and gloo refuses, with NCCL's meaning: NCCL reads each buffer as one flat array
    (all-gather: rank i's input at offset i * input.numel() of the output; reduce-scatter: rank i gets the sum of
    the i-th of W equal slices of the input), whatever their shapes; gloo checks that the output's (input's)
    first dimension is W times the other's. The stand-ins view both buffers with that first dimension (the same
    memory, the same bytes) and call gloo's. xtuner allocates both outputs contiguous (torch.empty, muon.py:1007,
    1075, 1112). Opened around each optimizer step of the adapters and the setup named "(NCCL buffer shapes)"
    only, so no other candidate in the same rank process sees it; a stated shim of the collective's argument
    check, no optimizer arithmetic."""
    import torch.distributed as dist

    gather, scatter = dist.all_gather_into_tensor, dist.reduce_scatter_tensor

    def all_gather_into_tensor(
        output: Tensor, input: Tensor, group: Any = None, async_op: bool = False
    ):
        world = dist.get_world_size(group)
        flat = input.reshape(-1) if input.dim() == 0 else input
        rows = (world * flat.shape[0],) + tuple(flat.shape[1:])
        return gather(output.view(rows), flat.contiguous(), group=group, async_op=async_op)

    def reduce_scatter_tensor(
        output: Tensor, input: Tensor, op: Any = None, group: Any = None, async_op=False
    ):
        kwargs = {"group": group, "async_op": async_op}
        if op is not None:
            kwargs["op"] = op
        return scatter(output.view(-1), input.contiguous().view(-1), **kwargs)

    dist.all_gather_into_tensor, dist.reduce_scatter_tensor = (
        all_gather_into_tensor,
        reduce_scatter_tensor,
    )
    try:
        yield
    finally:
        dist.all_gather_into_tensor, dist.reduce_scatter_tensor = gather, scatter


def with_nccl_buffer_shapes(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`opt` whose step runs inside `nccl_buffer_shapes()`."""
    step = opt.step

    def shimmed(*args: Any, **kwargs: Any) -> Any:
        with nccl_buffer_shapes():
            return step(*args, **kwargs)

    opt.step = shimmed
    return opt


class _NcclBuffers:
    """Mixin: the optimizer's step runs inside `nccl_buffer_shapes()`."""

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        return with_nccl_buffer_shapes(super().build(params, **hp))


class XtunerFusedAgrsNccl(_NcclBuffers, XtunerFusedAgrs):
    """XtunerFusedAgrs (the shipped options) with `nccl_buffer_shapes()`: its all-gather + reduce-scatter
    remainder path (`_agrs_orthogonalize`, muon.py:975) and its sub-group all-gather (`_subgroup_orthogonalize`,
    1094) pass buffers whose shapes gloo refuses and NCCL takes; here they run on gloo with NCCL's reading of
    them. Claim: XtunerMuon's."""

    name = "xtuner Muon (FSDP2, shipped options, fused experts; NCCL buffer shapes)"


class XtunerAllAgrsNccl(_NcclBuffers, XtunerAllAgrs):
    """XtunerAllAgrs (`enable_all2all=False`) with `nccl_buffer_shapes()` (XtunerFusedAgrsNccl's shim)."""

    name = "xtuner Muon (FSDP2, enable_all2all=False; NCCL buffer shapes)"


# ------------------------------------------------------------------------------ the expert paths, 1-D mesh


def _fused(world_size: int, shapes: tuple, experts: int, dtype: str = "float32") -> Case:
    return Case(
        "fused_sharded",
        "dtensor",
        world_size,
        shapes,
        dtype,
        options=(("num_experts", experts),),
    )


# (label, case): each on the check's 1-D "fsdp" mesh (torch.chunk boxes), the path muon.py:674-692 selects
SUBGROUP_CASES: tuple[tuple[str, Case], ...] = (
    ("sub-group all-gather, expert rows split 1 | 1", _fused(4, ((4, 3),), 2)),
    ("sub-group all-gather, expert rows split 2 | 2", _fused(4, ((8, 3),), 2)),
    ("sub-group all-gather, boxes 2 | 2 | 2 | 0 cut expert 0", _fused(4, ((6, 3),), 2)),
    ("local experts (E % W == 0)", _fused(2, ((8, 3),), 4)),
    ("all-to-all, a full batch of fused params", _fused(2, ((10, 3),) * 2, 5)),
)


def run_cases(
    adapter: Any, cases: tuple[tuple[str, Case], ...] = SUBGROUP_CASES, timeout: float = 120.0
) -> list[tuple[str, Any]]:
    """(label, Outcome) of each case, run and judged as the check runs and judges a case (conformance.Runner:
    gloo ranks, gradients through autograd, muon_ref on the full tensors per expert)."""
    from ..conformance import Runner

    runner = Runner(adapter, timeout)
    try:
        return [(label, runner.run(case)) for label, case in cases]
    finally:
        runner.close()


# ------------------------------------------------------------------------ expert parallel: (fsdp, ep) mesh


EP = 2  # ep size of EP_CASES (on W = 4: fsdp 2)

# (label, case): the case's shapes are fused [E * m, n] params, num_experts E (the group's, global)
EP_CASES: tuple[tuple[str, Case], ...] = (
    ("ep 2: local experts (E/ep = 2 per fsdp 2)", _fused(4, ((8, 3),), 4)),
    ("ep 2: one param, E/ep = 3 (a remainder batch)", _fused(4, ((12, 3),), 6)),
    ("ep 2: two params, E/ep = 3 (a full batch)", _fused(4, ((12, 3),) * 2, 6)),
    ("ep 2: two params, E/ep = 1, expert rows 2", _fused(4, ((4, 3),) * 2, 2)),
    ("ep 2: two params, E/ep = 1, expert rows 3 (boxes 2 | 1)", _fused(4, ((6, 4),) * 2, 2)),
)


def ep_box(full: Tensor, rank: int, world_size: int, ep: int) -> Tensor:
    """What rank holds of a fused param on xtuner's (fsdp, ep) mesh (moe.py:1449-1452, row-major: rank =
    f * ep + e): the EP shard e of dim 0 (the experts of EP rank e), then FSDP2's torch.chunk f of its rows."""
    f, e = divmod(rank, ep)
    return full.chunk(ep, 0)[e].chunk(world_size // ep, 0)[f].clone()


def ep_rank(adapter: Any, case: Case, ep: int, strided: bool = True) -> dict[str, Any]:
    """On every rank of a W-rank gloo pool: the case's params as DTensors on a (W/ep fsdp, ep) mesh named as
    xtuner's MoE model names it ("default.fsdp", "default.ep"), placed (_StridedShard(0, ep), Shard(0)) as FSDP2
    places a param that EP already sharded on dim 0 (torch 2.13's fully_shard, `_fsdp_param.py`: a DP shard dim
    followed by a mesh dim that shards the same tensor dim becomes _StridedShard), or with strided=False
    (Shard(0), Shard(0)), the placements xtuner's EP branch reads (muon.py:641-666; the same boxes); each step's
    gradient (cases.gradients: the same full
    gradient on every rank) set as the param's grad on the same placements; the adapter's optimizer stepped
    case.steps times. Returns this rank's boxes after each step, or the error of the step that raised."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from .cases import gradients, initial_params
    from .oracle import candidate_hyperparameters

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("default.fsdp", "default.ep"))
    placements = (_StridedShard(0, split_factor=ep) if strided else Shard(0), Shard(0))

    def on_mesh(full: Tensor) -> Tensor:
        return DTensor.from_local(
            ep_box(full, rank, world, ep), mesh, placements, shape=full.shape, stride=full.stride()
        )

    params = [nn.Parameter(on_mesh(p)) for p in initial_params(case)]
    out: dict[str, Any] = {"steps": [], "error": None}
    try:
        opt = adapter.build(params, **{**candidate_hyperparameters(adapter), **dict(case.options)})
        for step in range(case.steps):
            for p, g in zip(params, gradients(case, step)):
                p.grad = on_mesh(g)
            opt.step()
            out["steps"].append([p.to_local().detach().clone() for p in params])
    except Exception as e:  # noqa: BLE001 - the step's error is the finding
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def run_ep(
    adapter: Any,
    cases: tuple[tuple[str, Case], ...] = EP_CASES,
    timeout: float = 120.0,
    strided: bool = True,
) -> list[tuple[str, str, float | None]]:
    """(label, status, max |dP|) per case: "bitwise" where every rank's box equals the box of muon_ref's params
    (the claim, per expert with the group's num_experts, on the full tensors) after every step, "differs",
    "crash: <error>" (the first rank's error; "could not run on gloo: ..." where it is gloo's reduce_scatter_tensor
    shape check) or "hang" (no answer in `timeout` seconds)."""
    from ..launch import RankFailure, RankPool
    from .diagnose import gloo_refusal
    from .oracle import claim_of, reference_steps

    preset, overrides = claim_of(adapter)
    results = []
    for label, case in cases:
        pool = RankPool(case.world_size, idle_s=5.0)
        try:
            got = pool.run(ep_rank, adapter, case, EP, strided, timeout=timeout)
        except RankFailure as failure:
            results.append((label, f"hang or rank failure: {failure}", None))
            continue
        finally:
            pool.close()
        errors = [r["error"] for r in got if r["error"]]
        if errors:
            refused = gloo_refusal(errors[0])
            first = errors[0].splitlines()[0]
            status = f"could not run on gloo: {refused}" if refused else f"crash: {first}"
            results.append((label, status, None))
            continue
        ref = reference_steps(case, preset, overrides)["skip"].params
        worst = 0.0
        for step, want in enumerate(ref):
            for rank, r in enumerate(got):
                for box, full in zip(r["steps"][step], want):
                    expected = ep_box(full, rank, case.world_size, EP)
                    if not torch.equal(box, expected):
                        worst = max(worst, (box.double() - expected.double()).abs().max().item())
        results.append((label, "bitwise" if worst == 0.0 else "differs", worst))
    return results


# ----------------------------------------------------------------------------------- xtuner as a setup


def _muon_config(root: str) -> Any:
    """xtuner's MuonConfig class from the checkout: `xtuner/v1/config/optim.py` with its parents `xtuner`,
    `xtuner.v1` and `xtuner.v1.config` registered bare (xtuner/v1/__init__.py imports triton and the model code;
    xtuner/v1/config/__init__.py the FSDP and generation configs); `xtuner.v1.optim` and `xtuner.v1.utils`, which
    it imports, run their own __init__ files."""
    import sys

    optim = sys.modules.get("xtuner.v1.optim")
    if optim is not None and not hasattr(optim, "Muon"):
        # registered bare by XtunerMuon in this process: give it what its __init__ exports
        muon = import_without_package_inits(
            root, "xtuner.v1.optim.muon", "xtuner.v1.optim.swap_adamw"
        )
        optim.Muon, optim.SwapAdamW = muon.Muon, sys.modules["xtuner.v1.optim.swap_adamw"].SwapAdamW
    return import_without_package_inits(root, "xtuner.v1.config.optim").MuonConfig


class XtunerSetup(Setup):
    """xtuner (checkout b934f462) as a training setup: its own builder `MuonConfig().build(model)`
    (`xtuner/v1/config/optim.py:82-213`) at MuonConfig's defaults (lr 1e-5, weight decay 0.1, momentum 0.95,
    eps 1e-8, adjust_lr "rms_norm", enable_all2all True) on the audit's model, sharded by FSDP2 on a 1-D mesh.

    The builder reads two things of xtuner's BaseModel that a plain nn.Module lacks, given to the model here as
    xtuner's classes define them (a stated shim, no optimizer code): `trainable_parameters()`, the named params
    with requires_grad (`xtuner/v1/model/base.py:607-609`), and `config` (read for `n_routed_experts`,
    config/optim.py:100-103; the audit model declares none, so num_experts is 1 and no param goes to the expert
    groups: those take names with "fused_w1w3" / "fused_w2" / "fused_w1" / "fused_w3", 109-141).
    Claim: xtuner's rule (config/optim.py:128-130): every >= 2-D param whose name holds neither "embed_tokens"
    nor "lm_head" and whose numel is not one of its dims to Muon, the rest to the AdamW group of the same
    optimizer (algorithm "adamw"); each 2-D matrix whole (no `get_muon_split_sizes` on the audit's modules,
    86-90); a 3-D stack flattened to one (E, m * n) matrix (flatten=True, 205; muon.py:1480-1482). Path:
    sharded (one owner per batch of W same-shape params). xtuner's trainer clips the gradients of the
    `clip_grad=True` groups only (train_engine.py:268-282: the AdamW group, max_grad_norm 1.0); that clip is
    not run here (no Muon param is clipped)."""

    name = "xtuner MuonConfig().build(model) + FSDP2"
    sharding, path = "fsdp2", "sharded"
    layouts = False
    adamw_patterns = ("*embed_tokens*", "*lm_head*")
    shardings = ("fsdp2",)
    remainder_strategy: str | None = None  # None: the builder's (muon.py:321, "agrs")

    def __init__(self, checkout: str | None = None) -> None:
        self.checkout = XtunerMuon(checkout).checkout

    def claimed(self) -> dict[str, dict[str, Any] | None]:
        from ..model import shapes

        def muon(name: str, shape: tuple[int, ...]) -> bool:
            numel = 1
            for d in shape:
                numel *= d
            return (
                len(shape) >= 2
                and "embed_tokens" not in name
                and "lm_head" not in name
                and numel not in shape
            )

        return {
            n: ({"flatten": True} if len(s) >= 3 else {}) if muon(n, s) else None
            for n, s in shapes().items()
        }

    def build(self, model: nn.Module) -> Any:
        inner = getattr(model, "module", model)
        root = XtunerMuon(self.checkout).root("xtuner/v1/config/optim.py")
        config = _muon_config(root)
        if not hasattr(inner, "trainable_parameters"):
            inner.trainable_parameters = lambda: [
                (n, p) for n, p in inner.named_parameters() if p.requires_grad
            ]
        if not hasattr(inner, "config"):
            inner.config = SimpleNamespace()
        opt = config().build(inner)
        if self.remainder_strategy is not None:
            opt._remainder_strategy = self.remainder_strategy
        return [opt]


class XtunerSetupPadAll2All(XtunerSetup):
    """XtunerSetup with the optimizer's `_remainder_strategy` set to "pad_all2all" after the builder made it
    (MuonConfig has no field for the constructor's `remainder_strategy`, config/optim.py:70-80; the attribute is
    what the constructor stores, muon.py:351, and all the step reads, 739-747): a batch of fewer than W
    same-shape params goes through the padded all-to-all, which gloo runs, instead of the reduce-scatter gloo
    refuses."""

    name = "xtuner MuonConfig().build(model) + FSDP2, remainder_strategy pad_all2all"
    remainder_strategy = "pad_all2all"


class XtunerSetupNccl(XtunerSetup):
    """XtunerSetup (the shipped builder and options) with `nccl_buffer_shapes()` on every rank: the reduce-scatter
    of its remainder batches (muon.py:1077), whose buffer shapes gloo refuses and NCCL takes, runs on gloo with
    NCCL's reading of its buffers (a stated shim of the collective's argument check)."""

    name = "xtuner MuonConfig().build(model) + FSDP2 (NCCL buffer shapes)"

    def build(self, model: nn.Module) -> Any:
        return [with_nccl_buffer_shapes(opt) for opt in super().build(model)]


__all__ = [
    "EP_CASES",
    "SUBGROUP_CASES",
    "XtunerAllAgrs",
    "XtunerAllAgrsNccl",
    "XtunerFusedAgrs",
    "XtunerFusedAgrsNccl",
    "nccl_buffer_shapes",
    "with_nccl_buffer_shapes",
    "XtunerPadAll2All",
    "XtunerSetup",
    "XtunerSetupNccl",
    "XtunerSetupPadAll2All",
    "ep_box",
    "ep_rank",
    "run_cases",
    "run_ep",
]


def main() -> None:
    """`python -m muon_check.adapters.xtuner_paths`: the expert cases on the 1-D mesh (SUBGROUP_CASES) and
    on the (fsdp, ep) mesh (EP_CASES, with torch's FSDP2 placements and with (Shard(0), Shard(0))) for the padded
    all-to-all and the shipped options under NCCL's buffer shapes, as `make field` records them."""
    for adapter in (XtunerPadAll2All(), XtunerFusedAgrsNccl()):
        print(adapter.describe())
        for label, outcome in run_cases(adapter):
            print(f"  1-D mesh  {label}: {outcome.status}")
        for strided in (True, False):
            placed = "FSDP2's (_StridedShard, Shard)" if strided else "(Shard, Shard)"
            for label, status, worst in run_ep(adapter, strided=strided):
                more = f" (max |dP| {worst:.3g})" if worst else ""
                print(f"  {placed}  {label}: {status}{more}")


if __name__ == "__main__":
    main()
