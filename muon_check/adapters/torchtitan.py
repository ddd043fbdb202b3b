"""torchtitan's DistributedMuon (FlexShard), from a checkout of pytorch/torchtitan named by
$MUON_TORCHTITAN_CHECKOUT (the folder holding `torchtitan`). The class was added by pytorch/torchtitan PR 4060
(merge commit bb90ff9c23c95f966d0d584a3ccb7b5448286def) and renamed `DistMuon` by PR 4155; this adapter runs the
PR 4060 code (`torchtitan/distributed/flex_shard/distributed_muon.py`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from .cases import DIST_FAMILIES
from .systems import FromCheckout, import_without_package_inits

TORCHTITAN_CHECKOUT_ENV = "MUON_TORCHTITAN_CHECKOUT"
MODULE = "torchtitan.distributed.flex_shard.distributed_muon"
MODULE_PATH = "torchtitan/distributed/flex_shard/distributed_muon.py"


@contextlib.contextmanager
def _cpu_shim(muon: Any, params: list[Tensor]) -> Iterator[None]:
    """The stated CPU shim, for the construction only and only when every local tensor is on the CPU (nothing
    changes for `--device cuda`): `DistributedMuon._validate_parameter_storage` accepts one CPU device where it
    raises "requires one CUDA device per process" (distributed_muon.py:390-391), and `torch.cpu.Stream` takes
    the `device` keyword that `_CommunicationContext.create` passes (`Stream(device=device, priority=0)`,
    _optimizer_reshard_runtime.py:267). torch.cpu's streams and events are no-ops and CPU kernels run in
    program order, so the stream handoffs have nothing to order; no arithmetic is touched."""
    local = {(p.to_local() if hasattr(p, "to_local") else p).device.type for p in params}
    if local != {"cpu"}:
        yield
        return
    cls = muon.DistributedMuon
    validate = cls._validate_parameter_storage
    cpu_stream = torch.cpu.Stream

    def one_cpu_device(self: Any) -> torch.device:
        try:
            return validate(self)
        except ValueError as e:
            if "one CUDA device" not in str(e):
                raise
            return torch.device("cpu")

    class Stream(cpu_stream):  # type: ignore[misc, valid-type]
        def __init__(self, device: Any = None, priority: int = -1) -> None:
            super().__init__(priority)

    cls._validate_parameter_storage = one_cpu_device
    torch.cpu.Stream = Stream
    try:
        yield
    finally:
        cls._validate_parameter_storage = validate
        torch.cpu.Stream = cpu_stream


class TorchtitanDistributedMuon(FromCheckout):
    """torchtitan's `DistributedMuon` from a checkout of pytorch/torchtitan at PR 4060's merge commit bb90ff9c
    (`torchtitan/distributed/flex_shard/distributed_muon.py` with `_optimizer_reshard_runtime.py`,
    `_optimizer_reshard_schedule.py`, `optimizer_reshard.py` beside it), built as torchtitan's Kimi K2.7 /
    Kimi-VL / Moonlight recipes build it (`_distributed_muon_optimizer`, models/kimi_k2_7/config_registry.py:202-368,
    through OptimizersContainer, components/optimizer.py:145 and 225-229):
        build_distributed_muon([{"params": ..., "param_names": ..., "fused": False, "foreach": False, "lr": lr,
            "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}], compute_sharding_by_fqn=..., bucket_configs=...)
    with the class's defaults for the rest (distributed_muon.py:301-313: momentum 0.95, nesterov True, Keller's
    coefficients, 5 steps, eps 1e-7).
    - EMA momentum `buf.lerp_(g, 1 - mu)` on the storage shard, Nesterov `torch.lerp(g, buf, mu)` (1441-1448);
    - NS (1493-1524): a bf16 copy, transposed when rows > cols, `/ norm(dim=(-2, -1)).clamp_min(eps)`, `addmm` steps
      (`baddbmm` on a 3-D batch), the result copied to the param's dtype;
    - `p.mul_(1 - lr*wd)`, `p.add_(O, alpha=-lr * 0.2 * sqrt(max(A, B)))` with (A, B) the last two dims of the
      global compute shape (1414-1427, 1488-1489): preset `torch` with lr_scale "match_rms_adamw" (the class's own
      default adjust_lr_fn None is preset `torch` unchanged).
    Routing in the recipe (config_registry.py:333-358): attention, dense and shared-expert MLP, routed-expert stack
    and router-gate matrices to DistributedMuon, the rest to AdamW.
    Layout: DTensor params only (distributed_muon.py:387); the harness's 1-D FSDP axis stands for dp_shard. A 2-D
    param gets `Owned()` on it (the recipe's dense matrices: the whole matrix is all-to-all'd
    (`all_to_all_single`, _optimizer_reshard_runtime.py:114) to one balanced owner rank, orthogonalised there and
    sent back); a 3-D expert stack gets `Shard(0)` (the recipe's per_expert layout: each rank orthogonalises the
    experts of its own box, batched). One bucket holds every param; FQNs are the harness module's ("params.<i>").
    On CPU a stated shim (`_cpu_shim`) lets the CUDA-only construction through: the device check at
    distributed_muon.py:390-391 accepts one CPU device and torch.cpu.Stream takes a `device` keyword
    (_optimizer_reshard_runtime.py:267); torch.cpu's streams and events are no-ops and no arithmetic is touched.
    With `--device cuda` the code runs unshimmed. The module is imported with its parent packages bare
    (`import_without_package_inits`: torchtitan/__init__.py and torchtitan/distributed/__init__.py pull in the
    trainer stack). The checkout is `checkout`, else $MUON_TORCHTITAN_CHECKOUT."""

    name, preset, distributed = "torchtitan DistributedMuon (PR 4060)", "torch", "dtensor"
    overrides = {"lr_scale": "match_rms_adamw"}
    families = DIST_FAMILIES
    checkout_env = TORCHTITAN_CHECKOUT_ENV
    adjust_lr_fn: str | None = "match_rms_adamw"

    def module(self) -> Any:
        root = self.root(MODULE_PATH)
        return import_without_package_inits(root, MODULE)

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        muon = self.module()
        from torch.distributed.tensor import Shard

        names = [f"params.{i}" for i in range(len(params))]
        sharding = {}
        for name, p in zip(names, params):
            mesh = getattr(p, "device_mesh", None)
            axis = (
                mesh.mesh_dim_names[-1] if mesh is not None and mesh.mesh_dim_names else "dp_shard"
            )
            placement = Shard(0) if p.ndim == 3 else muon.Owned()
            sharding[name] = muon.MuonComputeShardingConfig(
                compute_layout=muon.ComputeLayout(shardings_by_mesh_axis={axis: placement})
            )
        group = {
            "params": params,
            "param_names": names,
            "fused": False,
            "foreach": False,
            "weight_decay": 0.1,
            "adjust_lr_fn": self.adjust_lr_fn,
            **hp,
        }
        with _cpu_shim(muon, params):
            return muon.build_distributed_muon(
                [group],
                compute_sharding_by_fqn=sharding,
                bucket_configs=[muon.BucketConfig(patterns=("params.*",), name="params")],
            )


class TorchtitanDistributedMuonDefaults(TorchtitanDistributedMuon):
    """TorchtitanDistributedMuon with the class's own default adjust_lr_fn None (distributed_muon.py:312:
    torch's "original" scale, sqrt(max(1, A / B))), as a caller of `build_distributed_muon` outside the Kimi
    recipes gets it: preset `torch` unchanged."""

    name = "torchtitan DistributedMuon (PR 4060, class defaults)"
    overrides: dict[str, Any] = {}
    adjust_lr_fn = None


__all__ = [
    "TORCHTITAN_CHECKOUT_ENV",
    "TorchtitanDistributedMuon",
    "TorchtitanDistributedMuonDefaults",
]
