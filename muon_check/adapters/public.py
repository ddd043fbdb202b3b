"""Adapters for public Muons from PyPI that docs/public-muons.md does not cover yet.

One Adapter per candidate; each docstring states the claim (the muon_ref preset and overrides a user would
expect it to reproduce) and the source lines it rests on, read by hand at the version named (paths relative to
the package root). The packages are optional: each is imported inside build(). None is in the dev extra;
install them beside the environment, without dependencies, so that no package can replace torch:

    pip install --no-deps --target DIR pytorch-optimizer==4.1.0 timm==1.0.31 heavyball==3.2.1 keras==3.15.1 \
        optimuon==0.1.1 dtensor-muon==0.1.0 tauon-optimizer==0.1.4 trasmuon-pytorch==0.1.0 \
        triton-muon-adamw==1.0.0
    pip install --no-deps --target DIR absl-py==2.5.1 namex==0.1.0 rich==15.0.0 h5py==3.16.0 \
        optree==0.20.0 ml-dtypes==0.6.0        # keras's imports
    PYTHONPATH=DIR python -m muon_check \
        --adapter muon_check.adapters.public:PytorchOptimizerMuon --world-sizes 1

timm imports torchvision at package level; PyPI's torchvision is a CUDA build that does not load with a CPU
torch, so TimmMuon imports timm.optim.muon without timm's package __init__ (stated in its docstring).
Keras's Muon and triton-muon-adamw's TritonMuon are not torch.optim.Optimizers: small wrappers below step them
on the check's params (exact copies in and out).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

import torch
from torch import Tensor

from . import Adapter, package_version
from .cases import DIST_FAMILIES, REPLICATED_FAMILIES, SINGLE_FAMILIES
from .shipped import Muonium


def _run_eagerly() -> None:
    """Every torch.compile region of this process runs eagerly (as in field.py)."""
    torch.compiler.set_stance("force_eager")


class PytorchOptimizerMuon(Adapter):
    """pytorch-optimizer 4.1.0 `pytorch_optimizer.Muon` (optimizer/muon/muon.py, muon/base.py, utils/matrix.py,
    base/optimizer.py). One group with `use_muon=True` (required: muon.py:100-103). On CPU its foreach path runs
    (base/optimizer.py:467-505):
    - decoupled decay `torch._foreach_mul_(params, 1 - wd*lr)` first (base/optimizer.py:567-583, base.py:96-98);
    - EMA `_foreach_lerp_(M, G, 1 - mu)`, Nesterov `_foreach_lerp_(G, M, mu)` into p.grad (base.py:140-144);
    - NS on `reshape(size(0), -1)` (base.py:117): transpose if tall, contiguous bf16 copy, `norm.clamp_min(1e-7)`,
      `mm` / `addmm(beta=b, alpha=c)` / `addmm(beta=a)` with (3.4445, -4.7750, 2.0315) x 5 (matrix.py:290-363);
    - `_foreach_add_(params, O, alpha=-lr * math.pow(max(1, out/in), 0.5))` with in = prod(shape[1:])
      (base.py:17-41, 148-158): preset `torch`, scale evaluated with pow.
    Its docstring claims FSDP2 DTensor support (muon.py:18): NS on full_tensor(), redistributed (matrix.py:285-331).
    Momentum in state["momentum_buffer"]."""

    name, preset, distributed = "pytorch_optimizer.Muon", "torch", "dtensor"
    overrides = {"scale_sqrt": "pow"}
    families = SINGLE_FAMILIES | DIST_FAMILIES

    def version(self) -> str:
        return package_version("pytorch-optimizer")

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        from pytorch_optimizer import Muon

        return Muon([{"params": params, "use_muon": True}], **hp)


class PytorchOptimizerDistributedMuon(PytorchOptimizerMuon):
    """pytorch-optimizer 4.1.0 `pytorch_optimizer.DistributedMuon` (optimizer/muon/distributed_muon.py): replicated
    params, KellerJordan's pattern: rank r steps params i + r of each batch of W, then
    `all_gather(padded[i:i+W], padded[i+r])` with `-len(params) % W` padding (distributed_muon.py:157-184). On CPU
    the foreach path is off (`default_on_cuda=True`, distributed_muon.py:137), so each param takes the per-param calls:
    `p.mul_(1 - wd*lr)` (base/optimizer.py:206-207), the same lerp momentum and NS as Muon, `_foreach_add_` with
    alpha. Claim: preset `torch` with the scale evaluated by pow."""

    name, distributed = "pytorch_optimizer.DistributedMuon", "replicated"
    families = SINGLE_FAMILIES | REPLICATED_FAMILIES

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        from pytorch_optimizer import DistributedMuon

        return DistributedMuon([{"params": params, "use_muon": True}], **hp)


def _timm_muon() -> Any:
    """timm.optim.muon, imported without timm's package __init__ when that fails (timm/layers/_fx.py and
    timm/utils/model.py import torchvision, whose PyPI build needs CUDA torch): namespace stubs for `timm` and
    `timm.optim` point at the installed folders; muon.py needs only timm.optim._helpers, _types, adamw, nadamw."""
    try:
        return importlib.import_module("timm.optim.muon")
    except (ImportError, RuntimeError):
        for key in [k for k in sys.modules if k == "timm" or k.startswith("timm.")]:
            del sys.modules[key]
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("timm is not installed")
    root = list(spec.submodule_search_locations)[0]
    for name, path in (("timm", root), ("timm.optim", os.path.join(root, "optim"))):
        stub = type(sys)(name)
        stub.__path__ = [path]
        sys.modules[name] = stub
    return importlib.import_module("timm.optim.muon")


class TimmMuon(Adapter):
    """timm 1.0.31 `timm.optim.Muon` (timm/optim/muon.py), given the plain param list (auto-routing, its documented
    usage `Muon(model.parameters(), lr=0.02)`):
    - routing (845-866): `_is_suitable_for_muon` (265-334) sends to NAdamW (nesterov) / AdamW (956-998) params
      with < 2 dims > 1, a leading unit dim, min(shape[0], prod(rest)) < 4, or aspect ratio > 128;
    - `P.mul_(1 - lr*wd)` (492); `M.lerp_(G, 1 - mu)`, Nesterov `G.lerp(M, mu)` (495-496);
    - NS: bf16 copy, transpose view if tall, `div_(norm(2, dim=(-2,-1)) * 1.0 .clamp(min=1e-7))`, then contiguous and
      `addmm` steps (A by addmm with beta 0) with the "quintic" list = you5, 5 steps (119-205, 52-60); 4-D as
      (out, -1) (359-361);
    - `P.add_(O, alpha=-lr * 0.2 * max(fo, fi) ** 0.5)` from the NS output's shape (228, 517, 532,
      _helpers.py:332-336).
    Claim: preset `torch` with you5, match_rms_adamw, pow. Import: see _timm_muon (a stated workaround: timm's
    package import needs torchvision). Momentum in state["momentum_buffer"]."""

    name, preset = "timm.optim.Muon", "torch"
    overrides = {"schedule": "you5", "lr_scale": "match_rms_adamw", "scale_sqrt": "pow"}

    def version(self) -> str:
        return package_version("timm")

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        return _timm_muon().Muon(params, **hp)


class HeavyballMuon(Adapter):
    """heavyball 3.2.1 `heavyball.Muon` (heavyball/__init__.py:684-737; chain `(nesterov_ema, orthogonalize_update)`),
    run eagerly (its `_compilable_*` functions are torch.compile'd with mode "max-autotune-no-cudagraphs",
    utils.py:25, 96-108):
    - EMA in fp32 storage, stochastic copy back (utils.py:1899-1905); Nesterov D = G + M' (utils.py:797-799);
    - orthogonalize_update: `flatten(1, -1)` (chainable.py:1163-1169); NS: `G / norm.clamp(1e-7)` in G's dtype, then
      stochastic rounding to bf16 (utils.py:584-586, 2397-2416), transpose if tall, Horner-form steps with the you5
      list (591-603); update `*= max(1, rows/cols) ** 0.5` (838-839);
    - `p32 * (1 - wd*lr) + u * -lr` with lr an fp32 0-dim tensor, stochastic copy into bf16 params
      (utils.py:2430-2466, chainable.py:2328-2345, 2594).
    Claim: preset `keller` with you5 (its docstring cites Keller Jordan's post). momentum -> betas[0]. Its momentum
    lives in heavyball's nested per-view state (an fp32 copy): the check finds it by value."""

    name, preset = "heavyball.Muon (eager)", "keller"
    overrides = {"schedule": "you5"}

    def version(self) -> str:
        return package_version("heavyball")

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        _run_eagerly()
        import heavyball

        named = dict(hp)
        if "momentum" in named:
            named["betas"] = (named.pop("momentum"), 0.99)
        return heavyball.Muon(params, **named)


class _KerasAsTorch(torch.optim.Optimizer):
    """A keras optimizer stepping keras Variables that mirror torch params: step copies each param into its
    variable, applies the params' gradients through the keras optimizer, and copies the variables back (exact)."""

    def __init__(self, params: list[Tensor], keras_optimizer: Any, variables: list[Any]) -> None:
        super().__init__(params, {})
        self.keras_optimizer, self.variables = keras_optimizer, variables

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        params = [p for g in self.param_groups for p in g["params"]]
        pairs = [(p, v) for p, v in zip(params, self.variables) if p.grad is not None]
        for p, v in pairs:
            v.assign(p.detach().clone())
        self.keras_optimizer.apply([p.grad for p, _ in pairs], [v for _, v in pairs])
        for p, v in pairs:
            p.copy_(v.value)
        return None


class KerasMuon(Adapter):
    """keras 3.15.1 `keras.optimizers.Muon` on the torch backend (keras/src/optimizers/muon.py), stepping keras
    Variables named p0, p1, ... that mirror the params (_KerasAsTorch):
    - AdamW for variables with ndim != 2, paths containing "embedding", exclude_layers (141-151, 208-236);
    - decay first (base_optimizer.py:570-573) as `v - v * wd * lr`, wd and lr cast to v's dtype (293-305);
    - `m += g + m * (mu - 1)` (199); Nesterov `g + mu * m` (200-201);
    - NS in v's dtype (no cast): transpose if tall, `x / (norm + 1e-7)`, `b*A + c*A@A`, `a*x + B@x`, keller
      coefficients (260-291);
    - `v -= ((lr * O) * sqrt(max(rows, cols))) * 0.2`, lr the fp32 lr variable, the sqrt of an int32 tensor in
      float32 (206, 246-258; keras/src/backend/torch/numpy.py:2180-2184).
    Claim: preset `moonlight` (its lr_adjust cites Moonlight's toy_train.py, 256-257) with Nesterov `mul_add`, NS in
    the param's dtype and the scale applied to the update times lr. Momentum: keras's `momentums[i]` of a Muon
    variable (None for an Adam-routed one)."""

    name, preset = "keras.optimizers.Muon (torch backend)", "moonlight"
    overrides = {"nesterov_form": "mul_add", "ns_dtype": None, "scale_apply": "update_lr"}

    def version(self) -> str:
        return package_version("keras")

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        os.environ["KERAS_BACKEND"] = "torch"
        import keras

        if keras.backend.backend() != "torch":
            raise RuntimeError(f"keras was imported with backend {keras.backend.backend()!r}")
        named = dict(hp)
        if "lr" in named:
            named["learning_rate"] = named.pop("lr")
        variables = [
            keras.Variable(
                p.detach().clone(), dtype=str(p.dtype).removeprefix("torch."), name=f"p{i}"
            )
            for i, p in enumerate(params)
        ]
        return _KerasAsTorch(params, keras.optimizers.Muon(**named), variables)

    def momentum(self, opt: torch.optim.Optimizer, p: Tensor) -> Tensor | None:
        kopt = getattr(opt, "keras_optimizer", None)
        if kopt is None or not getattr(kopt, "built", False):
            return None
        params = [q for g in opt.param_groups for q in g["params"]]
        var = opt.variables[next(i for i, q in enumerate(params) if q is p)]
        index = kopt._get_variable_index(var)
        if kopt.adam_velocities[index] is not None or kopt.momentums[index] is None:
            return None
        return kopt.momentums[index].value.detach().reshape(p.shape)


class OptimuonMuon(Adapter):
    """optimuon 0.1.1 `optimuon.Muon` (optimuon/_muon.py, _newton_schulz.py, _corrections.py), defaults:
    - refuses ndim < 2 at construction (_muon.py:236-242);
    - EMA as `_foreach_mul_(M, b)`, `_foreach_add_(M, G, alpha=1-b)` (328-331); Nesterov `(1-b)*G + b*M'` by two
      `_foreach_mul` (349-354);
    - NS: gram_ns=True with fp16 (178-180): square matrices standard NS, `reshape(rows, -1)`, `G / (norm*1.02 +
      1e-6)`, Dion's form (tall iterated as `G.mT @ G`, `a*G + G @ B`), Polar Express = polar_express_modded;
      non-square matrices Gram NS with a restart after step 2; result in the input dtype (_newton_schulz.py);
    - NorMuon rescale of the orthogonalised update, on by default (147, 411-419, _corrections.py:55-79);
    - `O.mul_(max(1, rows/cols) ** 0.5)` (421-427, 59-62); cautious decay `p.sub_(lr*wd*p*(u*p >= 0))` (146,
      446-461, _corrections.py:90-93); `_foreach_add_(P, O, alpha=-lr)`.
    Claim: preset `torch` with its NS (polar_express_modded, eps 1e-6 added, fp16, Dion form), the scale on the
    update by pow, update in fp32; NorMuon, cautious decay, Gram NS and the momentum forms are not muon_ref options.
    Momentum in state["momentum_buffer"]."""

    name, preset = "optimuon.Muon", "torch"
    overrides = {
        "schedule": "polar_express_modded",
        "eps": 1e-6,
        "eps_mode": "add",
        "ns_dtype": torch.float16,
        "step_form": "dion",
        "scale_sqrt": "pow",
        "scale_apply": "update",
        "update_dtype": torch.float32,
    }

    def version(self) -> str:
        return package_version("optimuon")

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        import optimuon

        return optimuon.Muon(params, **hp)


class DtensorMuon(Muonium):
    """dtensor-muon 0.1.0 `dtensor_muon.Muon` (dtensor_muon/optim/optim.py, orthogonalize/, kernels/gram.py), an
    earlier relative of muonium (shipped.Muonium):
    - momentum always fp32: `M.mul_(mu).add_(G32)`, Nesterov `G32.add_(M, alpha=mu)` (optim.py:345-357);
    - `zeropower(G32, steps, strategy="polar_express")` (360) with its default use_triton=True (orthogonalize.py:
      65-99): `pe_loop_triton` under torch.compile, whose Triton Gram kernel asserts CUDA (kernels/gram.py:114); the
      loop: bf16, transpose if tall, `X / (norm*1.02 + 1e-7)`, modded coefficients, Dion's form
      (polar_express.py:19-112);
    - decay folded into u (cautious by default) and scaled by lr*s (365-369), `P32.add_(u, alpha=-float(s * lr))`
      with s = fp32 tensor of math.sqrt(max(1, fo/fi)) (254-256, 372-374); ndim > 2 flattened (155, 239-243).
    Claim: muonium's (shipped.Muonium), with its Nesterov `G + mu*M` as add_alpha, at wd = 0 (passed as `wd`).
    Momentum in state["momentum_buffer"] (fp32, flattened shape)."""

    name = "dtensor_muon.Muon"
    overrides = {
        **Muonium.overrides,
        "nesterov_form": "add_alpha",
        "scale_apply": "alpha",
        "eps": 1e-7,
        "scale_sqrt": "sqrt",
    }

    def version(self) -> str:
        return package_version("dtensor-muon")

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        import dtensor_muon

        return dtensor_muon.Muon(params, wd=0.0, **hp)


class TauonMuon(Adapter):
    """tauon-optimizer 0.1.4 `tauon.tauon` (tauon/optimizer.py), "Fast Muon-like optimizer":
    - coupled L2 `g = g + wd * p` (76-77); `M.mul_(mu).add_(g)` (83); Nesterov `g.add(M, alpha=mu)` (85);
    - only params with min(shape[0], shape[1]) >= 8 are transformed (87), the others take `p -= lr * D` (101-103);
    - the transform (tauon_step.process, 22-55): the top-left S x S block, normalised by `norm + 1e-7`, projected on
      max(4, S/4) DCT vectors, two fixed quintic steps, projected back; columns beyond S keep the raw input; times
      math.sqrt(max(1, fo/fi)); in the param's dtype.
    Claim: preset `moonlight` with the original scale applied to the update and no NS cast (its momentum forms are
    Moonlight's). Momentum in state["momentum_buffer"]."""

    name, preset = "tauon.tauon", "moonlight"
    overrides = {"lr_scale": "original", "scale_apply": "update", "ns_dtype": None}

    def version(self) -> str:
        return package_version("tauon-optimizer")

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        import tauon

        return tauon.tauon(params, **hp)


class TrasMuonAdapter(Adapter):
    """trasmuon-pytorch 0.1.0 `trasmuon.TrasMuon` (trasmuon/optimizer.py):
    - `p.mul_(1 - lr*wd)` (516); fp32 EMA `m.mul_(b1).add_(g32, alpha=1-b1)` (520), no Nesterov;
    - 2-D only (523): NS of m by a torch.compile'd loop (87-112): bf16, transpose if tall, `X / (norm + eps)` with
      eps = 1e-8, you5, Dion's form; then row scaling by an EMA of mean squared rows (559), step
      eta_hat = 0.2 * lr * sqrt(out*in) / ||O_base|| (572), column energy gate, schedule-free gate averaging
      (docstring 35-52, 734-761);
    - other ndim: AdamW fallback (765-781).
    Claim: preset `keller` without Nesterov, with you5, Dion's form and eps 1e-8 (the Muon it builds on).
    momentum -> betas[0]. Momentum in state["momentum"] (fp32)."""

    name, preset = "trasmuon.TrasMuon", "keller"
    overrides = {"nesterov": False, "schedule": "you5", "step_form": "dion", "eps": 1e-8}
    hyperparameters = frozenset({"lr", "weight_decay", "momentum"})
    state_key = "momentum"

    def version(self) -> str:
        return package_version("trasmuon-pytorch")

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        from trasmuon import TrasMuon

        named = dict(hp)
        if "momentum" in named:
            named["betas"] = (named.pop("momentum"), 0.95)
        return TrasMuon(params, **named)


class _PlainStepAsTorch(torch.optim.Optimizer):
    """An optimizer object with step() but no torch.optim base, behind the torch.optim interface."""

    def __init__(self, params: list[Tensor], inner: Any) -> None:
        super().__init__(params, {})
        self.inner = inner

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self.inner.step()
        return None


class TritonMuonAdamW(Adapter):
    """triton-muon-adamw 1.0.0 `TritonMuon` (triton_muon_adamw/muon/triton_muon.py; a plain class, wrapped):
    - `M.mul_(b).add_(G, alpha=1-b)` (346); Nesterov `G + b * (M - G)` (349);
    - `M.bfloat16()`, contiguous transpose if tall, `X / X.norm().clamp(min=1e-7)` (351-356), three Triton kernels
      per step (35-325) with coeffs (3.445, -4.775, 2.0315) (381; Keller's are 3.4445, -4.7750);
    - `P.sub_(lr*wd*P)`, `P.sub_(lr * math.sqrt(max(1, fo/fi)) * O)` with O in the param's dtype (368-372, 424-425).
    Claim: preset `torch`: the package's own PyTorchMuonAdamW presents torch.optim.Muon as its reference
    (optimizer.py:178-235). momentum -> beta. Momentum in the wrapper's `inner.momentum[param]`."""

    name, preset = "triton_muon_adamw.TritonMuon", "torch"

    def version(self) -> str:
        return package_version("triton-muon-adamw")

    def build(self, params: list[Tensor], **hp: Any) -> torch.optim.Optimizer:
        from triton_muon_adamw.muon import TritonMuon

        named = dict(hp)
        if "momentum" in named:
            named["beta"] = named.pop("momentum")
        return _PlainStepAsTorch(params, TritonMuon(params, **named))

    def momentum(self, opt: torch.optim.Optimizer, p: Tensor) -> Tensor | None:
        inner = getattr(opt, "inner", None)
        return None if inner is None else inner.momentum.get(p)


PUBLIC: dict[str, type[Adapter]] = {
    "pytorch-optimizer": PytorchOptimizerMuon,
    "pytorch-optimizer-distributed": PytorchOptimizerDistributedMuon,
    "timm": TimmMuon,
    "heavyball": HeavyballMuon,
    "keras": KerasMuon,
    "optimuon": OptimuonMuon,
    "dtensor-muon": DtensorMuon,
    "tauon": TauonMuon,
    "trasmuon": TrasMuonAdapter,
    "triton-muon-adamw": TritonMuonAdamW,
}
