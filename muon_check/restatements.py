"""Written-out restatements of public Muon updates that cannot be installed and run here, op for op.

Each restates one library's single-device update in eager PyTorch, in place, in the library's own
operation order, WITHOUT using any muon_ref code: the presets are checked against these (and against the
real torch.optim.Muon and KellerJordan's muon-optimizer, which are installed), so a restatement that
borrowed muon_ref's functions would make the check circular. muon_check/adapters/origins.py wraps each
as an optimizer behind the conformance check (`python -m muon_check --origins`).

Differences from the shipped code, on purpose and stated: Dion and xtuner run under torch.compile with
hyperparameters wrapped as float32 0-dim tensors; compiled fusion changes bits, so only their eager op
sequence with Python-float hyperparameters is restated. Their distributed batching (all-to-all, AGRS) is
not restated here: it moves data, it does not change the per-matrix arithmetic.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

YOU5 = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]


# --- MoonshotAI/Moonlight examples/toy_train.py (commit abaa96ec) ------------------------------------
def moonlight_ns(G: Tensor, steps: int) -> Tensor:
    assert len(G.shape) == 2
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    if G.size(0) > G.size(1):
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(0) > G.size(1):
        X = X.T
    return X


@torch.no_grad()
def moonlight_step(
    params: list[Tensor], state: dict, lr=1e-3, wd=0.1, momentum=0.95, nesterov=True, ns_steps=5
):
    for p in params:
        g = p.grad
        if g is None:
            continue
        if g.ndim > 2:
            g = g.view(g.size(0), -1)
        st = state.setdefault(p, {})
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = torch.zeros_like(g)
        buf = st["momentum_buffer"]
        buf.mul_(momentum).add_(g)
        g = g.add(buf, alpha=momentum) if nesterov else buf
        u = moonlight_ns(g, steps=ns_steps)
        A, B = p.shape[:2]
        adjusted_lr = lr * (0.2 * math.sqrt(max(A, B)))
        p.data.mul_(1 - lr * wd)
        p.data.add_(u, alpha=-adjusted_lr)


# --- microsoft/dion dion/muon.py (commit 0c205499), eager -----------------------------------------------
def dion_ns(G: Tensor, epsilon: float = 1e-7) -> Tensor:
    X = G.to(dtype=torch.bfloat16)
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + epsilon)
    for a, b, c in YOU5:
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def _sum_momentum_bf16(
    G: list[Tensor], M: list[Tensor], momentum: float, nesterov: bool
) -> list[Tensor]:
    """Dion's and xtuner's muon_update_pre_orthogonalize (identical in both)."""
    G = [g.to(dtype=M[0].dtype) for g in G]
    torch._foreach_mul_(M, momentum)
    torch._foreach_add_(M, G)
    if nesterov:
        U = torch._foreach_mul(M, momentum)
        torch._foreach_add_(U, G)
    else:
        U = M
    return [u.to(dtype=torch.bfloat16) for u in U]


@torch.no_grad()
def dion_step(
    params: list[Tensor],
    state: dict,
    lr=0.01,
    mu=0.95,
    weight_decay=0.01,
    epsilon=1e-8,
    nesterov=False,
    adjust_lr="spectral_norm",
):
    for p in params:
        if p.grad is None:
            continue
        st = state.setdefault(p, {})
        if "momentum" not in st:
            st["momentum"] = torch.zeros_like(p)
        U = _sum_momentum_bf16([p.grad], [st["momentum"]], mu, nesterov)
        shape = p.shape
        X = U[0].flatten(end_dim=-3) if U[0].ndim >= 4 else U[0]
        u = dion_ns(X, epsilon=epsilon).reshape(shape)
        fan_out, fan_in = shape[-2:]
        if adjust_lr == "spectral_norm":
            adjusted_lr = lr * math.sqrt(fan_out / fan_in)
        elif adjust_lr == "rms_norm":
            adjusted_lr = lr * (0.2 * math.sqrt(max(fan_out, fan_in)))
        else:
            adjusted_lr = lr
        torch._foreach_mul_([p.data], 1 - lr * weight_decay)
        V = torch._foreach_mul([u], adjusted_lr)
        torch._foreach_sub_([p.data], V)


# --- InternLM/xtuner xtuner/v1/optim/muon.py (commit 004bc257), eager, single device ------------------
def xtuner_ns(G: Tensor, epsilon: float = 1e-7, num_experts: int = 1) -> Tensor:
    X = G.to(dtype=torch.bfloat16)
    original_shape = X.shape
    N = X.size(-1)
    X = X.view(num_experts, -1, N)
    need_transpose = X.size(-2) > X.size(-1)
    if need_transpose:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + epsilon)
    for a, b, c in YOU5:
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    if need_transpose:
        X = X.mT
    return X.view(original_shape)


@torch.no_grad()
def xtuner_step(
    params: list[Tensor],
    state: dict,
    lr=0.01,
    mu=0.95,
    weight_decay=0.01,
    epsilon=1e-8,
    nesterov=False,
    adjust_lr="rms_norm",
    num_experts=1,
):
    for p in params:
        if p.grad is None:
            continue
        st = state.setdefault(p, {})
        if "momentum" not in st:
            st["momentum"] = torch.zeros_like(p)
        fan_out, fan_in = p.shape[-2] // num_experts, p.shape[-1]
        if adjust_lr == "none":
            ratio = 1.0
        elif adjust_lr == "spectral_norm":
            ratio = math.sqrt(fan_out / fan_in)
        else:
            ratio = 0.2 * math.sqrt(max(fan_out, fan_in))
        U = _sum_momentum_bf16([p.grad], [st["momentum"]], mu, nesterov)
        u = xtuner_ns(U[0], epsilon=epsilon, num_experts=num_experts)
        torch._foreach_mul_([p.data], 1 - lr * weight_decay)
        V = [u]
        torch._foreach_mul_(V, lr * ratio)
        torch._foreach_sub_([p.data], V)


# --- NVIDIA-NeMo/Emerging-Optimizers muon.py + muon_utils.py + orthogonalized_optimizer.py -----------
def emerging_ns(x: Tensor, steps: int = 5, eps: float = 1e-7) -> Tensor:
    if x.dtype != torch.float32:
        raise ValueError(f"Input tensor x must be in float32, got {x.dtype}")
    transpose = x.size(-2) > x.size(-1)
    if transpose:
        x = x.mT
    X = torch.nn.functional.normalize(x, p=2, dim=(-2, -1), eps=eps)
    coefficient_sets = YOU5 * (steps // len(YOU5))
    X = X.to(
        torch.bfloat16
    )  # torch.get_float32_matmul_precision() == "medium" (the default fp32_matmul_prec)
    for i in range(steps):
        a, b, c = coefficient_sets[i]
        A = X @ X.mT
        B = torch.addmm(A, A, A, alpha=c, beta=b)
        X = torch.addmm(X, B, X, alpha=1.0, beta=a)
    X = X.to(torch.float32)
    if transpose:
        X = X.mT
    return X


@torch.no_grad()
def emerging_step(
    params: list[Tensor],
    state: dict,
    lr=3e-4,
    momentum_beta=0.95,
    weight_decay=0.01,
    use_nesterov=False,
    num_ns_steps=5,
    extra_scale_factor=1.0,
):
    for p in params:
        grad = p.grad
        if grad is None:
            continue
        st = state.setdefault(p, {})
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = torch.zeros_like(grad)
        exp_avg = st["momentum_buffer"]
        if weight_decay > 0.0:
            p.add_(p, alpha=(-(weight_decay * lr)))
        exp_avg.lerp_(grad, 1 - momentum_beta)
        grad = grad.lerp(exp_avg, momentum_beta) if use_nesterov else exp_avg
        orth = emerging_ns(grad, steps=num_ns_steps)
        scale_factor = max(grad.size(-2), grad.size(-1)) ** 0.5
        update = orth * scale_factor * extra_scale_factor
        p.add_(update, alpha=-lr)
