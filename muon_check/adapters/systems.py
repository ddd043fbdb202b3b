"""Adapters that import and run the optimizer code of the systems the repo compares: LlamaFactory (v0
from the llamafactory wheel, v1 from a checkout), VeOmni, DeepSpeed, Megatron-core, NVIDIA Emerging-Optimizers and
xtuner. Each runs the system's own optimizer code, built as the system builds it (its defaults, its param grouping,
its process groups), on gloo ranks on CPU; no system code is copied here. Each class's docstring says what it runs
and what it claims; docs/field-systems.md gives every verdict, its command and its cause.

Install (a separate environment: several of these pin a torch, a transformers or a CUDA stack of their own;
`make field` does all of it, without CUDA wheels):
    pip install transformers==5.9.0 einops hjson msgpack ninja psutil py-cpuinfo pydantic tqdm absl-py \
        typing_extensions triton==3.9.0
    pip install --no-deps llamafactory==0.9.5 veomni==0.1.12
    DS_BUILD_OPS=0 pip install --no-deps --no-build-isolation deepspeed==0.19.8
    pip install --no-deps --ignore-requires-python --target DIR --python-version 3.12 --only-binary=:all: \
        megatron-core==0.19.2 emerging-optimizers==0.3.0       # then MUON_MEGATRON_PATH=DIR
Checkouts (never installed; their folders are passed as environment variables):
    MUON_XTUNER_CHECKOUT=/path/to/xtuner               InternLM/xtuner (the folder holding `xtuner`)
    MUON_LLAMAFACTORY_CHECKOUT=/path/to/LlamaFactory   hiyouga/LlamaFactory (the folder holding `src`)
    MUON_EMERGING_CHECKOUT=/path/to/Emerging-Optimizers NVIDIA-NeMo/Emerging-Optimizers
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from . import Adapter, package_version
from .cases import DIST_FAMILIES, MATRIX_FAMILIES, SINGLE_FAMILIES

XTUNER_CHECKOUT_ENV = "MUON_XTUNER_CHECKOUT"
LLAMAFACTORY_CHECKOUT_ENV = "MUON_LLAMAFACTORY_CHECKOUT"
EMERGING_CHECKOUT_ENV = "MUON_EMERGING_CHECKOUT"
MEGATRON_PATH_ENV = "MUON_MEGATRON_PATH"


def checkout_commit(path: str | None) -> str:
    """'checkout <short commit>' of a git checkout, or of a snapshot with a `.commit` file (its full commit),
    else 'checkout (no git metadata)'; 'no checkout' without a path."""
    if not path:
        return "no checkout"
    marker = os.path.join(path, ".commit")
    if os.path.isfile(marker):
        with open(marker) as f:
            return f"checkout {f.read().strip()[:12]}"
    if os.path.exists(os.path.join(path, ".git")):
        git = subprocess.run(
            ["git", "-C", path, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True
        )
        if git.returncode == 0:
            return f"checkout {git.stdout.strip()}"
    return "checkout (no git metadata)"


def checkout_path(env: str, path: str | None, inner: str) -> str:
    """The checkout folder (the adapter's, else $env); ValueError naming the variable when it is unset or does
    not hold `inner`."""
    path = path or os.environ.get(env) or None
    if not path or not os.path.exists(os.path.join(path, inner)):
        raise ValueError(f"no checkout: set ${env} to a folder holding {inner!r} (got {path!r})")
    return path


def load_file_as(name: str, path: str) -> Any:
    """Import the single file `path` as a module named `name` (once per process): for a checkout module that
    imports nothing from its own package."""
    import importlib.util

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def import_without_package_inits(root: str, *modules: str) -> Any:
    """Import `modules` from the checkout folder `root` with each of their parent packages registered as a bare
    package over its folder, so that the parents' __init__ files (which import a trainer stack: xtuner.v1's
    imports triton, its utils' loguru and the model code) do not run; the modules themselves run as they are in
    the checkout. Returns the first module."""
    import importlib
    import types

    for module in modules:
        parts = module.split(".")
        for i in range(1, len(parts)):
            name = ".".join(parts[:i])
            folder = os.path.join(root, *parts[:i])
            loaded = sys.modules.get(name)
            if loaded is None:
                package = types.ModuleType(name)
                package.__path__ = [folder]
                sys.modules[name] = package
                if i > 1:
                    setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], package)
            elif folder not in list(getattr(loaded, "__path__", [])):
                raise ValueError(
                    f"{name} is already imported from {list(getattr(loaded, '__path__', []))}, "
                    f"not from {folder}"
                )
    return [importlib.import_module(m) for m in modules][0]


@contextlib.contextmanager
def package_from_checkout(src: str, package: str) -> Iterator[None]:
    """While open, `package` and its submodules are the ones under the folder `src` (a checkout): modules of that
    name imported from elsewhere in this process (the llamafactory wheel, v0) are set aside, and put back after in
    place of the checkout's. The optimizer a builder returns holds its own classes."""

    def ours(name: str) -> bool:
        return name == package or name.startswith(package + ".")

    others = {k: sys.modules.pop(k) for k in list(sys.modules) if ours(k)}
    try:
        yield
    finally:
        for k in [k for k in sys.modules if ours(k)]:
            del sys.modules[k]
        sys.modules.update(others)


class FromCheckout(Adapter):
    """An adapter over a checkout: the folder is `checkout`, else the environment variable `checkout_env`."""

    checkout_env = ""

    def __init__(self, checkout: str | None = None) -> None:
        self.checkout = checkout or os.environ.get(self.checkout_env) or None

    def version(self) -> str:
        return checkout_commit(self.checkout)

    def root(self, inner: str) -> str:
        return checkout_path(self.checkout_env, self.checkout, inner)


class LlamaFactoryV0Muon(Adapter):
    """LlamaFactory 0.9.5's Muon (`llamafactory/third_party/muon/muon.py`, from Moonlight's toy_train.py), the one
    `use_muon: true` builds (`llamafactory/train/trainer_utils.py` `_create_muon_optimizer`: every 2-D param
    that is not an embedding or head goes to Muon, with lr and wd from the training arguments and the class's
    defaults momentum 0.95, nesterov True, ns_steps 5). Single device: no communication of its own (under
    DeepSpeed or FSDP it steps whatever tensors it is given).
    - sum momentum `buf.mul_(mu).add_(g)`, Nesterov `g.add(buf, alpha=mu)`;
    - NS: bf16, transposed when rows > cols, `X / (X.norm() + 1e-7)`, Keller's coefficients, `b*A + c*A@A`,
      `a*X + B@X`; the bf16 result is added to the param;
    - `p.mul_(1 - lr*wd)`, `p.add_(u, alpha=-lr * 0.2 * sqrt(max(A, B)))`: preset `moonlight`.
    2-D params only (`assert p.ndim == 2` at construction). The training arguments pass lr and wd only; momentum
    and nesterov are the constructor's keywords, checked too."""

    name, preset = "llamafactory v0 Muon", "moonlight"
    families = MATRIX_FAMILIES | {"micro_batches", "nesterov_off"}

    def version(self) -> str:
        return package_version("llamafactory")

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        from llamafactory.third_party.muon import Muon

        named = {"wd" if k == "weight_decay" else k: v for k, v in hp.items()}
        return Muon(muon_params=params, adamw_params=[], **named)


class VeomniMuon(Adapter):
    """VeOmni 0.1.12's `DistributedMuon` (`veomni/optim/muon.py`) with the options of its OptimizerConfig
    (`veomni/arguments/arguments_types.py`: muon_adjust_lr_fn "match_rms_adamw", eps 1e-7, Keller's coefficients,
    5 steps) and `muon_ns_implementation: std` (torch.optim.Muon's Newton-Schulz; its default "gram_quack" is the
    second adapter). On FSDP2 DTensors as `_build_muon_with_adamw` hands them over (one group of 2-D and 3-D
    params, `split_muon_adamw_params`):
    - EMA momentum `buf.lerp_(g, 1 - mu)`, Nesterov `g.lerp(buf, mu)`;
    - NS (`batched_newton_schulz`): bf16, transposed when rows > cols, `/ norm.clamp(min=eps)`, `addmm` steps
      (`baddbmm` on 3-D stacks), result cast to the param's dtype;
    - `p.mul_(1 - lr*wd)`, `p.add_(O, alpha=-torch's _adjust_lr(lr, "match_rms_adamw", shape))`: preset `torch`
      with lr_scale "match_rms_adamw".
    Layout: a Shard(0) 2-D param is gathered to one owner rank per chunk of W params by list-form
    `dist.all_to_all` (row shards of unequal sizes when rows % W != 0), orthogonalised there and scattered back
    (`_ortho_fsdp_group_all2all`); a Shard(0) 3-D expert stack is orthogonalised where its boxes lie."""

    name, preset, distributed = "veomni DistributedMuon (std NS)", "torch", "dtensor"
    overrides = {"lr_scale": "match_rms_adamw"}
    families = (SINGLE_FAMILIES - {"conv4d"}) | DIST_FAMILIES
    ns_implementation = "std"

    def version(self) -> str:
        return package_version("veomni")

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        from veomni.optim.muon import DistributedMuon

        return DistributedMuon(
            params,
            adjust_lr_fn="match_rms_adamw",
            ns_implementation=self.ns_implementation,
            **hp,
        )


class VeomniMuonGram(VeomniMuon):
    """VeomniMuon with VeOmni's default `muon_ns_implementation: gram_quack`. Without CUDA SM90 it falls back
    (one warning) to its pure-PyTorch Gram Newton-Schulz (`batched_gram_newton_schulz`: fp32 normalisation, fp16
    iterations on the Gram matrix, a restart after step 2; square matrices take the std path in bf16). No muon_ref
    option is Gram NS with these numerics: the claim is the std one, and the departures measure the difference."""

    name = "veomni DistributedMuon (default gram_quack, CPU fallback)"
    ns_implementation = "gram_quack"


class LlamaFactoryV1Muon(FromCheckout):
    """LlamaFactory's v1 Muon plugin from a checkout of hiyouga/LlamaFactory
    (`src/llamafactory/v1/plugins/trainer_plugins/optimizers/muon_optimizer.py`, the DTensor-aware "v2" step;
    checked at ff6d4d12), built as `create_muon_optimizer` (optimizer.py in that folder) builds it: 2-D params
    that are not embeddings, heads or LoRA factors, lr / wd / momentum / nesterov from the plugin config, 5 NS steps.
    The file imports only torch, math and os; it is loaded alone (the v1 package's __init__ chain is the trainer).
    - sum momentum on the local shard `buf.mul_(mu).add_(g)`, Nesterov `g.add(buf, alpha=mu)`;
    - NS on the whole matrix: `g_use.full_tensor()` (an all-gather), bf16, transposed when rows > cols,
      `X / (X.norm() + 1e-7)`, Keller's coefficients, `b*A + c*A@A`, `a*X + B@X`; every rank runs it;
    - `p.mul_(1 - lr*wd)`, then the bf16 update `distribute_tensor`'d back to the param's placements and
      `p.add_(u, alpha=-lr * 0.2 * sqrt(max(A, B)))` with the global shape: preset `moonlight`.
    2-D params only (`assert p.ndim == 2`). The checkout is `checkout`, else $MUON_LLAMAFACTORY_CHECKOUT."""

    name, preset, distributed = "llamafactory v1 Muon (plugin)", "moonlight", "dtensor"
    families = MATRIX_FAMILIES | {"micro_batches", "nesterov_off"} | (DIST_FAMILIES - {"experts"})
    module_path = "src/llamafactory/v1/plugins/trainer_plugins/optimizers/muon_optimizer.py"

    checkout_env = LLAMAFACTORY_CHECKOUT_ENV

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        root = self.root(self.module_path)
        module = load_file_as(
            "llamafactory_v1_muon_optimizer", os.path.join(root, self.module_path)
        )
        named = {"wd" if k == "weight_decay" else k: v for k, v in hp.items()}
        return module.Muon(muon_params=params, adamw_params=[], ns_steps=5, **named)


class XtunerMuon(FromCheckout):
    """xtuner's FSDP2 Muon from a checkout of InternLM/xtuner (`xtuner/v1/optim/muon.py`, checked at b934f462),
    built as `MuonConfig.build` (`xtuner/v1/config/optim.py`) builds it: one group of regular Muon params
    (`clip_grad=False`), `Muon(groups, lr, mu=momentum, weight_decay, nesterov=True, flatten=True,
    adjust_lr="rms_norm", use_triton=False, epsilon=1e-8, enable_all2all=True)` (MuonConfig's defaults).
    - sum momentum `M.mul_(mu).add_(G)`, Nesterov `G + mu*M`; NS (`zeropower_via_newtonschulz5`): bf16, you5
      coefficients in Dion's form, per expert for `num_experts > 1`;
    - `P.mul_(1 - lr*wd)`, `U *= lr * ratio`, `P -= U` with `ratio = 0.2 * sqrt(max(fan_out // num_experts,
      fan_in))`: preset `xtuner`, whose 004bc257 multiplied the bf16 update in place by a Python float (rounded
      to bf16 first: scale_apply "update_lr_cast"); here lr is a 0-dim fp32 tensor (`torch.tensor(group["lr"])`,
      muon.py:611) and `adjusted_lr = lr * lr_ratio` (963) multiplies without that rounding: scale_apply
      "update_lr".
    Plain tensors are refused (`assert isinstance(tensor, DTensor)`, "All parameters must be DTensors" in its
    docstring): the dtensor families only.
    Layout: DTensor params in batches of W same-shape params; a full batch is all-to-all'd to one owner per param,
    a remainder goes through all-gather + reduce-scatter (remainder_strategy "agrs").
    The module is imported with its parent packages bare (`import_without_package_inits`: xtuner/v1/__init__.py
    imports triton and the model code); `xtuner.v1.utils.dtensor`, which it imports, runs from the checkout.
    The checkout is `checkout`, else $MUON_XTUNER_CHECKOUT."""

    name, preset, distributed = "xtuner Muon (FSDP2)", "xtuner", "dtensor"
    overrides = {"scale_apply": "update_lr"}
    families = DIST_FAMILIES
    state_key = "momentum"

    checkout_env = XTUNER_CHECKOUT_ENV
    muon_kwargs: dict[
        str, Any
    ] = {}  # constructor keywords over MuonConfig.build's (its other paths)

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        root = self.root("xtuner/v1/optim/muon.py")
        muon = import_without_package_inits(root, "xtuner.v1.optim.muon", "xtuner.v1.utils.dtensor")
        options = {"mu" if k == "momentum" else k: v for k, v in hp.items()}
        experts = options.pop("num_experts", 1)
        group = {"params": params, "clip_grad": False}
        if experts > 1:
            group["num_experts"] = experts
        options.setdefault("nesterov", True)
        built = dict(
            flatten=True, adjust_lr="rms_norm", use_triton=False, epsilon=1e-8, enable_all2all=True
        )
        return muon.Muon([group], **{**built, **self.muon_kwargs, **options})


def _emerging_on_python_311(root: str) -> Any:
    """NVIDIA Emerging-Optimizers' muon module from the folder `root` (a checkout, or a folder it was unpacked
    into), with two stated shims for Python 3.11 (the project declares >= 3.12): `typing.override` from
    typing_extensions where typing lacks it, and, where `emerging_optimizers/registry.py` does not parse on this
    Python (the 2026-08 checkout's `def register_optimizer[Opt: optim.Optimizer](name)`, a PEP 695 generic), a
    stand-in whose `register_optimizer(name)` returns the class unchanged. The registry maps names to classes
    for a trainer's lookup; no optimizer math is in it."""
    import ast
    import types
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override
    if root not in sys.path:
        sys.path.insert(0, root)
    if "emerging_optimizers.registry" not in sys.modules:
        with open(os.path.join(root, "emerging_optimizers", "registry.py")) as f:
            source = f.read()
        try:
            ast.parse(source)
        except SyntaxError:
            registry = types.ModuleType("emerging_optimizers.registry")
            registry.register_optimizer = lambda name: lambda cls: cls
            sys.modules["emerging_optimizers.registry"] = registry
            import emerging_optimizers

            emerging_optimizers.registry = registry
    from emerging_optimizers.orthogonalized_optimizers import muon

    return muon


class EmergingMuon(FromCheckout):
    """NVIDIA-NeMo/Emerging-Optimizers' `Muon` (`emerging_optimizers/orthogonalized_optimizers/muon.py`,
    `muon_utils.py`, `orthogonalized_optimizer.py`; checked at fd772926) with its defaults: EMA momentum
    `M.lerp_(G, 1 - mu)` (Nesterov `G.lerp(M, mu)` when on), decoupled weight decay `P.add_(P, alpha=-wd*lr)`,
    fp32_matmul_prec "medium" (F.normalize in fp32 with eps 1e-7, bf16 steps, result back to fp32), "quintic"
    coefficients, 5 steps, scale_mode "spectral" (`max(fo, fi) ** 0.5`), `P.add_(O, alpha=-lr)`: preset
    `emerging`. Single device (its tensor-parallel NS is Megatron's row). 2-D params only (orthogonalize raises
    on other ranks) and float32 params only (`newton_schulz` raises TypeError on any other dtype,
    muon_utils.py:201-202: Megatron keeps fp32 main params). Since the 0.3.0 release the NS eps default is 1e-15
    (muon_utils.py:154; 1e-7 in 0.3.0, which the `emerging` preset restates) and Muon passes none: the claim
    takes eps=1e-15. Run on Python 3.11 with two stated shims (`_emerging_on_python_311`). The checkout is
    `checkout`, else $MUON_EMERGING_CHECKOUT."""

    name, preset = "emerging_optimizers Muon", "emerging"
    overrides = {"eps": 1e-15}
    families = MATRIX_FAMILIES | {"micro_batches", "nesterov_off"}
    dtypes = ("float32",)

    checkout_env = EMERGING_CHECKOUT_ENV

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        root = self.root("emerging_optimizers")
        return _emerging_on_python_311(root).Muon(params, **hp)


class _DeepSpeedStep(torch.optim.Optimizer):
    """A DeepSpeed engine driven as the check drives an optimizer. The engine holds its own copies of the check's
    params (ZeRO flattens, partitions and hooks the params it is given; ZeRO-3 empties them); the check has put each
    rank's gradient in p.grad (through autograd, micro-batches summed). `step` takes them out and runs them through
    the engine as a training step does, `engine.backward(model(grads))` with a model whose loss is sum(w * g) (its
    gradient is g, bit for bit), then `engine.step()`: DeepSpeed averages over the ranks, partitions for ZeRO and
    steps its Muon. Then the engine's params (gathered under ZeRO-3, `deepspeed.zero.GatheredParameters`) are
    copied into the check's."""

    def __init__(self, engine: Any, params: list[Tensor], copies: list[Tensor]) -> None:
        super().__init__(params, {})
        self.engine, self.params, self.copies = engine, params, copies

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        import deepspeed

        grads = [p.grad.detach().clone() if p.grad is not None else None for p in self.params]
        for p in self.params:
            p.grad = None
        with torch.enable_grad():
            loss = self.engine(grads)
            self.engine.backward(loss)
        self.engine.step()
        with deepspeed.zero.GatheredParameters(self.copies):
            for p, w in zip(self.params, self.copies):
                p.copy_(w.detach())


class _GradientDot(torch.nn.Module):
    """loss = sum_i sum(p_i * g_i): d loss / d p_i = g_i exactly (the products' gradient is g_i * 1)."""

    def __init__(self, params: list[Tensor]) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(params)

    def forward(self, grads: list[Tensor | None]) -> Tensor:
        terms = [(p * g).sum() for p, g in zip(self.weights, grads) if g is not None]
        return torch.stack(terms).sum() if terms else sum(p.sum() * 0 for p in self.weights)


def deepspeed_on_cpu() -> None:
    """DeepSpeed's CPU accelerator on the check's gloo ranks: what torchrun or the deepspeed launcher sets on one
    node (DeepSpeedEngine asserts LOCAL_RANK), eager kernels (its `@compiler.compile()` functions), and its
    shared-memory all-reduce off (a C++ op deepspeed.initialize would JIT-build: a compiler and a build per fresh
    cache), so its collectives go through torch.distributed (gloo)."""
    import torch.distributed as dist

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    for key, value in (("LOCAL_RANK", rank), ("RANK", rank), ("WORLD_SIZE", world)):
        os.environ.setdefault(key, str(value))
    torch.compiler.set_stance("force_eager")
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class DeepSpeedMuon(Adapter):
    """DeepSpeed 0.19.8's Muon (`deepspeed/runtime/zero/muon/`), built by `deepspeed.initialize` from a config
    (`"optimizer": {"type": "Muon", "params": {lr, momentum, weight_decay, ns_method}}`,
    `"zero_optimization": {"stage": ZERO_STAGE}`), with DS_ACCELERATOR=cpu on the check's gloo ranks; every param is
    tagged `use_muon` (engine.py `_muon_param_groups`), so the engine builds `MuonWithAuxAdam` and, under ZeRO, its
    ZeRO optimizer over it. Each rank feeds its own gradient and DeepSpeed averages them (mode "unreduced").
    `muon_update` (original_muon.py:190-235): EMA momentum `momentum.lerp(grad, 1 - beta)`, Nesterov
    `grad.lerp_(momentum, beta)` (always on), NS `zeropower_via_newtonschulz5` (ns_method "standard": bf16 where the
    accelerator supports it, transposed when rows > cols, `X / (norm + 1e-7)`, Keller's form) or, by default,
    `zeropower_via_gram_newtonschulz` (ns_method "gram"; this adapter configures "standard", DeepSpeedMuonGram
    keeps the default); `update *= sqrt(max(1, rows / cols))` (math.sqrt);
    then `p.mul_(1 - lr*wd)`, `p.add_(update, alpha=-lr)` (muon_optimizer.py). Claim: preset `keller` with
    scale_sqrt "sqrt" (Keller's `** 0.5`), weight decay and Nesterov as configured. The config sets
    `"gradient_clipping": 0.0`: DeepSpeed clips gradients to global norm 1.0 unless told otherwise
    (runtime/constants.py:203, engine.py `_take_model_step`), before its optimizer sees them.
    Under ZeRO-3 the config also sets `"reduce_scatter": false` (stage3.py:361 refuses Muon with it). LOCAL_RANK,
    RANK and WORLD_SIZE are set as a one-node launcher sets them (DeepSpeedEngine asserts LOCAL_RANK). The engine
    holds copies of the check's params (`_DeepSpeedStep`). The checkpoint families save and load through the
    engine, as DeepSpeed's users do (`engine.save_checkpoint` / `engine.load_checkpoint`). Its kernels are `@compiler.compile()` (torch.compile);
    they run eagerly in the adapter (`torch.compiler.set_stance("force_eager")`), as the repo's other compiled
    candidates do. float32 params only:
    with bf16 the engine keeps fp32 master weights, another contract. One stated patch: DeepSpeed's CPU shared-memory
    all-reduce (a C++ op it would JIT-compile at initialize) is marked incompatible, so its collectives run on
    torch.distributed (gloo); it is a transport, not optimizer code."""

    name, preset, distributed = "deepspeed Muon", "keller", "unreduced"
    overrides = {"scale_sqrt": "sqrt"}
    hyperparameters = frozenset({"lr", "weight_decay", "momentum"})
    families = frozenset(
        {
            "badly_scaled",
            "even",
            "remainder",
            "mixed",
            "straddle",
            "accumulation",
            "checkpoint",
            "checkpoint_unstepped",
        }
    )
    dtypes = ("float32",)
    zero_stage = 0
    zero_extra: dict[str, Any] = {}  # more keys of "zero_optimization"
    ns_method = "standard"

    def version(self) -> str:
        return package_version("deepspeed")

    def describe(self) -> str:
        return f"{super().describe()} [ZeRO stage {self.zero_stage}, ns_method {self.ns_method!r}]"

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        deepspeed_on_cpu()
        import deepspeed

        copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for w in copies:
            w.use_muon = w.ndim >= 2
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "Muon", "params": {**hp, "ns_method": self.ns_method}},
            "zero_optimization": {"stage": self.zero_stage, **self.zero_extra},
        }
        if self.zero_stage == 3:
            # stage3.py refuses Muon with its default reduce_scatter: "Muon and reduce scatter cannot be used
            # together"
            config["zero_optimization"]["reduce_scatter"] = False
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = _GradientDot(copies)
        else:
            model = _GradientDot(copies)
        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=model.parameters(),
            config=config,
            dist_init_required=False,
        )
        return _DeepSpeedStep(engine, params, copies)

    def momentum(self, opt: torch.optim.Optimizer, p: Tensor) -> Tensor | None:
        return None  # under ZeRO it lives in flat partitions: not compared

    def save_checkpoint(
        self, opt: torch.optim.Optimizer, module: torch.nn.Module, path: str
    ) -> None:
        """As DeepSpeed's users save: `engine.save_checkpoint(path, tag)` (model states, and the optimizer
        states of each rank's ZeRO partition)."""
        opt.engine.save_checkpoint(path, tag="case")

    def load_checkpoint(
        self, opt: torch.optim.Optimizer, module: torch.nn.Module, path: str
    ) -> None:
        """`engine.load_checkpoint(path, tag)` into the fresh engine (its optimizer states included), then the
        engine's params copied into the check's."""
        import deepspeed

        opt.engine.load_checkpoint(path, tag="case")
        with torch.no_grad(), deepspeed.zero.GatheredParameters(opt.copies):
            for p, w in zip(opt.params, opt.copies):
                p.copy_(w.detach())


class DeepSpeedMuonZero1(DeepSpeedMuon):
    """DeepSpeedMuon under ZeRO stage 1 (optimizer states partitioned; `stage_1_and_2.py` gathers each Muon
    param's gradient and momentum for Newton-Schulz, `_muon_all_gather_partitions`)."""

    zero_stage = 1


class DeepSpeedMuonZero2(DeepSpeedMuon):
    """DeepSpeedMuon under ZeRO stage 2 (gradients partitioned too, reduced by its backward hooks)."""

    zero_stage = 2


class DeepSpeedMuonZero3(DeepSpeedMuon):
    """DeepSpeedMuon under ZeRO stage 3 (params partitioned; `stage3.py` runs Muon in its sub-group loop)."""

    zero_stage = 3


class DeepSpeedMuonZero3InMemory(DeepSpeedMuonZero3):
    """DeepSpeedMuonZero3 with `"save_muon_momentum_buffer_in_memory": true` under `zero_optimization`, the key
    DeepSpeed's Muon configuration example sets (meant for NVMe offload: the Muon momentum stays in memory,
    stage3.py `_create_momentum_buffer`, instead of in the swapped optimizer state)."""

    name = "deepspeed Muon (ZeRO-3, save_muon_momentum_buffer_in_memory)"
    zero_extra = {"save_muon_momentum_buffer_in_memory": True}


class DeepSpeedMuonGram(DeepSpeedMuonZero2):
    """DeepSpeedMuon under ZeRO stage 2 with DeepSpeed's default `ns_method: gram`
    (`zeropower_via_gram_newtonschulz`, original_muon.py:82-160: normalised in the input's dtype, iterated on the Gram
    matrix in fp16 where the accelerator supports it, else fp32, restart at step 2; square matrices take the
    standard iteration). No muon_ref option restates it: the claim is the standard one, and the departures measure
    the difference."""

    ns_method = "gram"


class LocalShardStep(torch.optim.Optimizer):
    """A system's optimizer stepping the check's params through their local boxes: each DTensor param's box is
    handed to the system as a plain Parameter over the same storage (`shards`, made by the adapter, which tags them
    as the system needs: Megatron's `partition_dim`, Canzona's shape metadata), and `step` gives each box its
    gradient's box as its grad, then steps the system's optimizer; a plain param (one device) is its own shard."""

    def __init__(
        self, inner: torch.optim.Optimizer, params: list[Tensor], shards: list[Tensor]
    ) -> None:
        super().__init__(params, {})
        self.inner, self.params, self.shards = inner, params, shards

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for p, shard in zip(self.params, self.shards):
            if shard is p:
                continue
            grad = p.grad
            shard.grad = (
                None if grad is None else (grad.to_local() if hasattr(grad, "to_local") else grad)
            )
        self.inner.step()


class MegatronTensorParallelMuon(Adapter):
    """Megatron-core 0.19.2's `TensorParallelMuon` (`megatron/core/optimizer/emerging_optimizers.py`), over NVIDIA
    Emerging-Optimizers 0.3.0 (the release it imports: it needs `emerging_optimizers.soap`, which the 2026-08
    checkout no longer has), tensor parallel on the check's gloo ranks: each rank holds
    a Shard(0) row block of every matrix, tagged `partition_dim = 0` as a column-parallel weight, and
    `ProcessGroupCollection(tp=<the ranks' group>)`; tp_mode "duplicated" (its default): `newton_schulz_tp`
    all-gathers the blocks (list-form `dist.all_gather` of `torch.empty_like(local)`), runs Emerging's
    `newton_schulz` on the whole matrix on every rank and keeps its own block (muon_utils.py). Defaults: Nesterov
    (EMA `G.lerp(M, mu)`), decoupled weight decay, "quintic", 5 steps, scale "spectral" from the global shape
    (`size[partition_dim] *= tp size`), fp32_matmul_prec "medium": preset `emerging` (0.3.0's NS eps is 1e-7)
    with Nesterov as the check sets it. float32 only (Emerging's NS raises on bf16).
    megatron-core 0.19.2 declares Python >= 3.12 and ships a cp312 wheel: it is unpacked without install
    (`pip install --no-deps --ignore-requires-python --target DIR --python-version 3.12 --only-binary=:all:
    megatron-core==0.19.2 emerging-optimizers==0.3.0`) and $MUON_MEGATRON_PATH names DIR; the module is imported with its parent packages
    bare (megatron/core/__init__.py reaches an unguarded `import triton`), and Emerging with its two Python 3.11
    shims (`_emerging_on_python_311`). Megatron TP shards evenly (its layers divide rows by the TP size): the
    families are those with rows % W == 0, or one device."""

    name, preset, distributed = "megatron-core TensorParallelMuon", "emerging", "dtensor"
    tp_mode = "duplicated"
    families = MATRIX_FAMILIES | {"micro_batches", "nesterov_off", "even", "accumulation"}
    dtypes = ("float32",)
    state_key = "momentum_buffer"

    def __init__(self, path: str | None = None) -> None:
        self.path = path or os.environ.get(MEGATRON_PATH_ENV) or None

    def version(self) -> str:
        from importlib.metadata import PathDistribution
        from pathlib import Path

        if not self.path:
            return "not installed"
        found = [
            sorted(Path(self.path).glob(f"{name}-*.dist-info"))
            for name in ("megatron_core", "emerging_optimizers")
        ]
        megatron, emerging = (PathDistribution(f[0]).version if f else "unknown" for f in found)
        return f"{megatron} (Emerging-Optimizers {emerging})"

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        path = checkout_path(MEGATRON_PATH_ENV, self.path, "megatron/core/optimizer")
        _emerging_on_python_311(path)
        module = import_without_package_inits(
            path,
            "megatron.core.optimizer.emerging_optimizers",
            "megatron.core.process_groups_config",
        )
        collection = sys.modules["megatron.core.process_groups_config"].ProcessGroupCollection
        shards, group = [], None
        for p in params:
            if hasattr(p, "to_local"):
                shard = torch.nn.Parameter(p.to_local(), requires_grad=True)
                shard.partition_dim, shard.tensor_model_parallel = 0, True
                group = p.device_mesh.get_group()
            else:
                shard = p
            shards.append(shard)
        inner = module.TensorParallelMuon(
            shards,
            pg_collection=collection(tp=group) if group is not None else None,
            tp_mode=self.tp_mode,
            **hp,
        )
        return LocalShardStep(inner, params, shards)

    def momentum(self, opt: torch.optim.Optimizer, p: Tensor) -> Tensor | None:
        shard = next((w for q, w in zip(opt.params, opt.shards) if q is p), p)
        buf = opt.inner.state.get(shard, {}).get("momentum_buffer")
        return None if buf is None else buf.reshape(shard.shape)


AREAL_CHECKOUT_ENV = "MUON_AREAL_CHECKOUT"


class ArealMuon(FromCheckout):
    """AReaL's Muon, not released: `areal/engine/fsdp_utils/muon.py` at the head of inclusionAI/AReaL PR 1270
    (commit 7d18cca03c706fb967efa0593d578b2174cdfe51), from a folder holding that file at that path
    ($MUON_AREAL_CHECKOUT). torch only; one group `{"params": ..., "use_muon": True, lr, momentum,
    weight_decay, nesterov}` with its defaults `rms_scale=True`, `ns_steps=5`:
    - EMA momentum `buf.lerp_(g, 1 - beta)` on the local shard, Nesterov `g.lerp_(buf, beta)` (in place on the grad);
    - NS (`zeropower_via_newtonschulz5`): bf16, transposed when rows > cols, `X / (norm + 1e-7)`, Keller's form
      `b*A + c*A@A`, `a*X + B@X` (its loop is `torch.compile`d; run eagerly here, as the repo's other compiled
      candidates are);
    - `grad *= 0.2 * math.sqrt(max(grad.shape[1], grad.shape[0]))` in the grad's dtype, `p.mul_(1 - lr*wd)`,
      `p.add_(update, alpha=-lr)`: preset `keller` with lr_scale "match_rms_adamw" and scale_sqrt "sqrt".
    Layout (`Fsdp1dWork`): a DTensor on a 1-D mesh is gathered (`dist.gather` into buffers of the destination's
    own local shape) to rank `index % W`, orthogonalised there and scattered back in `chunk(W)` pieces; a 2-D mesh
    raises NotImplementedError (its TP + FSDP path is a stub at that commit)."""

    name, preset, distributed = "AReaL Muon (PR 1270 head)", "keller", "dtensor"
    overrides = {"lr_scale": "match_rms_adamw", "scale_sqrt": "sqrt"}
    families = SINGLE_FAMILIES | DIST_FAMILIES
    checkout_env = AREAL_CHECKOUT_ENV
    path = "areal/engine/fsdp_utils/muon.py"

    def version(self) -> str:
        return "inclusionAI/AReaL PR 1270 at 7d18cca0 (" + self.path + ")"

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        torch.compiler.set_stance("force_eager")
        module = load_file_as("areal_pr1270_muon", os.path.join(self.root(self.path), self.path))
        return module.Muon([{"params": params, "use_muon": True, **hp}])


class MegatronTensorParallelMuonBlockwise(MegatronTensorParallelMuon):
    """MegatronTensorParallelMuon with `tp_mode="blockwise"` (its default before NVIDIA/Megatron-LM PR 6380):
    emerging_optimizers.py:290 drops the param's partition_dim, so each rank orthogonalises its own row block as
    if it were the matrix. The claim stays the whole-matrix one: the departures measure the mode."""

    name = "megatron-core TensorParallelMuon (tp_mode blockwise)"
    tp_mode = "blockwise"


class MegatronTensorParallelMuonDistributed(MegatronTensorParallelMuon):
    """MegatronTensorParallelMuon with `tp_mode="distributed"`: Emerging's `newton_schulz_tp` iterates on the
    row blocks and all-reduces each step's small Gram matrix (muon_utils.py), so the whole matrix is
    orthogonalised with sums in another order than one device's."""

    name = "megatron-core TensorParallelMuon (tp_mode distributed)"
    tp_mode = "distributed"


__all__ = [
    "AREAL_CHECKOUT_ENV",
    "ArealMuon",
    "EMERGING_CHECKOUT_ENV",
    "LLAMAFACTORY_CHECKOUT_ENV",
    "MEGATRON_PATH_ENV",
    "SYSTEMS",
    "XTUNER_CHECKOUT_ENV",
    "DeepSpeedMuon",
    "DeepSpeedMuonGram",
    "DeepSpeedMuonZero1",
    "DeepSpeedMuonZero2",
    "DeepSpeedMuonZero3",
    "DeepSpeedMuonZero3InMemory",
    "EmergingMuon",
    "FromCheckout",
    "LocalShardStep",
    "LlamaFactoryV0Muon",
    "LlamaFactoryV1Muon",
    "MegatronTensorParallelMuon",
    "MegatronTensorParallelMuonBlockwise",
    "MegatronTensorParallelMuonDistributed",
    "VeomniMuon",
    "VeomniMuonGram",
    "XtunerMuon",
    "checkout_commit",
    "checkout_path",
    "import_without_package_inits",
    "load_file_as",
    "package_from_checkout",
]


SYSTEMS = (
    LlamaFactoryV0Muon,
    LlamaFactoryV1Muon,
    VeomniMuon,
    VeomniMuonGram,
    DeepSpeedMuon,
    DeepSpeedMuonZero1,
    DeepSpeedMuonZero2,
    DeepSpeedMuonZero3,
    DeepSpeedMuonZero3InMemory,
    DeepSpeedMuonGram,
    XtunerMuon,
    EmergingMuon,
    MegatronTensorParallelMuon,
    MegatronTensorParallelMuonBlockwise,
    MegatronTensorParallelMuonDistributed,
    ArealMuon,
)


def main() -> None:
    """`python -m muon_check.adapters.systems`: each adapter's version (a checkout's commit) and claim, as
    `make field` records them before the table."""
    for adapter in SYSTEMS:
        try:
            print(adapter().describe())
        except Exception as e:  # noqa: BLE001 - a missing package is a line of the record, not a failure
            print(f"{adapter.__name__}: not available ({type(e).__name__}: {e})")


if __name__ == "__main__":
    main()
