"""Megatron-core's `LayerWiseDistributedOptimizer` (`megatron/core/optimizer/layer_wise_optimizer.py`, the
distributed Muon that `--optimizer muon --use-distributed-optimizer` selects) built by megatron-core's own
`get_megatron_optimizer` and run on gloo ranks on CPU. Like the Megatron rows in systems.py, it runs megatron-core
0.19.2 and Emerging-Optimizers 0.3.0 from the folder `make field` unpacks them into ($MUON_MEGATRON_PATH); no
Megatron code is copied here."""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import torch
from torch import Tensor

from . import Adapter
from .cases import MATRIX_FAMILIES
from .systems import (
    MEGATRON_PATH_ENV,
    MegatronTensorParallelMuon,
    _emerging_on_python_311,
    checkout_path,
    import_without_package_inits,
)

# The attention shape `_muon_config_to_kwargs` reads from the first model chunk's TransformerConfig for every muon
# build (emerging_optimizers.py:439, `_get_qkv_split_shapes`); it only splits params tagged `is_qkv`, which
# Megatron sets on params named `linear_qkv.weight` alone (optimizer/__init__.py:785-790): none here.
QKV_SHAPE = types.SimpleNamespace(num_attention_heads=1, num_query_groups=1, kv_channels=1)


class _LayerWiseStep(torch.optim.Optimizer):
    """A built LayerWiseDistributedOptimizer driven as the check drives an optimizer. `megatron_step`: Megatron's
    own `step()` (ChainedOptimizer.step: prepare_grads, grad norm, clipping, step_with_ready_grads). Otherwise the
    stated shim: each chained optimizer's `step()`, then LayerWise's `allgather_params()`: what
    `LayerWiseDistributedOptimizer.step_with_ready_grads` runs on the legacy layout (layer_wise_optimizer.py:882-911)
    when its children are Megatron-wrapped (their `step_with_ready_grads` is `self.optimizer.step()`,
    optimizer.py:786 and 1296), without the gradient copy from DDP's `main_grad` (no DDP here: p.grad is the
    reduced gradient) and without clipping."""

    def __init__(self, inner: Any, params: list[Tensor], megatron_step: bool) -> None:
        super().__init__(params, {})
        self.inner, self.megatron_step = inner, megatron_step

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if self.megatron_step:
            self.inner.step()
            return
        for child in self.inner.chained_optimizers:
            child.step()
        self.inner.allgather_params()


class MegatronLayerWiseMuon(Adapter):
    """Megatron-core 0.19.2's `LayerWiseDistributedOptimizer` over its `TensorParallelMuon` (Emerging-Optimizers
    0.3.0), the optimizer `--optimizer muon --use-distributed-optimizer` selects (megatron/training/arguments.py:
    1669-1681 turn the flag into `use_layer_wise_distributed_optimizer`). Built as Megatron builds it:
    `get_megatron_optimizer(OptimizerConfig(optimizer="muon", use_layer_wise_distributed_optimizer=True, lr,
    weight_decay, muon_momentum, muon_nesterov, clip_grad=0.0), [chunk], pg_collection=ProcessGroupCollection(
    dp_cp=<the ranks' default group>))`: its own param groups, the muon kwargs from the config
    (`_muon_config_to_kwargs`: "quintic", 5 steps, scale "spectral", fp32_matmul_prec "medium", decoupled weight
    decay), the raw TensorParallelMuon handed to LayerWise (optimizer/__init__.py:891-893, 972-978). The chunk is
    a torch Module holding the check's params with `config` giving the attention shape the muon kwargs read
    (QKV_SHAPE); it has no `ddp_config`, so LayerWise takes its legacy layout (the one
    `--no-use-layer-wise-param-layout` selects; the default layout needs Megatron's DistributedDataParallel grad
    buffers): `_shard_params_ping_pong` deals whole params, sorted by numel, to the data-parallel ranks 0..W-1,
    W-1..0, ...; each rank steps its own and `allgather_params` all-gathers them (list-form `all_gather` of each
    rank's flattened params, buffers of each rank's own size) and copies them into the other ranks' params.
    `distributed = "replicated"`: DDP all-reduces before the step, so every rank holds the full reduced gradient.
    Keys away from the defaults: `clip_grad` 0.0 (default 1.0 clips by the global norm before the step), and the
    check's lr, weight_decay, momentum (`muon_momentum`, default 0.95), Nesterov (`muon_nesterov`, default False).
    Stated shim for the step (`_LayerWiseStep`): with bf16 off, LayerWise's children stay raw torch optimizers
    (it wraps them only `if config.bf16`, layer_wise_optimizer.py:505-516; that wrapper is CUDA-only, optimizer.py:
    698-702, 1009-1037), and Megatron's `step()` calls `prepare_grads()` on them, which they lack (optimizer.py:
    1631): `MegatronLayerWiseMuonStep` runs that step. Claim: preset `emerging` (0.3.0's NS eps 1e-7): each owner
    runs TensorParallelMuon's non-TP path (no `partition_dim`: `newton_schulz`, muon_utils.py:263-265), as the
    TensorParallelMuon row does on one device; the other ranks receive its bits. float32 only (Emerging's NS
    raises on other dtypes). 2-D params only: Megatron routes the others to Adam (emerging_optimizers.py:128-130);
    the checkpoint families are not run (Megatron checkpoints through its own `sharded_state_dict`)."""

    name, preset, distributed = (
        "megatron-core LayerWiseDistributedOptimizer (Muon)",
        "emerging",
        "replicated",
    )
    families = MATRIX_FAMILIES | {
        "micro_batches",
        "nesterov_off",
        "badly_scaled",
        "even",
        "remainder",
        "mixed",
        "asym_none",
        "accumulation",
    }
    dtypes = ("float32",)
    state_key = "momentum_buffer"
    megatron_step = False

    def __init__(self, path: str | None = None) -> None:
        self.path = path or os.environ.get(MEGATRON_PATH_ENV) or None

    version = MegatronTensorParallelMuon.version

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        import torch.distributed as dist

        path = checkout_path(MEGATRON_PATH_ENV, self.path, "megatron/core/optimizer")
        _emerging_on_python_311(path)
        # process_groups_config first: importing megatron.core.optimizer first reaches megatron.core.utils and
        # parallel_state in a circular order
        import_without_package_inits(
            path, "megatron.core.process_groups_config", "megatron.core.optimizer"
        )
        megatron_optimizer = sys.modules["megatron.core.optimizer"]
        collection = sys.modules["megatron.core.process_groups_config"].ProcessGroupCollection
        if not dist.is_initialized():
            raise RuntimeError(
                "Megatron builds its optimizers under torch.distributed (param groups are aligned with "
                "all_gather_object): run on the check's ranks"
            )
        chunk = torch.nn.Module()
        for i, p in enumerate(params):
            chunk.register_parameter(f"weight{i}", p)
        chunk.config = QKV_SHAPE
        names = {"lr": "lr", "weight_decay": "weight_decay", "momentum": "muon_momentum"}
        names["nesterov"] = "muon_nesterov"
        config = megatron_optimizer.OptimizerConfig(
            optimizer="muon",
            use_layer_wise_distributed_optimizer=True,
            clip_grad=0.0,
            **{names[k]: v for k, v in hp.items()},
        )
        inner = megatron_optimizer.get_megatron_optimizer(
            config, [chunk], pg_collection=collection(dp_cp=dist.group.WORLD)
        )
        return _LayerWiseStep(inner, params, self.megatron_step)

    def momentum(self, opt: torch.optim.Optimizer, p: Tensor) -> Tensor | None:
        """p's momentum on the rank that owns p (None on the others: they hold no state for it)."""
        for child in opt.inner.chained_optimizers:
            buf = child.state.get(p, {}).get("momentum_buffer")
            if buf is not None:
                return buf.reshape(p.shape)
        return None


class MegatronLayerWiseMuonStep(MegatronLayerWiseMuon):
    """MegatronLayerWiseMuon stepped with Megatron's own `optimizer.step()` (what its training loop calls):
    `ChainedOptimizer.step` -> `prepare_grads()` on each chained optimizer (optimizer.py:1627-1633), which with bf16
    off are the raw TensorParallelMuons (layer_wise_optimizer.py:505-516 wraps them only for bf16)."""

    name = "megatron-core LayerWiseDistributedOptimizer (Muon), Megatron's step()"
    megatron_step = True


__all__ = ["MegatronLayerWiseMuon", "MegatronLayerWiseMuonStep"]
