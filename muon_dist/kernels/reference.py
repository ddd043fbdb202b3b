"""The reference backend: muon_ref.functional.orthogonalize itself (muon_ref's newton_schulz on every block).

Contract: bitwise, by construction: it is the oracle's function (proofs/paths.md: every path runs it on exactly
the global blocks).
"""

from muon_ref import orthogonalize

from . import Backend

BACKEND = Backend("torch", orthogonalize, bitwise=True)
