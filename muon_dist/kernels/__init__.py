"""Fast orthogonalisation kernels, each checked against muon_ref.newton_schulz (the oracle).

triton_ns: Newton-Schulz with Triton GEMMs (symmetric Gram and polynomial on one triangle of tiles).
It is not imported here, so muon_dist never needs triton: `from muon_dist.kernels.triton_ns import ...`.
On a machine without CUDA the kernels run only in Triton's interpreter, which is chosen when the module
is imported: set TRITON_INTERPRET=1 before that import (README.md in this folder).
"""
