"""Each backend's contract, measured the same way for all: `python -m muon_dist.kernels.contracts`.

    python -m muon_dist.kernels.contracts [--backends torch triton gram] [--device cpu|cuda] [--dtypes ...]
                                          [--schedules keller you5 ...] [--cases 8] [--max-side 64]

Reference equations of the two measured quantities, for a backend B, a config cfg and an input G [k, m, n]:
    difference(B, cfg, G) = max |B.orthogonalize(G, layout(G), cfg) - newton_schulz(G, **cfg.ns_kwargs())|
    band(B, cfg, G)       = [min, max] of signed_singular_values(B.orthogonalize(G, layout(G), cfg), G)
                            over G's nonzero singular directions (the exact polar factor's band is [1, 1])
with cfg = MuonConfig(schedule=..., ns_dtype=dtype) (eps 1e-7 clamped, step_form "addmm": torch.optim.Muon's).
signed_singular_values is diag(U^T X V) for G = U S V^T (muon_ref.polar): a flipped sign shows as a negative value.
Each band is printed beside muon_ref.newton_schulz's on the same inputs: the schedule and the dtype set that one; a
backend moves each value by at most ||B(G) - NS(G)||_2 <= sqrt(m n) difference(B, cfg, G) (|u^T E v| <= ||E||_2).

Inputs (contract_inputs), `cases` seeds of each kind: "gaussian", stacks [1-3, m, n] with n / m in [2, 8], either
way round; and the harder kinds of notebooks/ns_numerics.py as [2, s, 3 s] stacks, s = max_side / 3: "square"
([2, s, s] Gaussian: its smallest singular values are near 0), "low_rank" (rank 4 plus 1e-3 noise),
"ill_conditioned" (singular values from 1 to 1e-6, log-spaced) and "rank_one". On the harder kinds the band's
lower end is the schedule's (singular values far below its range stay small, and fp32 rounding gives a rank-one
input tiny nonzero ones): what a backend must not do there is overshoot, flip a sign further, or blow up.
"""

from __future__ import annotations

import argparse
import os
import random

import torch
from torch import Tensor

from muon_ref import MuonConfig, matrix_layout, newton_schulz, signed_singular_values

from . import BACKENDS, backend

KINDS: tuple[str, ...] = ("gaussian", "square", "low_rank", "ill_conditioned", "rank_one")
# a singular value below this fraction of the largest counts as G's null space (no target value). The float32
# rounding of a rank-one input leaves singular values near 1e-8 of the largest: they count, and map near 0
NULL_RTOL = 1e-10


def _orthonormal(rows: int, cols: int, g: torch.Generator) -> Tensor:
    return torch.linalg.qr(torch.randn(rows, cols, generator=g, dtype=torch.float64))[0]


def contract_inputs(kind: str, seed: int, max_side: int) -> Tensor:
    """One float32 input [k, m, n] of the kind (module docstring), from a generator seeded with `seed`."""
    g, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    s = max(4, max_side // 3)
    if kind == "gaussian":
        m = rng.randint(4, max(4, max_side // 2))
        n = rng.randint(2 * m, max(2 * m, min(8 * m, max_side)))
        G = randn(rng.randint(1, 3), *((m, n) if rng.random() < 0.5 else (n, m)))
    elif kind == "square":
        G = randn(2, s, s)
    elif kind == "low_rank":
        G = randn(2, s, 4) @ randn(2, 4, 3 * s) + 1e-3 * randn(2, s, 3 * s)
    elif kind == "ill_conditioned":
        spectrum = torch.diag(torch.logspace(0, -6, s, dtype=torch.float64))
        G = torch.stack(
            [_orthonormal(s, s, g) @ spectrum @ _orthonormal(3 * s, s, g).mT for _ in range(2)]
        )
    elif kind == "rank_one":
        G = randn(2, s, 1) @ randn(2, 1, 3 * s)
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return G.float()


def band(X: Tensor, G: Tensor) -> tuple[float, float]:
    """[min, max] of X's signed singular values on G's nonzero singular directions (module docstring); NaN when X
    has a NaN."""
    d = signed_singular_values(X, G)
    S = torch.linalg.svdvals(G.double())
    d = d[S > NULL_RTOL * S.amax(dim=-1, keepdim=True)]
    return float(d.min()), float(d.max())


def measure(
    name: str, cfg: MuonConfig, kind: str, seeds: range, max_side: int, device: torch.device
) -> dict[str, float]:
    """difference and bands (module docstring) of backend `name` under cfg, over the inputs of `kind` at `seeds`;
    a NaN anywhere makes the figure NaN (torch's min and max propagate it, Python's would drop it)."""
    orthogonalize = backend(name).orthogonalize
    rows = []  # per seed: difference, backend's band, muon_ref's band
    for seed in seeds:
        G = contract_inputs(kind, seed, max_side).to(device)
        got = orthogonalize(G, matrix_layout(G.shape), cfg)
        want = newton_schulz(G, **cfg.ns_kwargs())
        rows.append(
            [
                float((got.double() - want.double()).abs().max()),
                *band(got.cpu(), G.cpu()),
                *band(want.cpu(), G.cpu()),
            ]
        )
    table = torch.tensor(rows, dtype=torch.float64)
    high, low = table.amax(dim=0), table.amin(dim=0)
    return {
        "difference": float(high[0]),
        "low": float(low[1]),
        "high": float(high[2]),
        "ref_low": float(low[3]),
        "ref_high": float(high[4]),
    }


def _default_dtypes(name: str, device: torch.device) -> list[str]:
    """float32, float16 and bfloat16; but not bfloat16 for Triton in its interpreter, whose bf16 tl.dot is wrong
    (docs/testing.md): its figures would be the interpreter's, not the kernel's."""
    interpreted = name == "triton" and device.type == "cpu"
    return ["float32", "float16"] + ([] if interpreted else ["bfloat16"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m muon_dist.kernels.contracts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--backends", nargs="+", choices=sorted(BACKENDS), default=sorted(BACKENDS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=None,
        help="compute dtypes (default: float32 float16 bfloat16; the Triton interpreter skips bf16)",
    )
    parser.add_argument("--schedules", nargs="+", default=["keller", "you5", "polar_express"])
    parser.add_argument(
        "--cases",
        type=int,
        default=8,
        help="inputs of each kind per dtype and schedule (default 8)",
    )
    parser.add_argument("--max-side", type=int, default=64, help="largest matrix side (default 64)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if (
        device.type == "cpu"
    ):  # Triton runs on CPU only in its interpreter, chosen before the kernels are imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    print(
        f"contracts on {device.type}, torch {torch.__version__}: max |backend - muon_ref.newton_schulz| and signed "
        f"singular-value bands [min, max] (backend / muon_ref); {args.cases} inputs of each kind, sides <= "
        f"{args.max_side}"
    )
    for name in args.backends:
        dtypes = args.dtypes or _default_dtypes(name, device)
        for dtype in dtypes:
            for schedule in args.schedules:
                cfg = MuonConfig(schedule=schedule, ns_dtype=getattr(torch, dtype))
                print(f"{name} {dtype} {schedule}:")
                for kind in KINDS:
                    r = measure(name, cfg, kind, range(args.cases), args.max_side, device)
                    print(
                        f"    {kind:<16} max |diff| {r['difference']:<8.2g} band [{r['low']:.4g}, {r['high']:.4g}]"
                        f" / [{r['ref_low']:.4g}, {r['ref_high']:.4g}]"
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
