"""How far muon_ref.Muon(preset="torch") is from torch.optim.Muon with bf16 params, by shape, under each update
layout (muon_ref.MuonConfig.update_layout; docs/conventions.md).

torch keeps Newton-Schulz's transposed view of a tall matrix (fan_out > fan_in), as muon_ref's "kernel" layout (the
preset's) does; "contiguous" (DistributedMuon's) copies it into row-major order, and a bf16 `P.add(O, alpha=...)`
may round differently for the two memory orders. This prints, per shape and layout, the largest difference of the
params after 1 step in bf16 ulps of the param, and the largest |d| after 10 steps, for nesterov=True (nesterov=False
in bf16 is torch's own in-place buffer normalisation up to torch 2.14).

    python -m benchmarks.torch_bf16_deviation
"""

from __future__ import annotations

import torch

import muon_ref

FAN_OUT = (16, 64, 96, 256)
FAN_IN = (8, 32, 48, 128)


def trajectory(
    cls: type[torch.optim.Optimizer], shape: tuple[int, int], steps: int, **options: str
) -> list[torch.Tensor]:
    param = (
        torch.randn(shape, generator=torch.Generator().manual_seed(0)).bfloat16().requires_grad_()
    )
    opt = cls([param], lr=0.02, nesterov=True, **options)
    gen, out = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        param.grad = torch.randn(shape, generator=gen).bfloat16()
        opt.step()
        out.append(param.detach().float().clone())
    return out


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| in units of the bf16 spacing at want (eps * max(|want|, tiny))."""
    spacing = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(
        torch.finfo(torch.bfloat16).tiny
    )
    return float(((got - want).abs() / spacing).max())


def main() -> None:
    print(f"torch {torch.__version__}; bf16 params, nesterov=True, lr 0.02, wd 0.1")
    print(f"{'fan_out x fan_in':>17} {'layout':>11} {'ulps after 1':>13} {'max |d| after 10':>17}")
    for fan_out in FAN_OUT:
        for fan_in in FAN_IN:
            want = trajectory(torch.optim.Muon, (fan_out, fan_in), 10)
            for layout in ("kernel", "contiguous"):
                got = trajectory(muon_ref.Muon, (fan_out, fan_in), 10, update_layout=layout)
                d10 = float((got[-1] - want[-1]).abs().max())
                print(
                    f"{fan_out:>8} x {fan_in:<6} {layout:>11} {ulps(got[0], want[0]):>13.1f} "
                    f"{d10:>17.3e}"
                )


if __name__ == "__main__":
    main()
