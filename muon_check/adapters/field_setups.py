"""Field systems as training setups (audit.py, invariance.py): each system's own code builds the optimizer from
the model and a configuration, under its shipped defaults unless a row of docs/field-systems.md states a key and why.

    DeepSpeedSetup   deepspeed.initialize(model, config) with {"optimizer": {"type": "Muon"}}: the engine tags
                     each param (deepspeed/__init__.py `set_optimizer_flags`: a matrix by its layer shape, not
                     "embed" or "lm_head" in its name, goes to Muon) and steps MuonWithAuxAdam, under ZeRO stage
                     0 (the default), 1, 2 or 3 (`sharding` "zero0".."zero3"); `gradient_accumulation_steps` from the
                     audit's micro-batches. Variants: DeepSpeedSetupNoClip ("gradient_clipping": 0.0),
                     DeepSpeedSetupStandardNS (also "ns_method": "standard"), DeepSpeedSetupBf16 (no clip, bf16),
                     DeepSpeedSetupDocExample (its documentation's Muon example, as written, ZeRO-3) and
                     DeepSpeedSetupDocExampleNoReduceScatter (with the key stage 3 requires).
    LlamaFactorySetup, LlamaFactoryZero3Setup   its `_create_muon_optimizer` under DDP and under DeepSpeed ZeRO-3
    LlamaFactoryV1Setup   its v1 trainer's `create_muon_optimizer` with its documented example config, FSDP2
    VeomniSetup      its `build_optimizer(model, optimizer_type="muon")` on FSDP2 or HSDP

Run in the field venv (`make field`): DeepSpeed is not a dependency of this package. The CPU accelerator's
shared-memory all-reduce (a C++ op DeepSpeed would JIT-compile) is marked incompatible, so its collectives go
through torch.distributed (gloo), and its compiled kernels run eagerly (torch.compiler "force_eager"), as in
systems.py's DeepSpeedMuon.
"""

from __future__ import annotations

import os
from typing import Any

from torch import Tensor, nn

from ..audit import Setup
from .systems import (
    LLAMAFACTORY_CHECKOUT_ENV,
    checkout_path,
    deepspeed_on_cpu,
    import_without_package_inits,
    package_from_checkout,
)

ZERO_STAGES = ("zero0", "zero1", "zero2", "zero3")


class DeepSpeedSetup(Setup):
    """DeepSpeed 0.19.8 as a user configures it: the config is `{"train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": k, "optimizer": {"type": "Muon"}}` plus ZeRO's stage (and, at stage 3, the
    `"reduce_scatter": false` that stage3.py:361 requires with Muon). Its defaults: lr and momentum of
    MuonWithAuxAdam, `ns_method` "gram", `gradient_clipping` 1.0 (a global-norm clip before the optimizer).

    Claim: DeepSpeed's rule (every matrix whose name has no "embed" or "lm_head", each whole, an expert stack
    per expert); path not claimed. The engine reduces each rank's gradient (each rank gets its own), and divides
    the loss by the accumulation steps itself (the probe is multiplied back by k). Routes are read from the
    engine's tags (`use_muon`): under ZeRO its optimizer holds flat copies of the params."""

    name = "DeepSpeed Muon (shipped config)"
    sharding, path = "zero0", None
    layouts = False
    adamw_patterns = ("*embed*", "*lm_head*")
    shardings = ZERO_STAGES
    extra: dict[str, Any] = {}
    optimizer_params: dict[str, Any] = {}
    zero_extra: dict[str, Any] = {}  # more keys of "zero_optimization"
    reduce_scatter_off = True  # at stage 3, the `"reduce_scatter": false` stage3.py:361 requires

    def shard(self, model: nn.Module, world_size: int) -> nn.Module:
        return model

    def config(self) -> dict[str, Any]:
        stage = int(str(self.sharding).removeprefix("zero"))
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": self.micro_batches,
            "optimizer": {"type": "Muon", "params": dict(self.optimizer_params)},
            **self.extra,
        }
        if stage:
            config["zero_optimization"] = {"stage": stage, **self.zero_extra}
        if stage == 3 and self.reduce_scatter_off:
            config["zero_optimization"]["reduce_scatter"] = False
        return config

    def build(self, model: nn.Module) -> list[Any]:
        deepspeed_on_cpu()
        import deepspeed

        self.engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=model.parameters(),
            config=self.config(),
            dist_init_required=False,
        )
        return [self.engine.optimizer]

    def route(self, name: str, p: Tensor, optimizers: list[Any]) -> tuple | None:
        if not hasattr(p, "use_muon"):
            return None
        muon = bool(p.use_muon)
        return (0, "MuonWithAuxAdam", 0 if muon else 1, f"use_muon={muon}", muon)

    def held(self, p: Tensor) -> Tensor:
        return getattr(p, "ds_tensor", p)

    def full(self, model: nn.Module) -> dict[str, Tensor]:
        params = dict(model.named_parameters())
        if any(hasattr(p, "ds_tensor") for p in params.values()):
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(params.values())):
                return {n: p.detach().clone() for n, p in params.items()}
        return {n: p.detach().clone() for n, p in params.items()}

    def train_step(self, model: nn.Module, optimizers: list[Any], probes: list[dict]) -> None:
        k = len(probes)
        for probe in probes:
            loss = self.engine(probe={n: g * k for n, g in probe.items()})
            self.engine.backward(loss)
            self.engine.step()


class DeepSpeedSetupNoClip(DeepSpeedSetup):
    """The shipped config with `"gradient_clipping": 0.0`: a global-norm clip sums squares in an order that
    depends on the layout, so its coefficient (and every update after it) may differ in the last bits between
    ZeRO stages and world sizes; without it the invariance contract is bitwise."""

    name = "DeepSpeed Muon (gradient_clipping 0)"
    extra = {"gradient_clipping": 0.0}


class DeepSpeedSetupDocExample(DeepSpeedSetup):
    """The Muon example of DeepSpeed's configuration reference (https://www.deepspeed.ai/docs/config-json/,
    "Example of optimizer with Muon"; the page's source at deepspeedai/DeepSpeed edaa7221267243c7), as written:
    `{"optimizer": {"type": "Muon", "params": {"lr": 0.001, "momentum": 0.9, "weight_decay": 0.0, "muon_lr":
    0.001, "ns_method": "gram"}}, "zero_optimization": {"stage": 3, "save_muon_momentum_buffer_in_memory":
    true}}`, with the audit's batch keys. It names no `reduce_scatter`, whose default is true (zero/config.py),
    and stage 3 refuses Muon with it (stage3.py:361)."""

    name = "DeepSpeed Muon (config-json example, as written)"
    sharding = "zero3"
    shardings = ("zero3",)
    optimizer_params = {
        "lr": 0.001,
        "momentum": 0.9,
        "weight_decay": 0.0,
        "muon_lr": 0.001,
        "ns_method": "gram",
    }
    zero_extra = {"save_muon_momentum_buffer_in_memory": True}
    reduce_scatter_off = False


class DeepSpeedSetupDocExampleNoReduceScatter(DeepSpeedSetupDocExample):
    """The config-json example with the one key stage 3 requires for Muon, `"reduce_scatter": false`; everything
    else as written (so `gradient_clipping` keeps its default 1.0 and `ns_method` is "gram")."""

    name = "DeepSpeed Muon (config-json example, reduce_scatter false)"
    reduce_scatter_off = True


class DeepSpeedSetupStandardNS(DeepSpeedSetupNoClip):
    """Also `"ns_method": "standard"` (Keller's Newton-Schulz) in place of the default Gram Newton-Schulz."""

    name = "DeepSpeed Muon (gradient_clipping 0, ns_method standard)"
    optimizer_params = {"ns_method": "standard"}


def _create_muon_optimizer(model: nn.Module, args: Any) -> Any:
    """LlamaFactory's own builder. LlamaFactory 0.9.5 pins transformers <= 5.6.0 at import; the field venv has
    5.9.0 (VeOmni's), and LlamaFactory's own switch DISABLE_VERSION_CHECK=1 lets it import (a stated setting)."""
    os.environ.setdefault("DISABLE_VERSION_CHECK", "1")
    from llamafactory.train.trainer_utils import _create_muon_optimizer as create

    return create(model, args)


def _llamafactory_args() -> Any:
    """transformers.TrainingArguments' field defaults (lr 5e-5, weight decay 0, Adam betas and eps), as a
    LlamaFactory run that names none of them gets: read from the dataclass's fields (an instance would set up
    its accelerator's devices, which the check's ranks already are)."""
    import dataclasses
    from types import SimpleNamespace

    from transformers import TrainingArguments

    return SimpleNamespace(
        **{
            f.name: f.default
            for f in dataclasses.fields(TrainingArguments)
            if f.default is not dataclasses.MISSING
        }
    )


def _llamafactory_route(p: Tensor, optimizers: list[Any]) -> tuple | None:
    """LlamaFactory's Muon keeps its routing in its state (`state[p]["use_muon"]`), every param in one group."""
    for o, opt in enumerate(optimizers):
        for g, group in enumerate(opt.param_groups):
            if any(q is p for q in group["params"]):
                muon = bool(opt.state[p].get("use_muon", False))
                return (o, type(opt).__name__, g, f"state use_muon={muon}", muon)
    return None


class LlamaFactorySetup(Setup):
    """LlamaFactory 0.9.5 (PyPI) with `use_muon: true`: its own builder `_create_muon_optimizer(model,
    training_args)` (llamafactory/train/trainer_utils.py:498-524) under transformers' Trainer on several GPUs,
    DistributedDataParallel, at TrainingArguments' defaults. Its rule (line 508): a param goes to Muon iff
    `param.ndim == 2` and "embed" and "lm_head" are not in its name; the claim restates that rule (a 3-D expert
    stack goes to its AdamW by that rule: claimed, not a fallback), each matrix whole."""

    name = "LlamaFactory _create_muon_optimizer + DDP"
    sharding, path = "ddp", "replicated"
    layouts = False
    shardings = ("ddp",)

    def claimed(self) -> dict[str, dict[str, Any] | None]:
        from ..model import shapes

        return {
            n: {} if len(s) == 2 and "embed" not in n and "lm_head" not in n else None
            for n, s in shapes().items()
        }

    def build(self, model: nn.Module) -> Any:
        return _create_muon_optimizer(getattr(model, "module", model), _llamafactory_args())

    def route(self, name: str, p: Tensor, optimizers: list[Any]) -> tuple | None:
        return _llamafactory_route(p, optimizers)


class LlamaFactoryZero3Setup(LlamaFactorySetup):
    """The same builder under DeepSpeed ZeRO-3, as transformers' Trainer runs it (hiyouga/LlamaFactory#8041): the
    model's params partitioned first (`deepspeed.zero.Init(module=model)`, what `from_pretrained` does under a
    ZeRO-3 config), then `_create_muon_optimizer(model, args)` (the Trainer's `create_optimizer`), then
    `deepspeed.initialize(model, optimizer=it, config)` with ZeRO stage 3 and `zero_allow_untested_optimizer`
    (the Trainer's integration sets it for a client optimizer). Claim: LlamaFactory's rule on the layer shapes."""

    name = "LlamaFactory _create_muon_optimizer + DeepSpeed ZeRO-3"
    sharding, path = "zero3", None
    shardings = ("zero3",)

    def config(self) -> dict[str, Any]:
        return {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": self.micro_batches,
            "zero_optimization": {"stage": 3},
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0,
        }

    def shard(self, model: nn.Module, world_size: int) -> nn.Module:
        deepspeed_on_cpu()
        import deepspeed

        deepspeed.zero.Init(module=model, config_dict_or_path=self.config())
        return model

    def build(self, model: nn.Module) -> list[Any]:
        import deepspeed

        self.client = _create_muon_optimizer(model, _llamafactory_args())
        # ZeRO-3 replaces the client optimizer's params by flat partitions: its routing is read here
        self.at_construction = {
            id(p): bool(self.client.state[p].get("use_muon", False))
            for g in self.client.param_groups
            for p in g["params"]
        }
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=self.client, config=self.config(), dist_init_required=False
        )
        return [self.client]

    def route(self, name: str, p: Tensor, optimizers: list[Any]) -> tuple | None:
        if id(p) not in self.at_construction:
            return None
        muon = self.at_construction[id(p)]
        return (0, type(self.client).__name__, 0, f"state use_muon={muon}, at construction", muon)

    held = DeepSpeedSetup.held
    full = DeepSpeedSetup.full
    train_step = DeepSpeedSetup.train_step


class LlamaFactoryV1Setup(Setup):
    """LlamaFactory's v1 trainer with its documented Muon example, examples/v1/train_full/train_full_muon.yaml of
    the checkout ($MUON_LLAMAFACTORY_CHECKOUT, read from the checkout, not restated): `optim_config` {name: muon,
    wd 0.1, momentum 0.95, nesterov true, ns_steps 5, adamw betas and eps}, `learning_rate` 1e-5 put into
    `optim_config["lr"]` as the trainer does (config/training_args.py), `dist_config: fsdp2`. Built by its own
    plugin `create_muon_optimizer(model, optim_config)` (plugins/trainer_plugins/optimizers/optimizer.py, imported
    with its parent packages bare). Claim: its rule (a 2-D param whose name holds none of embed, lm_head, wte,
    wpe, lora goes to Muon; a 3-D stack to its AdamW by that rule), each matrix whole, and its stated path:
    every rank gathers the full gradient (`full_tensor`) and orthogonalises it ("replicated")."""

    name = "LlamaFactory v1 create_muon_optimizer (train_full_muon.yaml)"
    sharding, path = "fsdp2", "replicated"
    layouts = False
    shardings = ("fsdp2",)
    example = "examples/v1/train_full/train_full_muon.yaml"

    def claimed(self) -> dict[str, dict[str, Any] | None]:
        from ..model import shapes

        skip = ("embed", "lm_head", "wte", "wpe", "lora")
        return {
            n: {} if len(s) == 2 and not any(k in n for k in skip) else None
            for n, s in shapes().items()
        }

    def build(self, model: nn.Module) -> Any:
        import yaml

        root = checkout_path(LLAMAFACTORY_CHECKOUT_ENV, None, self.example)
        with open(os.path.join(root, self.example)) as f:
            example = yaml.safe_load(f)
        src = os.path.join(root, "src")
        with package_from_checkout(src, "llamafactory"):
            arg_utils = import_without_package_inits(src, "llamafactory.v1.config.arg_utils")
            plugin = import_without_package_inits(
                src, "llamafactory.v1.plugins.trainer_plugins.optimizers.optimizer"
            )
            config = arg_utils.get_plugin_config(dict(example["optim_config"]))
            config["lr"] = example["learning_rate"]
            return plugin.create_muon_optimizer(getattr(model, "module", model), config)

    def route(self, name: str, p: Tensor, optimizers: list[Any]) -> tuple | None:
        return _llamafactory_route(p, optimizers)


class VeomniSetup(Setup):
    """VeOmni 0.1.12 (PyPI) with `optimizer_type: muon`: its own builder `build_optimizer(model,
    optimizer_type="muon")` (veomni/optim/optimizer.py:459, `_build_muon_with_adamw` 590) at its defaults (lr
    1e-3, weight decay 1e-2 for AdamW, Muon's lr inherited under `match_rms_adamw`, `ns_implementation`
    "gram_quack", which falls back to its pure-PyTorch Gram Newton-Schulz without CUDA SM90), on FSDP2 (1-D mesh)
    or HSDP (2-D mesh), as its trainer shards a model. Claim: its rule (`split_muon_adamw_params`, muon.py:409: a
    2-D or 3-D param to Muon unless it belongs to an nn.Embedding or its name holds embed_tokens, embedding,
    lm_head, output_layer or conv1d), each matrix whole, an expert stack per expert, and its stated path: one
    owner per matrix through its all-to-all (`_ortho_fsdp_group_all2all`), on a 2-D mesh too since ByteDance-Seed/
    VeOmni PR 1011."""

    name = "VeOmni build_optimizer(optimizer_type='muon')"
    sharding, path = "fsdp2", "sharded"
    layouts = False
    shardings = ("fsdp2", "hsdp")
    adamw_patterns = (
        "*embed*",
        "*embed_tokens*",
        "*embedding*",
        "*lm_head*",
        "*output_layer*",
        "*conv1d*",
    )

    def build(self, model: nn.Module) -> list[Any]:
        import torch.distributed as dist
        from veomni.distributed.parallel_state import init_parallel_state
        from veomni.optim.optimizer import build_optimizer

        W = dist.get_world_size() if dist.is_initialized() else 1
        shard = 2 if self.sharding == "hsdp" else W
        # VeOmni's trainer declares its data-parallel layout before it builds the optimizer
        init_parallel_state(
            dp_size=W,
            dp_replicate_size=W // shard,
            dp_shard_size=shard,
            dp_mode="fsdp2",
            device_type="cpu",
        )
        multi = build_optimizer(getattr(model, "module", model), optimizer_type="muon")
        return list(multi.optimizers_dict.values())


class DeepSpeedSetupBf16(DeepSpeedSetupNoClip):
    """The clip-free config with `"bf16": {"enabled": true}`: the module's params in bf16, fp32 master weights in
    the engine's optimizer (BF16_Optimizer at stage 0, the ZeRO optimizers' fp32 partitions at 1-3). The probe's
    gradients (integers / 64, at most 8 significant bits) and their sums over ranks and micro-batches are exact in
    bf16, so the invariance contract stays bitwise."""

    name = "DeepSpeed Muon (bf16, gradient_clipping 0)"
    extra = {"gradient_clipping": 0.0, "bf16": {"enabled": True}}
