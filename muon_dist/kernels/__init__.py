"""Fast orthogonalisation kernels, each checked against muon_ref.newton_schulz (the oracle).

triton_ns: Newton-Schulz with Triton GEMMs (symmetric Gram and polynomial on one triangle of tiles).
It is imported only when used (ns_backend="triton"), so muon_dist never needs triton otherwise.
On a machine without CUDA the kernels run only in Triton's interpreter, which is chosen when the module
is imported: set TRITON_INTERPRET=1 before that import (README.md in this folder).
"""


from typing import Callable

from torch import Tensor

from muon_ref.config import MuonConfig
from muon_ref.functional import MatrixLayout, orthogonalize

Orthogonalize = Callable[[Tensor, MatrixLayout, MuonConfig], Tensor]
BACKENDS: tuple[str, ...] = ("torch", "triton")


def triton_orthogonalize(direction: Tensor, layout: MatrixLayout, cfg: MuonConfig) -> Tensor:
    """muon_ref.functional.orthogonalize with the Triton kernel: each matrix of the layout through
    newton_schulz_triton with the config's schedule, steps, eps, dtype, eps_mode, safety and normalisation.
    Contract: triton_ns's tolerance against muon_ref (its docstring), not bits. The fused step has no
    step_form; the AOL preconditioner is not supported (ValueError)."""
    from .triton_ns import newton_schulz_triton

    kwargs = cfg.ns_kwargs()
    kwargs.pop("step_form")
    if kwargs.pop("precondition") not in (None, "none"):
        raise ValueError("ns_backend='triton' does not support the AOL preconditioner")
    matrices = direction.reshape(layout.matrices_shape)
    return newton_schulz_triton(matrices, **kwargs).reshape(direction.shape)


def orthogonalizer(backend: str) -> Orthogonalize:
    """The per-param orthogonalisation of a backend: "torch" (muon_ref's own, bitwise) or "triton"."""
    if backend == "torch":
        return orthogonalize
    if backend == "triton":
        return triton_orthogonalize
    raise ValueError(f"ns_backend must be one of {BACKENDS}, got {backend!r}")
