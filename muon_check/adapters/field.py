"""Adapters for three Muons from the field: torchtitan's DistMuon, Dion's Muon and gram-newton-schulz's Muon.

Each claim was read from the source at the version named in its docstring (file:line there) and checked by
hand; the docs/public-muons.md gives every departure's cause. Two of them ship their
update under torch.compile; their adapters run it eagerly (torch.compiler.set_stance("force_eager") in the
process that builds the optimizer: a rank of the conformance pool), because the oracle restates eager op
sequences (as for the `dion` and `xtuner` presets) and compiled kernels have bits of their own (README:
muon-fsdp2's compiled NS loop).

Install (their declared dependencies pull CUDA wheels or a training stack; docs/public-muons.md):
    pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 gram-newton-schulz==0.1.6
    pip install tyro==1.0.17          # torchtitan.distributed's __init__ imports its config manager
Dion is a checkout, never installed: MUON_DION_CHECKOUT=/path/to/dion (the folder holding the `dion` package).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import torch
from torch import Tensor

from . import Adapter, package_version
from .cases import DIST_FAMILIES, SINGLE_FAMILIES

DION_CHECKOUT_ENV = "MUON_DION_CHECKOUT"


def _run_eagerly() -> None:
    """Every torch.compile region of this process runs eagerly (read at call time, unlike TORCHDYNAMO_DISABLE,
    which only acts on functions decorated after it is set)."""
    torch.compiler.set_stance("force_eager")


class TorchtitanDistMuon(Adapter):
    """torchtitan 0.3.0 DistMuon (torchtitan/distributed/flex_shard/dist_muon.py), built as torchtitan builds it
    (build_dist_muon with one group of named params, one bucket):
    - EMA momentum `M.lerp_(G, 1 - mu)`, Nesterov `torch.lerp(G, M, mu)` (dist_muon.py:1618-1627);
    - NS: bf16, transposed when fan_out > fan_in, `div_(norm(dim=(-2, -1)).clamp_min(eps))`, keller coefficients,
      `addmm` steps on a matrix, `baddbmm` on a stack (1670-1701); the result is copied into a buffer of the
      param's dtype (1646);
    - `P.mul_(1 - lr*wd)`, `P.add_(O, alpha=-lr * sqrt(max(1, fo/fi)))` with fo, fi from the global compute shape
      (1591-1606, 1650-1667): preset `torch`.
    Layout: DTensor params only (TypeError otherwise, 358-368). A 2-D param is gathered whole to an owner rank
    (ComputeLayout Owned(): LPT over NS cost, 982-1077), a 3-D expert stack is orthogonalised where its Shard(0)
    boxes lie (Shard(0) compute; batched baddbmm on the local experts).
    As shipped it runs on CUDA only: `_validate_parameter_storage` raises "DistMuon requires one CUDA device per
    process" (dist_muon.py:366-367)."""

    name, preset, distributed = "torchtitan DistMuon", "torch", "dtensor"
    families = DIST_FAMILIES

    def version(self) -> str:
        return package_version("torchtitan")

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        from torch.distributed.tensor import Shard
        from torchtitan.distributed.flex_shard import (
            BucketConfig,
            ComputeLayout,
            Owned,
            build_dist_muon,
        )

        names = [f"p{i}" for i in range(len(params))]
        # the mesh axis is named "fsdp" by the conformance workers (muon_check/adapters/workers.py)
        layouts = {
            n: ComputeLayout({"fsdp": Owned() if p.ndim == 2 else Shard(0)})
            for n, p in zip(names, params)
        }
        return build_dist_muon(
            [{"params": params, "param_names": names}],
            compute_sharding_by_fqn=layouts,
            bucket_configs=[BucketConfig(patterns=("*",))],
            **hp,
        )


class TorchtitanDistMuonOnCpu(TorchtitanDistMuon):
    """torchtitan's DistMuon with two CPU patches, stated: its device check accepts CPU tensors, and its
    communication context makes a `torch.cpu.Stream()` (the CUDA-style `Stream(device=..., priority=0)` of
    _optimizer_reshard_runtime.py:267 is a TypeError on torch.cpu). CPU streams are no-ops and its collectives
    are blocking all_to_all_single calls (_optimizer_reshard_runtime.py:103-120), so the math is unchanged."""

    name = "torchtitan DistMuon (CPU patch)"

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        _patch_torchtitan_for_cpu()
        return super().build(params, **hp)


def _patch_torchtitan_for_cpu() -> None:
    """The two CPU patches of TorchtitanDistMuonOnCpu, once per process (a rank of the conformance pool)."""
    from torchtitan.distributed.flex_shard import _optimizer_reshard_runtime as runtime
    from torchtitan.distributed.flex_shard import dist_muon

    if getattr(dist_muon, "_conformance_on_cpu", False):
        return
    cuda_only = dist_muon.DistMuon._validate_parameter_storage

    def storage_device(opt: Any) -> torch.device:
        try:
            return cuda_only(opt)
        except ValueError:
            if {p.to_local().device.type for g in opt.param_groups for p in g["params"]} != {"cpu"}:
                raise
            return torch.device("cpu")

    def cpu_context(cls: type, device: torch.device) -> Any:
        def slot() -> Any:
            return runtime._PipelineSlot(
                runtime._BufferSlot(), torch.cpu.Event(), torch.cpu.Event(), torch.cpu.Event()
            )

        return cls(
            device_handle=torch.cpu,
            transfer_stream=torch.cpu.Stream(),
            slots=tuple(slot() for _ in range(runtime._NUM_PIPELINE_SLOTS)),
        )

    dist_muon.DistMuon._validate_parameter_storage = storage_device
    runtime._CommunicationContext.create = classmethod(cpu_context)
    dist_muon._conformance_on_cpu = True


class DionMuon(Adapter):
    """microsoft/dion `dion.Muon` from a checkout (checked at 0a059a4; dion/muon.py, dion/megabatch_base.py,
    dion/polar_express.py), run eagerly:
    - sum momentum `M *= mu; M += G`, Nesterov `U = M*mu; U += G` with mu a 0-dim fp32 tensor (muon.py:131,
      298-306); U cast to bf16 before NS (309);
    - NS: Polar Express (default use_polar_express=True, megabatch_base.py:102), `X / (norm*1.02 + epsilon)` with the
      group's epsilon (1e-8), five modded-nanogpt steps in Dion's form `b*A + c*(A@A)`, `a*X + B@X`; a tall matrix
      is not transposed but iterated as `A = X.mT @ X`, `X = a*X + X @ B` (polar_express.py:19-50);
    - `X *= 1 - lr*wd`, `X -= U * (lr * sqrt(fo/fi))` (muon.py:343-347, megabatch_base.py:995-1002) with lr a 0-dim
      fp32 tensor (megabatch_base.py:450-501): preset `dion` with schedule `polar_express_modded`.
    Layout: plain tensors (no mesh) or DTensors on a 1-D mesh; every same-shape param of a group in one batch
    (muon.py:144-191): Shard(0) matrices padded to ceil(rows / W) rows per rank and all-to-all'd, NS on the padded
    matrix (megabatch_base.py:704-834); 3-D stacks sharded on dim 0 are orthogonalised locally. 4-D params are
    flattened (group option flatten). Momentum in state["momentum"].
    The checkout is `checkout`, else $MUON_DION_CHECKOUT; `make test` never depends on it."""

    name, preset, distributed = "dion.Muon (eager)", "dion", "dtensor"
    overrides = {"schedule": "polar_express_modded"}
    families = SINGLE_FAMILIES | DIST_FAMILIES
    state_key = "momentum"

    def __init__(self, checkout: str | None = None) -> None:
        self.checkout = checkout or self.checkout_from_environment()

    @staticmethod
    def checkout_from_environment() -> str | None:
        return os.environ.get(DION_CHECKOUT_ENV) or None

    def version(self) -> str:
        """The checkout's commit when it is a git clone of its own (not a folder inside another repository)."""
        if not self.checkout:
            return "no checkout"
        if not os.path.exists(os.path.join(self.checkout, ".git")):
            return "checkout (no git metadata)"
        git = subprocess.run(
            ["git", "-C", self.checkout, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
        )
        return (
            f"checkout {git.stdout.strip()}"
            if git.returncode == 0
            else "checkout (no git metadata)"
        )

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        if not self.checkout or not os.path.isdir(os.path.join(self.checkout, "dion")):
            raise ValueError(
                f"no Dion checkout: pass DionMuon(checkout=...) or set ${DION_CHECKOUT_ENV} to the folder "
                f"holding the dion package (got {self.checkout!r})"
            )
        if self.checkout not in sys.path:
            sys.path.insert(0, self.checkout)
        _run_eagerly()
        import dion

        mesh = getattr(params[0], "device_mesh", None)
        renamed = {"mu" if k == "momentum" else k: v for k, v in hp.items()}
        return dion.Muon(
            [{"params": params, "flatten": params[0].ndim >= 4}], distributed_mesh=mesh, **renamed
        )


class GramNewtonSchulzMuon(Adapter):
    """gram-newton-schulz 0.1.6 `Muon` (gram_newton_schulz/muon/muon.py), single device, its torch-ops path
    (`ns_use_kernels=False`: the default True imports quack's CUDA kernels, gram_newton_schulz.py:18-25, 145), eager:
    - sum momentum `_foreach_mul_(M, mu); _foreach_add_(M, G)`, Nesterov `U = _foreach_mul(M, mu); U += G` with mu a
      Python float (muon_opt_utils.py:43-50); U cast to bf16 (53);
    - NS on a stack of every same-shape matrix (muon.py:329-339): U to fp32, `X / (norm + 1e-7)` in fp32, then fp16
      (gram_newton_schulz.py:35-37, 84-86), Polar Express coefficients / 1.05 (coefficients.py:17-28, muon_ref
      `polar_express_dao`); square matrices take standard NS in `baddbmm` form (a tall one is iterated as
      `X.mT @ X`, `baddbmm(X, X, B)`), non-square ones Gram NS with a restart after step 2 (the restart found by
      its auto-tuner at construction; gram_newton_schulz.py:33-71, 193-196); the result cast to U's dtype (bf16);
    - `O.mul_(lr * 0.2 * sqrt(max(fo, fi)))` (default adjust_lr "rms_norm", muon_matrix_split_utils.py:80),
      `P.mul_(1 - lr*wd)`, `P.sub_(O)` (muon_opt_utils.py:73-78).
    No muon_ref option expresses three of these (README): the NS input normalised in fp32 after a bf16 rounding,
    Gram NS, and (bf16 params, eager on CPU) the in-place `_foreach_mul_` that rounds mu to bf16. The claim below
    is the rest; 4-D params are outside its contract (2-D or 3-D, muon.py:261-263). Momentum in state["momentum"]."""

    name, preset = "gram_newton_schulz.Muon (torch ops, eager)", None
    overrides = {
        "momentum_style": "sum",
        "nesterov_form": "mul_add",
        "weight_decay_form": "mul",
        "lr_scale": "match_rms_adamw",
        "scale_sqrt": "sqrt",
        "scale_apply": "update_lr",
        "update_dtype": torch.bfloat16,
        "schedule": "polar_express_dao",
        "eps": 1e-7,
        "eps_mode": "add",
        "ns_dtype": torch.float16,
        "step_form": "addmm",
        "normalize_before_cast": True,
    }
    families = SINGLE_FAMILIES - {"conv4d"}
    state_key = "momentum"

    def version(self) -> str:
        return package_version("gram-newton-schulz")

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        _run_eagerly()
        import gram_newton_schulz

        return gram_newton_schulz.Muon(params, ns_use_kernels=False, **hp)


__all__ = [
    "DION_CHECKOUT_ENV",
    "DionMuon",
    "GramNewtonSchulzMuon",
    "TorchtitanDistMuon",
    "TorchtitanDistMuonOnCpu",
]
