"""Runs one of NVIDIA Emerging-Optimizers' own test files with its Newton-Schulz served by muon_ref.

`python tests/peers/emerging_run.py CHECKOUT/tests/test_x.py [absltest flags]` (the peer's tests are
absltest programs; tests/peers/run_peer_suites.py calls this, under torchrun for the distributed
ones), from a checkout of https://github.com/NVIDIA-NeMo/Emerging-Optimizers. Every call of
`emerging_optimizers.orthogonalized_optimizers.muon_utils.newton_schulz` whose options muon_ref
expresses (one device, float32 input, no SYRK kernel, no float64 norm; float32 matmul precision
"highest", or "medium" as bf16 steps) runs muon_ref.newton_schulz with the peer's coefficients and
iteration order; the others run the peer's own function. The counts are printed at exit, so a report
says how many of the peer's calls the repo answered.
"""

from __future__ import annotations

import atexit
import runpy
import sys
from collections import Counter
from typing import Any

import torch

from muon_ref import newton_schulz
from muon_ref.schedules import Schedule

COUNTS: Counter[str] = Counter()
# the peer's own iteration order per coefficient type (muon_utils.newton_schulz: repeat_last_types)
REPEAT_LAST = ("polar_express", "cans", "deepseekv4")


def repo_newton_schulz(original: Any, coefficient_sets: dict[str, list]) -> Any:
    def served(
        x: torch.Tensor,
        steps: int,
        coefficient_type: str = "quintic",
        custom_coefficient_sets: list | None = None,
        eps: float = 1e-15,
        transpose: bool | None = None,
        tp_group: Any = None,
        use_syrk: bool = False,
        normalize_in_double: bool = False,
    ) -> torch.Tensor:
        precision = torch.get_float32_matmul_precision()
        triples = (
            custom_coefficient_sets
            if coefficient_type == "custom"
            else coefficient_sets.get(coefficient_type)
        )
        plain = (
            tp_group is None
            and not use_syrk
            and not normalize_in_double
            and transpose is None
            and x.dtype == torch.float32
            and x.ndim in (2, 3)
            and triples
            and steps > 0
            and precision in ("highest", "medium")
            and (coefficient_type != "cubic5" or steps == len(triples))
        )
        if not plain:
            COUNTS["peer"] += 1
            return original(
                x,
                steps,
                coefficient_type,
                custom_coefficient_sets,
                eps,
                transpose,
                tp_group,
                use_syrk,
                normalize_in_double,
            )
        COUNTS["repo"] += 1
        schedule = Schedule(
            name=f"emerging_{coefficient_type}",
            source="Emerging-Optimizers muon_utils",
            coefficients=tuple(tuple(float(v) for v in t) for t in triples),
            policy="repeat_last" if coefficient_type in REPEAT_LAST else "cycle",
            default_steps=steps,
        )
        dtype = torch.bfloat16 if precision == "medium" else torch.float32
        out = newton_schulz(
            x,
            schedule,
            steps=steps,
            eps=eps,
            dtype=dtype,
            step_form="addmm",
            eps_mode="clamp",
            normalize_before_cast=True,
        )
        return out.to(torch.float32)

    return served


def install() -> None:
    import typing

    if not hasattr(
        typing, "override"
    ):  # the peer needs Python 3.12's typing.override; 3.11 has the backport
        import typing_extensions

        typing.override = typing_extensions.override
    from emerging_optimizers.orthogonalized_optimizers import muon_utils

    muon_utils.newton_schulz = repo_newton_schulz(
        muon_utils.newton_schulz, muon_utils._COEFFICIENT_SETS
    )
    atexit.register(
        lambda: print(
            f"newton_schulz calls served by muon_ref: {COUNTS['repo']}, "
            f"by the peer's own code: {COUNTS['peer']}",
            file=sys.stderr,
        )
    )


if __name__ == "__main__":
    install()
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
